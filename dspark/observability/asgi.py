"""ASGI middleware for the HTTP gateway: a SERVER span per request and the HTTP metrics.

    app.add_middleware(TelemetryMiddleware)     # gateway/app.py: outermost, so 401s and 413s count too

Each HTTP request is a span `<METHOD> <route>` (e.g. `POST /v1/chat/completions`) that continues
the caller's W3C `traceparent` header if it sends one, and stays current while the handler runs:
the request the gateway puts on the bus carries it on (dspark/observability/tracing.py). The span
lasts until the last byte of the response, a streamed one included, and records the status code.
Probe and scrape paths (/health, /live, /metrics) are counted but not traced: a probe every few
seconds would bury the traces worth looking at. Metrics: dspark_http_requests_total{method,
route,status} and dspark_http_request_duration_seconds{method,route}, where `route` is the
route's template (`/v1/models/{name:path}`), or "other" for a path the app does not serve.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

from opentelemetry.trace import SpanKind, Status, StatusCode

from dspark.observability import tracing
from dspark.observability.metrics import gateway_metrics

__all__ = ["UNTRACED_PATHS", "TelemetryMiddleware"]

UNTRACED_PATHS = ("/health", "/live", "/metrics")
_CONTEXT_HEADERS = (b"traceparent", b"tracestate")


def _route(scope) -> str:
    """The matched route's template; for a request answered before routing (401, 413) the path
    if the app serves it; else "other" (labels must not take arbitrary client-chosen paths)."""
    route = scope.get("route")
    if route is not None and getattr(route, "path", None):
        return route.path
    path, app = scope.get("path", ""), scope.get("app")
    if app is not None and any(getattr(r, "path", None) == path for r in getattr(app, "routes", ())):
        return path
    return "other"


class TelemetryMiddleware:
    def __init__(self, app, *, untraced_paths: Iterable[str] = UNTRACED_PATHS):
        self.app = app
        self.untraced_paths = frozenset(untraced_paths)
        self.metrics = gateway_metrics()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        method = scope.get("method", "GET")
        status = 500  # if the app raises before answering, the server answers 500

        async def send_and_watch(message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        t0 = time.perf_counter()
        if scope.get("path") in self.untraced_paths:
            try:
                await self.app(scope, receive, send_and_watch)
            finally:
                self.metrics.record_request(method=method, route=_route(scope), status=status, seconds=time.perf_counter() - t0)
            return
        parent = tracing.extract({k.decode("latin-1"): v.decode("latin-1") for k, v in scope.get("headers") or ()
                                  if k in _CONTEXT_HEADERS})
        attributes = {"http.request.method": method, "url.path": scope.get("path", ""), "url.scheme": scope.get("scheme", "http")}
        with tracing.tracer().start_as_current_span(f"{method} {scope.get('path', '')}", context=parent, kind=SpanKind.SERVER,
                                                    attributes=attributes) as span:
            try:
                await self.app(scope, receive, send_and_watch)
            finally:
                route = _route(scope)
                self.metrics.record_request(method=method, route=route, status=status, seconds=time.perf_counter() - t0)
                if span.is_recording():
                    span.update_name(f"{method} {route}")
                    span.set_attribute("http.route", route)
                    span.set_attribute("http.response.status_code", status)
                    if status >= 500:
                        span.set_status(Status(StatusCode.ERROR, f"HTTP {status}"))
