"""Trace context over gRPC: client and server interceptors that carry the W3C traceparent in metadata.

    channel = grpc.intercept_channel(grpc.insecure_channel(address), ClientTracingInterceptor())
    server = grpc.server(executor, interceptors=[ServerTracingInterceptor()])
    server = grpc.aio.server(interceptors=[AioServerTracingInterceptor(root_spans=True)])   # the scheduler

services/grpc_common.py installs them on every channel and server of the serving system.

Client: a call made while a span is current gets a CLIENT span named after the method
(`dspark.v1.Verifier/Verify`) and the span's `traceparent` in its metadata; a call outside any
span (start-up GetInfo, health checks) is passed through untouched, so it adds no orphan trace.
A streaming call's span lasts until its stream is read to the end or fails.

Server: a call of one of our services (method under /dspark.) that carries a traceparent gets a
SERVER span, its child, around the handler; with `root_spans=True` (an entry point: the
scheduler's Submit from an outside client) a call without one starts a trace of its own. The
span records the status code (`rpc.grpc.status_code`) and an error status for anything but OK.
While tracing is off (dspark/observability/tracing.py) both pass every call straight through.
"""

from __future__ import annotations

import collections
import inspect

import grpc
from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode

from dspark.observability import tracing

__all__ = ["AioServerTracingInterceptor", "ClientTracingInterceptor", "ServerTracingInterceptor"]

TRACED_PREFIX = "/dspark."  # our services; health and reflection calls are not traced


def _attributes(method: str) -> dict[str, str]:
    service, _, name = method.lstrip("/").partition("/")
    return {"rpc.system": "grpc", "rpc.service": service, "rpc.method": name}


def _current(span: trace.Span):
    """`span` current inside the block; failures are recorded by the caller (once)."""
    return trace.use_span(span, end_on_exit=False, record_exception=False, set_status_on_exception=False)


def _end_with_code(span: trace.Span, code: grpc.StatusCode | None, details: str | None = None) -> None:
    if code is not None:
        span.set_attribute("rpc.grpc.status_code", code.value[0])
        if code != grpc.StatusCode.OK:
            span.set_status(Status(StatusCode.ERROR, f"{code.name}: {details or ''}".rstrip(": ")))
    span.end()


# ---- client ---------------------------------------------------------------------------------------


class _CallDetails(
    collections.namedtuple("_CallDetails", ("method", "timeout", "metadata", "credentials", "wait_for_ready", "compression")),
    grpc.ClientCallDetails,
):
    pass


def _with_trace_context(details: grpc.ClientCallDetails) -> _CallDetails:
    metadata = list(details.metadata or ())
    metadata += list(tracing.inject({}).items())
    return _CallDetails(details.method, details.timeout, metadata, details.credentials,
                        getattr(details, "wait_for_ready", None), getattr(details, "compression", None))


class _TracedStream:
    """A response stream whose span ends when the stream does (read to the end, failed, dropped)."""

    def __init__(self, call, span: trace.Span):
        self._call, self._span, self._open = call, span, True

    def _end(self, code: grpc.StatusCode | None, details: str | None = None) -> None:
        if self._open:
            self._open = False
            _end_with_code(self._span, code, details)

    def __iter__(self):
        return self

    def __next__(self):
        try:
            return next(self._call)
        except StopIteration:
            self._end(grpc.StatusCode.OK)
            raise
        except grpc.RpcError as err:
            self._end(err.code(), err.details())
            raise

    def __getattr__(self, name):  # the grpc.Call side: code(), details(), cancel(), ...
        return getattr(self._call, name)

    def __del__(self):
        self._end(None)  # abandoned mid-stream: end the span without a status


def _start_client_call(continuation, details: grpc.ClientCallDetails, request) -> tuple[object, trace.Span | None]:
    """(the call, its CLIENT span, still open), or (the call untouched, None) while tracing is off
    or no span is current. A call that fails to start ends its span UNKNOWN."""
    if not tracing.enabled() or tracing.current_span_context() is None:
        return continuation(details, request), None
    method = details.method
    span = tracing.tracer().start_span(method.lstrip("/"), kind=SpanKind.CLIENT, attributes=_attributes(method))
    with _current(span):
        try:
            return continuation(_with_trace_context(details), request), span
        except BaseException:
            _end_with_code(span, grpc.StatusCode.UNKNOWN)
            raise


class ClientTracingInterceptor(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor):
    def intercept_unary_unary(self, continuation, client_call_details, request):
        outcome, span = _start_client_call(continuation, client_call_details, request)
        if span is not None:
            # A blocking call has completed here; a future one's span ends when it does.
            outcome.add_done_callback(lambda call: _end_with_code(span, call.code(), call.details()))
        return outcome

    def intercept_unary_stream(self, continuation, client_call_details, request):
        call, span = _start_client_call(continuation, client_call_details, request)
        return call if span is None else _TracedStream(call, span)


