"""OpenAI-compatible REST + SSE gateway (FastAPI) in front of the speculative engine.

`gateway.app.create_app` builds the app over an `AsyncEngine`; `gateway.server.serve` is what
`dspark serve` runs: load the model, warm it up, serve with uvicorn in one process.
"""
