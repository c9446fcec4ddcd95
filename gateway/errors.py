"""OpenAI-style errors: `{"error": {"message", "type", "param", "code"}}` with the right HTTP status.

`ApiError` is raised anywhere in the gateway and turned into that body by the app's exception
handler (or, once a stream's headers are out, into an in-band `data:` event by the SSE writer).
"""

from __future__ import annotations

import json

from gateway.openai_schema import ErrorDetail, ErrorResponse

__all__ = ["ApiError", "error_body", "error_json"]


class ApiError(Exception):
    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 type: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type


def error_body(message: str, *, type: str, param: str | None = None, code: str | None = None) -> dict:
    return ErrorResponse(error=ErrorDetail(message=_printable(message), type=type, param=_printable(param), code=code)).model_dump()


def _printable(text: str | None) -> str | None:
    """`text` encodable as UTF-8: a message or parameter path may quote the client's input, and JSON
    lets that carry lone surrogates ("\\ud800"), which would make the error body itself fail."""
    return None if text is None else text.encode("utf-8", "backslashreplace").decode("utf-8")


def error_json(e: ApiError) -> str:
    return json.dumps(error_body(e.message, type=e.type, param=e.param, code=e.code), separators=(",", ":"))
