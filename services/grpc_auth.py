"""Authentication of the calls between the services: one shared token, checked by every server.

    server = grpc.server(executor, interceptors=[TokenAuthInterceptor(token)])      # sync services
    server = grpc.aio.server(interceptors=[AsyncTokenAuthInterceptor(token)])       # the scheduler
    channel = authenticated_channel(open_channel(address, tls), token)              # every client

The token is `rpc.auth_token` of the serving configuration (DSPARK_RPC_AUTH_TOKEN; a Kubernetes
Secret; `dspark up` makes a random one for its children when none is configured). Clients send
it as `authorization: Bearer <token>` metadata on every call; servers compare it in constant
time (hmac.compare_digest) and end a call without it, or with another, with UNAUTHENTICATED
and a message, before its request is even deserialised. Our services and server reflection need
the token; grpc.health.v1 stays open, because the kubelet's gRPC probes cannot send metadata
(and health says nothing but SERVING). An empty token turns the check off.

Without rpc.tls_* the connection itself is plaintext (h2c): the token keeps strangers that can
reach the port out, it does not hide the traffic. Across untrusted networks turn on mutual TLS
(rpc.tls_ca_path / tls_cert_path / tls_key_path, services/grpc_tls.py; or a service mesh such as
Linkerd or Istio) in addition to the token: the token is checked the same way over TLS.
"""

from __future__ import annotations

import hmac
import logging
import secrets
from collections import namedtuple

import grpc

__all__ = ["AUTH_METADATA_KEY", "OPEN_SERVICES", "AsyncTokenAuthInterceptor", "BearerTokenInterceptor", "TokenAuthInterceptor",
           "authenticated_channel", "generate_token", "warn_if_exposed"]

log = logging.getLogger(__name__)

AUTH_METADATA_KEY = "authorization"
OPEN_SERVICES = ("grpc.health.v1.Health",)  # callable without the token (probes)
_DENIED = "this service requires the internal token: send `authorization: Bearer <rpc.auth_token>` metadata"
_WRONG = "the internal token sent (authorization metadata) is not this deployment's rpc.auth_token"


def generate_token() -> str:
    """A fresh random token (256 bits, URL-safe text)."""
    return secrets.token_urlsafe(32)


def warn_if_exposed(bind: str, token: str, what: str) -> None:
    """Log a warning when a service listens beyond this machine without a token."""
    host = bind.rpartition(":")[0].strip("[]")
    if not token and host not in ("127.0.0.1", "localhost", "::1"):
        log.warning("%s listens on %s without rpc.auth_token: anyone who reaches that port can call it "
                    "(set DSPARK_RPC_AUTH_TOKEN on every service)", what, bind)


def _is_open(method: str) -> bool:
    """`method` is '/<package.Service>/<Method>'."""
    return method.split("/")[1] in OPEN_SERVICES if method.count("/") >= 2 else False


def _refusal(handler_call_details: grpc.HandlerCallDetails, expected: bytes) -> str | None:
    """Why the call may not proceed, or None if it may."""
    if _is_open(handler_call_details.method):
        return None
    sent = [value for key, value in handler_call_details.invocation_metadata or () if key == AUTH_METADATA_KEY]
    if not sent:
        return _DENIED
    value = sent[0].encode() if isinstance(sent[0], str) else bytes(sent[0])
    return None if hmac.compare_digest(value, expected) else _WRONG


def _bearer(token: str) -> bytes:
    if not token:
        raise ValueError("the internal token must not be empty (an empty rpc.auth_token means: no interceptor)")
    return f"Bearer {token}".encode()


_HANDLER_FACTORIES = {  # (request streaming, response streaming) -> handler factory
    (False, False): grpc.unary_unary_rpc_method_handler,
    (False, True): grpc.unary_stream_rpc_method_handler,
    (True, False): grpc.stream_unary_rpc_method_handler,
    (True, True): grpc.stream_stream_rpc_method_handler,
}


def _refusing_handler(handler: grpc.RpcMethodHandler, behaviour) -> grpc.RpcMethodHandler:
    """A handler of the same kind as `handler` with `behaviour` (which aborts). No request
    deserialiser: a refused request is never parsed."""
    factory = _HANDLER_FACTORIES[(handler.request_streaming, handler.response_streaming)]
    return factory(behaviour, request_deserializer=None, response_serializer=handler.response_serializer)


class TokenAuthInterceptor(grpc.ServerInterceptor):
    """For grpc.server (thread pool): refuses calls without the token (module docstring)."""

    def __init__(self, token: str):
        self._expected = _bearer(token)

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        reason = _refusal(handler_call_details, self._expected)
        if reason is None or handler is None:  # allowed, or an unknown method (UNIMPLEMENTED)
            return handler

        def abort(request, context):
            context.abort(grpc.StatusCode.UNAUTHENTICATED, reason)

        def abort_stream(request, context):  # a generator, as a streaming behaviour is (other interceptors iterate it)
            context.abort(grpc.StatusCode.UNAUTHENTICATED, reason)
            yield

        return _refusing_handler(handler, abort_stream if handler.response_streaming else abort)


class AsyncTokenAuthInterceptor(grpc.aio.ServerInterceptor):
    """For grpc.aio.server (the scheduler): the same check."""

    def __init__(self, token: str):
        self._expected = _bearer(token)

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        reason = _refusal(handler_call_details, self._expected)
        if reason is None or handler is None:
            return handler

        async def abort(request, context):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, reason)

        async def abort_stream(request, context):  # an async generator, as a streaming behaviour is
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, reason)
            yield

        return _refusing_handler(handler, abort_stream if handler.response_streaming else abort)


class _CallDetails(namedtuple("_CallDetails", ("method", "timeout", "metadata", "credentials", "wait_for_ready", "compression")),
                   grpc.ClientCallDetails):
    pass


class BearerTokenInterceptor(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,
                             grpc.StreamUnaryClientInterceptor, grpc.StreamStreamClientInterceptor):
    """Adds `authorization: Bearer <token>` to every call of a (sync) channel."""

    def __init__(self, token: str):
        self._metadata = (AUTH_METADATA_KEY, _bearer(token).decode())

    def _details(self, d: grpc.ClientCallDetails) -> grpc.ClientCallDetails:
        metadata = [m for m in (d.metadata or ()) if m[0] != AUTH_METADATA_KEY] + [self._metadata]
        return _CallDetails(d.method, d.timeout, metadata, d.credentials, d.wait_for_ready, getattr(d, "compression", None))

    def intercept_unary_unary(self, continuation, client_call_details, request):
        return continuation(self._details(client_call_details), request)

    def intercept_unary_stream(self, continuation, client_call_details, request):
        return continuation(self._details(client_call_details), request)

    def intercept_stream_unary(self, continuation, client_call_details, request_iterator):
        return continuation(self._details(client_call_details), request_iterator)

    def intercept_stream_stream(self, continuation, client_call_details, request_iterator):
        return continuation(self._details(client_call_details), request_iterator)


def authenticated_channel(channel: grpc.Channel, token: str) -> grpc.Channel:
    """`channel` sending the token on every call; unchanged if `token` is empty."""
    return grpc.intercept_channel(channel, BearerTokenInterceptor(token)) if token else channel
