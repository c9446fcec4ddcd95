"""`WireBytes`: how many serialized protobuf bytes a client's calls send and receive, per RPC.

    counter = WireBytes()
    verifier = RemoteVerifier(address, wire_bytes=counter)   # also RemoteDrafter(..., wire_bytes=counter)
    ...
    counter.totals("dspark.v1.Verifier")                    # RpcBytes(calls, sent, received)

A gRPC client interceptor (unary-unary and unary-stream: every call our clients make) that adds
`ByteSize()` of each request message and of each reply message (every message of a stream) to
the call's method. That is the payload the services exchange; gRPC's framing (5 bytes a message),
HTTP/2 headers and metadata come on top. For benchmarks (benchmarks/bench_service_split.py):
off unless a client is given one. Thread-safe.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import grpc

__all__ = ["RpcBytes", "WireBytes"]


@dataclass
class RpcBytes:
    calls: int = 0
    sent: int = 0  # Σ ByteSize() of the request messages
    received: int = 0  # Σ ByteSize() of the reply messages (all messages of a stream)


class _CountedStream:
    """A unary-stream call whose messages are counted as the caller reads them (the call's other
    methods, cancel() and code() among them, pass through)."""

    def __init__(self, call, count):
        self._call = call
        self._count = count

    def __iter__(self):
        return self

    def __next__(self):
        message = next(self._call)
        self._count(message.ByteSize())
        return message

    def __getattr__(self, name):
        return getattr(self._call, name)


class WireBytes(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor):
    def __init__(self):
        self._by_method: dict[str, RpcBytes] = {}
        self._lock = threading.Lock()

    def _add(self, method: str | bytes, *, calls: int = 0, sent: int = 0, received: int = 0) -> None:
        name = method.decode() if isinstance(method, bytes) else method
        with self._lock:
            entry = self._by_method.setdefault(name, RpcBytes())
            entry.calls += calls
            entry.sent += sent
            entry.received += received

    def intercept_unary_unary(self, continuation, client_call_details, request):
        outcome = continuation(client_call_details, request)  # blocks until the reply (or the error) is in
        received = outcome.result().ByteSize() if outcome.exception() is None else 0
        self._add(client_call_details.method, calls=1, sent=request.ByteSize(), received=received)
        return outcome

    def intercept_unary_stream(self, continuation, client_call_details, request):
        self._add(client_call_details.method, calls=1, sent=request.ByteSize())
        method = client_call_details.method
        return _CountedStream(continuation(client_call_details, request), lambda n: self._add(method, received=n))

    def by_method(self) -> dict[str, RpcBytes]:
        """'/package.Service/Method' -> its totals so far (a copy)."""
        with self._lock:
            return {m: RpcBytes(b.calls, b.sent, b.received) for m, b in self._by_method.items()}

    def totals(self, service: str = "") -> RpcBytes:
        """Sum over the methods of `service` ('dspark.v1.Verifier'); "" = every method."""
        out = RpcBytes()
        for method, b in self.by_method().items():
            if not service or method.split("/")[1] == service:
                out.calls += b.calls
                out.sent += b.sent
                out.received += b.received
        return out

    def reset(self) -> None:
        with self._lock:
            self._by_method.clear()
