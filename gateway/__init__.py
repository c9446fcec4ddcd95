"""OpenAI-compatible REST + SSE gateway (FastAPI) in front of the schedulers, over a bus.

`gateway.app.create_app` builds the app over a `dspark.bus.Bus`; `gateway.server.serve` is what
`dspark serve` runs (in-memory bus + worker + engine in one process); `gateway.cli` is
`dspark gateway --redis URL` (the gateway alone over the Redis bus).
"""
