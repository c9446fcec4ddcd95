"""ASGI middleware in front of every route: API keys, per-client limits, the body size limit.

It runs before routing and body parsing, so a refused request costs no JSON parsing and never
reaches a handler. In order:
1. Keys come as `Authorization: Bearer <key>` (what the OpenAI clients send) and are checked
   against SHA-256 hashes in constant time (gateway/api_keys.py); a missing or wrong key gets
   401 with OpenAI's `invalid_api_key` body. The client is then the key's id; without keys
   configured, the connection's address (`ip:<address>`; behind a proxy that is the proxy's,
   unless uvicorn's --forwarded-allow-ips trusts its X-Forwarded-For).
2. A declared body over `max_body_bytes` gets 413 at once.
3. The limiter (gateway/rate_limit.py) takes a request-per-minute token and an in-flight slot
   for the client, or the request gets 429 with OpenAI's `rate_limit_exceeded` body and a
   Retry-After header (503 if the limiter's Redis is unreachable: limits are not skipped).
   The slot is released when the app has finished the response, a stream included, or the
   client has gone: the app's call returns only then.
4. The body is read (up to `max_body_bytes`, else 413) and replayed to the app, after which the
   app's `receive` is the server's again (so handlers still see `http.disconnect`).
Paths in `open_paths` (the probes, the round view's static page) skip keys and limits; paths in
`unmetered_paths` (the round view's event stream: open as long as the page is) need the key but
take no request token or in-flight slot. The key's id is left in the request's state
(`request.state.api_key_id`) for logs and metrics; the key itself is never logged.
"""

from __future__ import annotations

import json
from collections.abc import Iterable

import anyio

from gateway.api_keys import ApiKeys
from gateway.errors import error_body
from gateway.rate_limit import LimiterUnavailable, RateLimited, RateLimiter

__all__ = ["RequestGuard"]

BODY_METHODS = (b"POST", b"PUT", b"PATCH")


class RequestGuard:
    def __init__(self, app, *, api_keys: ApiKeys | Iterable[str] = (), max_body_bytes: int = 1 << 20,
                 rate_limiter: RateLimiter | None = None, open_paths: Iterable[str] = ("/health",),
                 unmetered_paths: Iterable[str] = ()):
        if max_body_bytes < 1:
            raise ValueError(f"max_body_bytes must be >= 1, got {max_body_bytes}")
        self.app = app
        self.api_keys = api_keys if isinstance(api_keys, ApiKeys) else ApiKeys.from_entries(api_keys)  # hashed here
        self.max_body_bytes = max_body_bytes
        self.rate_limiter = rate_limiter if rate_limiter is not None and rate_limiter.limits.enabled else None
        self.open_paths = frozenset(open_paths)
        self.unmetered_paths = frozenset(unmetered_paths)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        guarded = scope.get("path") not in self.open_paths
        client = None
        if guarded:
            client = self._client(scope, headers)
            if client is None:
                await _send_error(send, 401, "Incorrect or missing API key: send `Authorization: Bearer <key>`.",
                                  code="invalid_api_key", extra_headers=[(b"www-authenticate", b"Bearer")])
                return
        has_body = scope.get("method", "").encode() in BODY_METHODS
        declared = headers.get(b"content-length", b"")
        if has_body and declared.isdigit() and int(declared) > self.max_body_bytes:
            await self._too_large(send)
            return
        lease = None
        if guarded and self.rate_limiter is not None and scope.get("path") not in self.unmetered_paths:
            try:
                lease = await self.rate_limiter.acquire(client)
            except RateLimited as e:
                await _send_error(send, 429, e.message, type="rate_limit_error", code="rate_limit_exceeded",
                                  extra_headers=[(b"retry-after", e.retry_after_header.encode())])
                return
            except LimiterUnavailable as e:
                await _send_error(send, 503, f"{e}; retry later", type="server_error", code="rate_limiter_unavailable",
                                  extra_headers=[(b"retry-after", b"1")])
                return
        try:
            await self._serve(scope, receive, send, has_body)
        finally:
            if lease is not None:
                with anyio.move_on_after(5, shield=True):  # also while the request is being cancelled
                    await lease.release()

    def _client(self, scope, headers: dict[bytes, bytes]) -> str | None:
        """Who the request is from for the limits: the key's id, or the address without keys;
        None for a missing or wrong key."""
        if not self.api_keys:
            peer = scope.get("client")
            return f"ip:{peer[0]}" if peer else "ip:unknown"
        scheme, _, key = headers.get(b"authorization", b"").partition(b" ")
        key = key.strip()
        if scheme.lower() != b"bearer" or not key:
            return None
        key_id = self.api_keys.identify(key)
        if key_id is not None:
            scope.setdefault("state", {})["api_key_id"] = key_id
        return key_id

    async def _serve(self, scope, receive, send, has_body: bool) -> None:
        if not has_body:
            await self.app(scope, receive, send)
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

    async def _too_large(self, send) -> None:
        await _send_error(send, 413, f"The request body exceeds this server's limit of {self.max_body_bytes} bytes.",
                          code="request_too_large")


async def _send_error(send, status: int, message: str, *, code: str, type: str = "invalid_request_error",
                      extra_headers: list | None = None) -> None:
    payload = json.dumps(error_body(message, type=type, code=code)).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode()), *(extra_headers or [])]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": payload})
