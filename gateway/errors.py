"""OpenAI-style errors: `{"error": {"message", "type", "param", "code"}}` with the right HTTP status.

`ApiError` is raised anywhere in the gateway and turned into that body by the app's exception
handler (or, once a stream's headers are out, into an in-band `data:` event by the SSE writer).
`bus_unavailable` is the one answer to a bus that cannot be reached (Redis down or restarting):
503 with a Retry-After header, never a 500.
"""

from __future__ import annotations

import json
import logging

from gateway.openai_schema import ErrorDetail, ErrorResponse

__all__ = ["BUS_RETRY_AFTER_S", "ApiError", "bus_unavailable", "error_body", "error_json"]

log = logging.getLogger(__name__)

BUS_RETRY_AFTER_S = 1  # what Retry-After says while the bus is unreachable (a Redis restart takes seconds)


class ApiError(Exception):
    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 type: str = "invalid_request_error", headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type
        self.headers = headers or {}  # extra response headers, e.g. Retry-After


def bus_unavailable(e: Exception) -> ApiError:
    """The 503 for a bus call that failed to reach its server (dspark.bus.base.BusUnavailable, a
    ConnectionError): the client may retry, the same request or a stream's Last-Event-ID. The
    cause (which names Redis's address) goes to the log, not to the client."""
    log.warning("answering 503: the request bus is unavailable: %s", e)
    return ApiError(503, "the request bus is unavailable; retry later", type="server_error", code="bus_unavailable",
                    headers={"Retry-After": str(BUS_RETRY_AFTER_S)})


def error_body(message: str, *, type: str, param: str | None = None, code: str | None = None) -> dict:
    return ErrorResponse(error=ErrorDetail(message=_printable(message), type=type, param=_printable(param), code=code)).model_dump()


def _printable(text: str | None) -> str | None:
    """`text` encodable as UTF-8: a message or parameter path may quote the client's input, and JSON
    lets that carry lone surrogates ("\\ud800"), which would make the error body itself fail."""
    return None if text is None else text.encode("utf-8", "backslashreplace").decode("utf-8")


def error_json(e: ApiError) -> str:
    return json.dumps(error_body(e.message, type=e.type, param=e.param, code=e.code), separators=(",", ":"))
