"""OpenTelemetry tracing of the serving system: set-up, W3C context propagation, spans.

    setup_tracing(config.observability, service="scheduler")   # once per process, at start-up
    carrier = inject({})              # {"traceparent": ...} of the current span (HTTP headers, gRPC metadata)
    context = extract(carrier)        # ... and back, on the other side
    with span("draft"): ...           # a child of the current span; nothing at all while tracing is off

What one request's trace holds (each name is a span; indented = child):

    POST /v1/chat/completions        gateway (SERVER; continues an incoming `traceparent` header)
      scheduler.request              bus worker, maybe another process (CONSUMER; the bus message's traceparent)
        dspark.v1.Verifier/AddRequest, dspark.v1.Drafter/AddRequest     admission (CLIENT, then SERVER remotely)
        round                        one engine round: draft, schedule, verify for the whole batch
          draft       -> dspark.v1.Drafter/Draft  (CLIENT -> SERVER in the drafter process)
          schedule                   the draft-length policy (Algorithm 1 for `dspark`)
          verify      -> dspark.v1.Verifier/Verify (CLIENT -> SERVER in the verifier process)
          dspark.v1.Drafter/AppendFeatures, dspark.v1.Verifier/RemoveRequest, ...

A round serves a batch of requests, each with a trace of its own, and a span has one parent. The
round span is the child of the *oldest* request of the batch whose trace is sampled (the one
running longest; when it finishes the next-oldest takes over), and carries span links to the
other requests' spans, up to MAX_ROUND_LINKS. So a request alone in the system has a complete
trace down to the drafter's and verifier's own spans, and under load every round is still
recorded exactly once (not once per request, which would multiply the spans by the batch size),
reachable from every request it served through its links; each request span ends with its
totals (rounds, drafts, accepted tokens). A round in which no request is traced makes no spans.

Cost: tracing is off unless an OTLP endpoint is configured (ObservabilitySection.otlp_endpoint,
else the SDK's OTEL_EXPORTER_OTLP_ENDPOINT). Off, `span` and the round's spans return a shared
no-op context manager, and the gRPC interceptors pass calls straight through; the entry points
(gateway, worker) still go through the API's no-op tracer, which keeps an incoming traceparent
current, so a context that arrives is passed on unchanged. On, spans go to a BatchSpanProcessor
(a background thread exports them), never exported on the request's path.

The provider is held here, not only in OpenTelemetry's global (which can be set once per
process): `use_tracer_provider` swaps it for a test's in-memory exporter and restores it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from urllib.parse import urlsplit

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import INVALID_SPAN, NonRecordingSpan, SpanContext, SpanKind
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from dspark.serving_config import ObservabilitySection

__all__ = [
    "MAX_ROUND_LINKS", "TracingSettings", "batch_span", "current_span_context", "current_traceparent", "enabled", "extract",
    "inject", "make_tracer_provider", "resolve_settings", "set_attributes", "setup_tracing", "shutdown_tracing", "span", "tracer",
    "use_span_context", "use_tracer_provider",
]

log = logging.getLogger(__name__)

INSTRUMENTATION_NAME = "dspark"
MAX_ROUND_LINKS = 64  # links from a round span to the other requests of its batch (bounds a round's cost)
PROTOCOLS = ("grpc", "http/protobuf")
DEFAULT_PROTOCOL = "http/protobuf"  # the OpenTelemetry specification's default
_PROPAGATOR = TraceContextTextMapPropagator()  # W3C traceparent / tracestate
_NO_SPAN = contextlib.nullcontext(INVALID_SPAN)  # reusable: what `span` returns while there is nothing to record


@dataclass
class _State:
    provider: object | None = None  # the SDK TracerProvider while tracing is on; None = off
    tracer: trace.Tracer = trace.NoOpTracer()


_state = _State()


def enabled() -> bool:
    """Tracing is on in this process (a provider with an exporter is installed)."""
    return _state.provider is not None


def tracer() -> trace.Tracer:
    """The tracer spans are made with: the SDK's while tracing is on, else the API's no-op tracer
    (whose spans carry the parent's context, so propagation still passes a context on)."""
    return _state.tracer


# ---- settings and set-up ------------------------------------------------------------------------


@dataclass(frozen=True)
class TracingSettings:
    """Where and how this process exports its spans (resolved from the config and the SDK's variables)."""

    endpoint: str  # the collector's base URL, e.g. http://jaeger:4317
    protocol: str  # grpc | http/protobuf
    service_name: str  # the `service.name` resource attribute: what Jaeger lists
    sample_ratio: float  # of new traces; a sampled parent is always followed

    @property
    def traces_url(self) -> str:
        """What the exporter is given: for OTLP/HTTP the signal path /v1/traces is appended to a
        base URL without a path (as the SDK does for OTEL_EXPORTER_OTLP_ENDPOINT)."""
        if self.protocol == "http/protobuf" and urlsplit(self.endpoint).path in ("", "/"):
            return self.endpoint.rstrip("/") + "/v1/traces"
        return self.endpoint


def resolve_settings(
    section: ObservabilitySection, *, service: str, env: Mapping[str, str] | None = None,
) -> TracingSettings | None:
    """The settings for `service` (gateway, scheduler, drafter, verifier, serve), or None when
    tracing is off: no endpoint in the config nor in OTEL_EXPORTER_OTLP_[TRACES_]ENDPOINT, or the
    SDK's switches say so (OTEL_SDK_DISABLED=true, OTEL_TRACES_EXPORTER=none)."""
    env = os.environ if env is None else env
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true" or env.get("OTEL_TRACES_EXPORTER", "").strip() == "none":
        return None
    endpoint = (section.otlp_endpoint or env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_ENDPOINT")
                or "")
    if not endpoint.strip():
        return None
    protocol = (section.otlp_protocol or env.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or env.get("OTEL_EXPORTER_OTLP_PROTOCOL")
                or DEFAULT_PROTOCOL).strip()
    if protocol not in PROTOCOLS:
        raise ValueError(f"OTLP protocol must be one of {PROTOCOLS}, got {protocol!r}")
    parts = urlsplit(endpoint.strip())
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"OTLP endpoint must be an http(s)://host:port URL, got {endpoint!r}")
    service_name = env.get("OTEL_SERVICE_NAME") or f"dspark-{service}"
    return TracingSettings(endpoint=endpoint.strip(), protocol=protocol, service_name=service_name,
                           sample_ratio=section.sample_ratio)