# ---- server ---------------------------------------------------------------------------------------


def _parent(metadata) -> tuple[object, bool]:
    """(context extracted from the call's metadata, whether it names a valid span)."""
    carrier = {key: value for key, value in metadata or () if isinstance(value, str)}  # (key, value) pairs; binary ones skipped
    context = tracing.extract(carrier)
    return context, trace.get_current_span(context).get_span_context().is_valid


def _code(context, *, failed: bool = False) -> grpc.StatusCode:
    """The call's status as the handler left it; a handler that raised without one failed UNKNOWN."""
    code = context.code() if hasattr(context, "code") else None
    if isinstance(code, grpc.StatusCode) and not (failed and code == grpc.StatusCode.OK):
        return code
    return grpc.StatusCode.UNKNOWN if failed else grpc.StatusCode.OK


class _ServerSpans:
    """Which calls get a SERVER span, and the span (see the module docstring)."""

    def __init__(self, *, root_spans: bool):
        self.root_spans = root_spans

    def traced(self, handler, details) -> bool:
        return handler is not None and details.method.startswith(TRACED_PREFIX)

    def start(self, details) -> trace.Span | None:
        if not tracing.enabled():
            return None
        parent, valid = _parent(details.invocation_metadata)
        if not (valid or self.root_spans):
            return None
        method = details.method
        return tracing.tracer().start_span(method.lstrip("/"), context=parent, kind=SpanKind.SERVER,
                                           attributes=_attributes(method))


def _failed(span: trace.Span, context, error: BaseException) -> None:
    span.record_exception(error)
    details = context.details() if hasattr(context, "details") else None  # context.abort's message
    _end_with_code(span, _code(context, failed=True), details or str(error) or type(error).__name__)


class ServerTracingInterceptor(grpc.ServerInterceptor):
    """SERVER spans for a thread-pool server (the drafter and the verifier). Interceptors run
    once per call: an untraced call gets its handler untouched."""

    def __init__(self, *, root_spans: bool = False):
        self._spans = _ServerSpans(root_spans=root_spans)

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if not self._spans.traced(handler, handler_call_details):
            return handler
        if handler.unary_unary is None and handler.unary_stream is None:
            return handler  # client-streaming calls: none in our services
        span = self._spans.start(handler_call_details)
        if span is None:
            return handler

        if handler.unary_unary is not None:
            behavior = handler.unary_unary

            def unary_unary(request, context):
                try:
                    with _current(span):
                        reply = behavior(request, context)
                except BaseException as e:
                    _failed(span, context, e)
                    raise
                _end_with_code(span, _code(context))
                return reply

            return handler._replace(unary_unary=unary_unary)
        behavior = handler.unary_stream

        def unary_stream(request, context):
            replies = None
            try:
                with _current(span):
                    replies = iter(behavior(request, context))
                while True:
                    # Current only while the handler runs, never across a yield to grpc.
                    with _current(span):
                        try:
                            reply = next(replies)
                        except StopIteration:
                            break
                    yield reply
            except BaseException as e:  # GeneratorExit included: the client went away
                _failed(span, context, e)
                raise
            finally:
                close = getattr(replies, "close", None)
                if close is not None:
                    close()
            _end_with_code(span, _code(context))

        return handler._replace(unary_stream=unary_stream)


class AioServerTracingInterceptor(grpc.aio.ServerInterceptor):
    """SERVER spans for an asyncio server (the scheduler); its handlers run inside the span, so
    the engine requests they submit become its children. Streaming handlers must be async
    generators (ours are); others are left untraced."""

    def __init__(self, *, root_spans: bool = False):
        self._spans = _ServerSpans(root_spans=root_spans)

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if not self._spans.traced(handler, handler_call_details):
            return handler
        if not (handler.unary_unary is not None
                or (handler.unary_stream is not None and inspect.isasyncgenfunction(handler.unary_stream))):
            return handler
        span = self._spans.start(handler_call_details)
        if span is None:
            return handler

        if handler.unary_unary is not None:
            behavior = handler.unary_unary

            async def unary_unary(request, context):
                try:
                    with _current(span):
                        reply = await behavior(request, context)
                except BaseException as e:
                    _failed(span, context, e)
                    raise
                _end_with_code(span, _code(context))
                return reply

            return handler._replace(unary_unary=unary_unary)
        behavior = handler.unary_stream

        async def unary_stream(request, context):
            replies = behavior(request, context)
            try:
                while True:
                    # Current only while the handler runs (each step), never across a yield to
                    # grpc, so no context leaks into the server's loop.
                    with _current(span):
                        try:
                            reply = await replies.__anext__()
                        except StopAsyncIteration:
                            break
                    yield reply
            except BaseException as e:  # CancelledError / GeneratorExit included: the client went away
                _failed(span, context, e)
                raise
            finally:
                await replies.aclose()
            _end_with_code(span, _code(context))

        return handler._replace(unary_stream=unary_stream)
