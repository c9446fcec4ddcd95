"""The gateway's HTTP connection limits: how many connections, and how slowly a client may send.

    server = uvicorn.Server(uvicorn_config(app, limits=ServingConfig.load().gateway, host="127.0.0.1", port=8000))
    server.run()

uvicorn closes idle keep-alive connections and bounds the header size, but waits forever for a
client that opens a connection and sends nothing, or trickles its headers or body a byte at a
time (slowloris): enough of them and no slot is left for anyone else. `LimitedH11Protocol` is
uvicorn's h11 protocol with
  * a read deadline per phase of a request: its line and headers within `header_timeout_s` of
    the connection opening (or of its first byte on a kept-alive connection), its body within
    `body_timeout_s` of the headers. A client that misses it gets 408 with OpenAI's error body
    (or, if it sent nothing at all, a plain close) and its connection is closed; the app sees a
    disconnect.
  * request line + headers of at most `max_header_bytes` (431 beyond, 400 if h11 gives up first);
  * a cap on open connections, `max_connections`: a request on a connection beyond it is answered
    503 (OpenAI's error body, `connection: close`) without reaching the app, so requests already
    running keep their slots and finish; only the probes (/live, /health) are still answered.
  * a write deadline for slow readers, `slow_reader_timeout_s`: see below.
  * on shutdown, a round view event stream (/ui/events: it never ends by itself, and uvicorn waits
    for every response to end) is closed at once; its page reconnects to the next server.

Slow readers. A client that opens a stream (`stream: true`) and never reads it costs no unbounded
memory: uvicorn stops writing once the transport's buffer passes its high-water mark (64 KiB,
`pause_writing`) and its `send` awaits the drain, so the SSE generator stops at its next `yield`
(the generation itself ends at max_tokens, its output held by the bus). But nothing ever ends
that wait: the request's handler, its connection, its per-key concurrency slot and its bus tail
are held for as long as the client keeps the socket open. So a connection whose transport stays
paused for `slow_reader_timeout_s` (the client did not take enough to bring the buffer below its
low-water mark, 16 KiB: about 48 KiB) is aborted: `abort()`, not `close()`, which would wait for
the buffer to drain; the app then sees http.disconnect, exactly as when the client leaves, and
the gateway cancels the generation on the bus (gateway/app.py). A client that reads restarts the
clock each time the buffer drains (at 30 s, any client faster than about 2 KB/s is never cut).
Before that, the kernel's socket buffer absorbs what the client does not read, and Linux grows it
to megabytes (on loopback a whole response fits, and the wait never begins): with
TCP_NOTSENT_LOWAT the kernel holds at most UNSENT_BYTES not yet sent, so a stalled client fills
the transport's buffer (and starts this deadline) after about 100 KB, not after megabytes. (Sent
but unacknowledged data stays bounded by the client's receive window.)
All limits live in dspark/serving_config.py's gateway section; `uvicorn_config` is the one place
that turns them into a server configuration (`dspark serve` and `dspark gateway` both use it).
"""

from __future__ import annotations

import asyncio
import functools
import json
import socket

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from dspark.serving_config import GatewaySection
from gateway.errors import error_body
from gateway.round_view import EVENTS_PATH

__all__ = ["LimitedH11Protocol", "uvicorn_config"]

PROBE_PATHS = frozenset({"/live", "/health"})  # answered even beyond the connection cap
UNSENT_BYTES = 16384  # TCP_NOTSENT_LOWAT: unsent bytes the kernel may hold per connection (module docstring)


def _bound_unsent_bytes(transport: asyncio.Transport) -> None:
    """Let the kernel hold at most UNSENT_BYTES not yet sent on this connection (Linux, macOS), so
    that a client that stops reading fills the transport's buffer, where it is seen, within about
    100 KB. Elsewhere, or on a Unix socket, the kernel's own limit stays (the deadline then starts later)."""
    sock = transport.get_extra_info("socket")
    option = getattr(socket, "TCP_NOTSENT_LOWAT", None)
    if sock is None or option is None or sock.family not in (socket.AF_INET, socket.AF_INET6):
        return
    try:
        sock.setsockopt(socket.IPPROTO_TCP, option, UNSENT_BYTES)
    except OSError:  # an old kernel: the default holds
        pass