def make_tracer_provider(settings: TracingSettings, exporter=None):
    """An SDK TracerProvider for `settings`: parent-based ratio sampling, the service's resource,
    spans batched to `exporter` (default: the OTLP exporter of settings.protocol)."""
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor
    from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased

    if exporter is None:
        if settings.protocol == "grpc":
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

            exporter = OTLPSpanExporter(endpoint=settings.traces_url, insecure=settings.endpoint.startswith("http://"))
        else:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

            exporter = OTLPSpanExporter(endpoint=settings.traces_url)
    resource = Resource.create({"service.name": settings.service_name, "service.namespace": "dspark",
                                "service.instance.id": f"{socket.gethostname()}-{os.getpid()}"})
    provider = TracerProvider(sampler=ParentBased(TraceIdRatioBased(settings.sample_ratio)), resource=resource)
    provider.add_span_processor(BatchSpanProcessor(exporter))
    return provider


def _install(provider) -> None:
    _state.provider = provider
    _state.tracer = provider.get_tracer(INSTRUMENTATION_NAME) if provider is not None else trace.NoOpTracer()


def setup_tracing(section: ObservabilitySection, *, service: str, env: Mapping[str, str] | None = None) -> TracingSettings | None:
    """Turn tracing on for this process if configured (see resolve_settings); returns the settings
    in force, None when off. Also OpenTelemetry's global provider, for other instrumentation."""
    settings = resolve_settings(section, service=service, env=env)
    if settings is None:
        return None
    provider = make_tracer_provider(settings)
    _install(provider)
    trace.set_tracer_provider(provider)  # a no-op with a warning if something set one before
    log.info("tracing: %s exports to %s (OTLP %s, sample ratio %g)", settings.service_name, settings.traces_url,
             settings.protocol, settings.sample_ratio)
    return settings


