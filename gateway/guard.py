"""ASGI middleware in front of every route: API keys and the request body size limit.

It runs before routing and body parsing, so an unauthenticated or oversized request costs no
JSON parsing and never reaches a handler. Keys come as `Authorization: Bearer <key>` (what the
OpenAI clients send); a missing or wrong key gets 401 with OpenAI's `invalid_api_key` body.
The body is read here (up to `max_body_bytes`, else 413) and replayed to the app, after which
the app's `receive` is the server's again (so handlers still see `http.disconnect`).
"""

from __future__ import annotations

import hmac
import json
from collections.abc import Iterable

from gateway.errors import error_body

__all__ = ["RequestGuard"]

BODY_METHODS = (b"POST", b"PUT", b"PATCH")


class RequestGuard:
    def __init__(self, app, *, api_keys: Iterable[str] = (), max_body_bytes: int = 1 << 20,
                 open_paths: Iterable[str] = ("/health",)):
        if max_body_bytes < 1:
            raise ValueError(f"max_body_bytes must be >= 1, got {max_body_bytes}")
        self.app = app
        self.api_keys = tuple(k.encode() for k in api_keys if k)
        self.max_body_bytes = max_body_bytes
        self.open_paths = frozenset(open_paths)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        if self.api_keys and scope.get("path") not in self.open_paths and not self._authorized(headers):
            await _send_error(send, 401, "Incorrect or missing API key: send `Authorization: Bearer <key>`.",
                              code="invalid_api_key", extra_headers=[(b"www-authenticate", b"Bearer")])
            return
        if scope.get("method", "").encode() not in BODY_METHODS:
            await self.app(scope, receive, send)
            return
        declared = headers.get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.max_body_bytes:
            await self._too_large(send)
            return
        body, more = bytearray(), True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return  # the client left before sending its body
            body += message.get("body", b"")
            more = message.get("more_body", False)
            if len(body) > self.max_body_bytes:
                await self._too_large(send)
                return
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": bytes(body), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    def _authorized(self, headers: dict[bytes, bytes]) -> bool:
        scheme, _, key = headers.get(b"authorization", b"").partition(b" ")
        key = key.strip()
        if scheme.lower() != b"bearer" or not key:
            return False
        return any(hmac.compare_digest(key, k) for k in self.api_keys)

    async def _too_large(self, send) -> None:
        await _send_error(send, 413, f"The request body exceeds this server's limit of {self.max_body_bytes} bytes.",
                          code="request_too_large")


async def _send_error(send, status: int, message: str, *, code: str, extra_headers: list | None = None) -> None:
    payload = json.dumps(error_body(message, type="invalid_request_error", code=code)).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode()), *(extra_headers or [])]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": payload})
