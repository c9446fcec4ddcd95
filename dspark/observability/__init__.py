"""Observability of the serving system: OpenTelemetry traces and Prometheus metrics.

- tracing.py       tracer set-up (OTLP, off unless configured), W3C context propagation, span helpers
- grpc_tracing.py  gRPC interceptors: trace context in metadata, CLIENT / SERVER spans
- asgi.py          the gateway's middleware: a span per HTTP request, HTTP metrics
- rounds.py        one engine round: its spans (round > draft, schedule, verify), its metrics, its round event
- round_feed.py    the round events (RoundEvent) and their fan-out to the live round view, only while watched
- metrics.py       the Prometheus metrics and their exposition (/metrics)

Configuration: the `observability` section of dspark/serving_config.py.
"""