def shutdown_tracing() -> None:
    """Export what is pending and turn tracing off (also done at interpreter exit by the SDK)."""
    provider, _ = _state.provider, _install(None)
    if provider is not None:
        provider.shutdown()


@contextlib.contextmanager
def use_tracer_provider(provider) -> Iterator[None]:
    """Trace with `provider` (an SDK TracerProvider, e.g. over an in-memory exporter) inside the
    block, then restore the previous one."""
    previous = _state.provider
    _install(provider)
    try:
        yield
    finally:
        _install(previous)


# ---- propagation --------------------------------------------------------------------------------


def inject(carrier: dict[str, str], context: otel_context.Context | None = None) -> dict[str, str]:
    """Add the W3C `traceparent` (and `tracestate`) of the current span, or of `context`, to
    `carrier`; nothing when there is no valid span. Returns the carrier."""
    _PROPAGATOR.inject(carrier, context=context)
    return carrier


def extract(carrier: Mapping[str, str]) -> otel_context.Context:
    """The context a carrier's `traceparent` names (an invalid or absent one: an empty context)."""
    return _PROPAGATOR.extract(carrier)


def current_traceparent() -> str | None:
    """The W3C traceparent of the current span, None without a valid one."""
    return inject({}).get("traceparent")


def current_span_context() -> SpanContext | None:
    """The current span's context, None without a valid one (what a request hands to the engine)."""
    context = trace.get_current_span().get_span_context()
    return context if context.is_valid else None


def set_attributes(attributes: Mapping[str, object]) -> None:
    """Annotate the current span (e.g. the gateway's with the request id); no-op when not recording."""
    current = trace.get_current_span()
    if current.is_recording():
        current.set_attributes(attributes)


@contextlib.contextmanager
def use_span_context(span_context: SpanContext | None) -> Iterator[None]:
    """Make `span_context` current without a new span: calls made inside (e.g. a request's
    admission RPCs on the engine thread) become its children. No-op for None or while off."""
    if span_context is None or not enabled():
        yield
        return
    with trace.use_span(NonRecordingSpan(span_context), end_on_exit=False):
        yield


# ---- spans ----------------------------------------------------------------------------------------


def span(name: str, *, attributes: Mapping[str, object] | None = None):
    """A context manager: a child span of the current span, or nothing when tracing is off or no
    span is current (a phase outside any traced request records nothing)."""
    if not enabled() or not trace.get_current_span().get_span_context().is_valid:
        return _NO_SPAN
    return _state.tracer.start_as_current_span(name, attributes=attributes)


def batch_span(name: str, span_contexts: Iterable[SpanContext | None], *, attributes: Mapping[str, object] | None = None):
    """A span for work done for a batch of requests (an engine round): the child of the first
    sampled context (the oldest request), linked to the others; nothing when none is traced.
    See the module docstring for why."""
    if not enabled():
        return _NO_SPAN
    traced = [c for c in span_contexts if c is not None and c.is_valid]
    parent = next((c for c in traced if c.trace_flags.sampled), None)
    if parent is None:
        return _NO_SPAN
    links = [trace.Link(c) for c in traced if c is not parent][:MAX_ROUND_LINKS]
    context = trace.set_span_in_context(NonRecordingSpan(parent))
    return _state.tracer.start_as_current_span(name, context=context, links=links, kind=SpanKind.INTERNAL, attributes=attributes)