def _json_response(status: int, reason: str, message: str, *, type: str, code: str) -> bytes:
    """A complete HTTP/1.1 response with OpenAI's error body that closes the connection."""
    body = json.dumps(error_body(message, type=type, code=code)).encode()
    head = (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
            "connection: close\r\n\r\n")
    return head.encode() + body


def _header_size_checked(app, limit: int):
    """`app`, but a request whose line and headers exceed `limit` bytes gets 431. (h11 bounds only
    headers that arrive in pieces; a large block read at once is parsed whole.)"""
    body = json.dumps(error_body(f"The request's headers exceed this server's limit of {limit} bytes.",
                                 type="invalid_request_error", code="request_header_fields_too_large")).encode()

    async def checked(scope, receive, send) -> None:
        size = len(scope.get("raw_path", b"")) + len(scope.get("query_string", b"")) + sum(
            len(name) + len(value) + 4 for name, value in scope.get("headers", ()))  # "name: value\r\n"
        if scope["type"] == "http" and size > limit:
            await send({"type": "http.response.start", "status": 431, "headers": [
                (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()), (b"connection", b"close")]})
            await send({"type": "http.response.body", "body": body})
            return
        await app(scope, receive, send)

    return checked


def _too_many_connections_app(app, limit: int):
    """The ASGI app a connection beyond the cap is served by: 503 without touching `app`, except for
    the probes (a flood must not make Kubernetes restart a healthy gateway)."""
    body = json.dumps(error_body(f"The server has too many open connections (limit {limit}); retry later.",
                                 type="server_error", code="too_many_connections")).encode()

    async def refuse(scope, receive, send) -> None:
        if scope.get("path") in PROBE_PATHS:
            await app(scope, receive, send)
            return
        await send({"type": "http.response.start", "status": 503, "headers": [
            (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
            (b"connection", b"close"), (b"retry-after", b"1")]})
        await send({"type": "http.response.body", "body": body})

    return refuse


class LimitedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with read deadlines and a connection cap (module docstring)."""

    def __init__(self, *args, limits: GatewaySection, **kwargs):
        super().__init__(*args, **kwargs)
        self.limits = limits
        self.app = _header_size_checked(self.app, limits.max_header_bytes)
        self._phase: str | None = None  # "headers" | "body" | None: what the running deadline waits for
        self._deadline: asyncio.TimerHandle | None = None
        self._received_any = False  # whether the request now awaited has sent a byte (else a timeout closes silently)
        self._slow_reader: asyncio.TimerHandle | None = None  # runs while the transport's write buffer is full

    # ---- the asyncio.Protocol interface ----

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        _bound_unsent_bytes(transport)
        if len(self.connections) > self.limits.max_connections:
            self.app = _too_many_connections_app(self.app, self.limits.max_connections)  # this connection only
        self._start("headers")

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._received_any = self._received_any or bool(data)
        self._follow_request()

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop()
        self._stop_slow_reader_deadline()
        super().connection_lost(exc)

    def pause_writing(self) -> None:
        """The write buffer passed its high-water mark: the client takes less than we send."""
        super().pause_writing()
        if self._slow_reader is None:
            self._slow_reader = self.loop.call_later(self.limits.slow_reader_timeout_s, self._on_slow_reader)

    def resume_writing(self) -> None:
        """The buffer drained below its low-water mark: the client reads."""
        super().resume_writing()
        self._stop_slow_reader_deadline()

    def on_response_complete(self) -> None:
        super().on_response_complete()  # may start the next pipelined request
        if not self.transport.is_closing():
            self._received_any = bool(self.conn.trailing_data[0])
            self._follow_request()

    def shutdown(self) -> None:
        """The server shuts down: close a round view stream now; uvicorn lets anything else finish."""
        cycle = self.cycle
        if cycle is not None and not cycle.response_complete and cycle.scope.get("path") == EVENTS_PATH:
            self.transport.close()  # the app sees http.disconnect from connection_lost
            return
        super().shutdown()

    def send_400_response(self, msg: str) -> None:
        """A request h11 cannot parse (malformed, or headers over `max_header_bytes`): OpenAI's error
        body instead of uvicorn's plain text, then close."""
        self.transport.write(_json_response(400, "Bad Request", f"{msg} (malformed, or headers over "
                                            f"{self.limits.max_header_bytes} bytes)", type="invalid_request_error",
                                            code="invalid_http_request"))
        self.transport.close()

    # ---- deadlines ----

    def _follow_request(self) -> None:
        """Run the deadline of the phase the client's side of the connection is in."""
        state = self.conn.their_state
        if state is h11.IDLE:
            # a request has begun arriving (bytes are buffered) or none has come yet on a new
            # connection; an idle kept-alive connection is uvicorn's keep-alive timer's
            busy = bool(self.conn.trailing_data[0]) or self._phase == "headers"
            phase = "headers" if busy else None
        elif state is h11.SEND_BODY:
            phase = "body"
        else:
            phase = None
        if phase != self._phase:
            self._start(phase)

    def _start(self, phase: str | None) -> None:
        self._stop()
        self._phase = phase
        if phase is not None:
            seconds = self.limits.header_timeout_s if phase == "headers" else self.limits.body_timeout_s
            self._deadline = self.loop.call_later(seconds, self._on_deadline, phase)

    def _stop(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None
        self._phase = None

    def _on_deadline(self, phase: str) -> None:
        self._deadline = None
        if self.transport.is_closing():
            return
        responded = self.cycle is not None and self.cycle.response_started and phase == "body"
        if self._received_any and not responded:
            seconds = self.limits.header_timeout_s if phase == "headers" else self.limits.body_timeout_s
            self.transport.write(_json_response(
                408, "Request Timeout", f"The request's {phase} did not arrive within {seconds:g} s; the connection is closed.",
                type="invalid_request_error", code="request_timeout"))
        self.logger.info("closing a connection from %s: its request %s took longer than allowed", self.client, phase)
        # the app (if it runs) sees http.disconnect from connection_lost, which the close triggers
        self.transport.close()

    # ---- slow readers ----

    def _stop_slow_reader_deadline(self) -> None:
        if self._slow_reader is not None:
            self._slow_reader.cancel()
            self._slow_reader = None

    def _on_slow_reader(self) -> None:
        self._slow_reader = None
        self.logger.info("closing a connection from %s: it took none of its response for %g s (%d bytes waiting)",
                         self.client, self.limits.slow_reader_timeout_s, self.transport.get_write_buffer_size())
        # abort, not close: close() would wait for the client to take the buffered bytes (also
        # when uvicorn has already closed this connection after a complete response). The app
        # sees http.disconnect from connection_lost, and the gateway cancels the generation.
        self.transport.abort()


def uvicorn_config(app, *, limits: GatewaySection, host: str | None = None, port: int | None = None,
                   log_level: str = "info", **kwargs) -> uvicorn.Config:
    """A uvicorn configuration for the gateway `app` with `limits` (host and port default to them)."""
    return uvicorn.Config(
        app, host=limits.host if host is None else host, port=limits.port if port is None else port, log_level=log_level,
        http=functools.partial(LimitedH11Protocol, limits=limits),  # type: ignore[arg-type]
        timeout_keep_alive=limits.keep_alive_timeout_s,  # type: ignore[arg-type]  (a float works: call_later)
        h11_max_incomplete_event_size=limits.max_header_bytes,
        **kwargs,
    )
