"""dspark/observability/tracing.py: settings, propagation and the span helpers.

Specification: tracing is off unless an endpoint is configured (the config's, else the SDK's
OTEL_EXPORTER_OTLP_ENDPOINT, as deploy/k8s sets it), and the SDK's own switches turn it off;
OTLP/HTTP gets the /v1/traces path, gRPC does not; a bad protocol or URL is an error naming it.
Off, the helpers make no spans, yet an incoming traceparent is passed on unchanged. On, `span`
makes children of the current span only (never orphan roots), and a batch span is the child of
the oldest sampled request and links the others.
"""

from __future__ import annotations

import pytest
from opentelemetry import trace
from opentelemetry.trace import INVALID_SPAN, NonRecordingSpan, SpanContext, TraceFlags

from dspark.observability import tracing
from dspark.serving_config import ObservabilitySection, ServingConfig
from tests.observability.conftest import CLIENT_SPAN_ID, CLIENT_TRACE_ID, CLIENT_TRACEPARENT, the_span

OFF = ObservabilitySection()


# ---- settings -----------------------------------------------------------------------------------


@pytest.fixture
def tracing_off():
    with tracing.use_tracer_provider(None):
        yield


def test_tracing_is_off_without_an_endpoint_anywhere():
    assert tracing.resolve_settings(OFF, service="serve", env={}) is None


def test_the_configured_endpoint_wins_and_http_gets_the_traces_path():
    section = ObservabilitySection(otlp_endpoint="http://collector:4318", sample_ratio=0.25)
    settings = tracing.resolve_settings(section, service="gateway", env={"OTEL_EXPORTER_OTLP_ENDPOINT": "http://other:4317"})
    assert settings == tracing.TracingSettings(endpoint="http://collector:4318", protocol="http/protobuf",
                                               service_name="dspark-gateway", sample_ratio=0.25)
    assert settings.traces_url == "http://collector:4318/v1/traces"


def test_the_sdk_variables_of_the_k8s_manifests_turn_tracing_on():
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://jaeger:4317", "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc",
           "OTEL_SERVICE_NAME": "dspark-scheduler", "OTEL_TRACES_EXPORTER": "otlp"}
    settings = tracing.resolve_settings(OFF, service="scheduler", env=env)
    assert (settings.endpoint, settings.protocol, settings.service_name) == ("http://jaeger:4317", "grpc", "dspark-scheduler")
    assert settings.traces_url == "http://jaeger:4317"  # gRPC: no path


def test_the_config_section_comes_from_dspark_observability_variables():
    config = ServingConfig.load(None, env={"DSPARK_OBSERVABILITY_OTLP_ENDPOINT": "http://localhost:4318",
                                           "DSPARK_OBSERVABILITY_SAMPLE_RATIO": "0.5", "DSPARK_OBSERVABILITY_METRICS_PORT": "0"})
    assert config.observability == ObservabilitySection(otlp_endpoint="http://localhost:4318", sample_ratio=0.5, metrics_port=0)


@pytest.mark.parametrize("env", [{"OTEL_SDK_DISABLED": "true"}, {"OTEL_TRACES_EXPORTER": "none"}])
def test_the_sdk_switches_turn_tracing_off(env):
    assert tracing.resolve_settings(ObservabilitySection(otlp_endpoint="http://c:4318"), service="drafter", env=env) is None


@pytest.mark.parametrize(("section", "env", "message"), [
    (ObservabilitySection(otlp_endpoint="collector:4318"), {}, "http(s)://host:port"),
    (OFF, {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318", "OTEL_EXPORTER_OTLP_PROTOCOL": "http/json"}, "protocol"),
])
def test_a_bad_endpoint_or_protocol_is_an_error_naming_it(section, env, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        tracing.resolve_settings(section, service="verifier", env=env)


@pytest.mark.parametrize(("keys", "message"), [
    ({"otlp_protocol": "json"}, "otlp_protocol"),
    ({"sample_ratio": 1.5}, "sample_ratio"),
    ({"metrics_port": 70000}, "metrics_port"),
])
def test_the_config_section_validates_its_values(keys, message):
    with pytest.raises(ValueError, match=message):
        ServingConfig().updated({"observability": keys})


# ---- propagation --------------------------------------------------------------------------------


def test_with_tracing_off_an_incoming_traceparent_is_passed_on_unchanged(tracing_off):
    assert not tracing.enabled()
    with tracing.tracer().start_as_current_span("entry", context=tracing.extract({"traceparent": CLIENT_TRACEPARENT})):
        assert tracing.current_traceparent() == CLIENT_TRACEPARENT
        with tracing.span("phase") as inner:
            assert inner is INVALID_SPAN  # nothing is made
    with tracing.tracer().start_as_current_span("entry", context=tracing.extract({"traceparent": "garbage"})):
        assert tracing.current_traceparent() is None  # an invalid header is dropped (W3C)


def test_a_child_span_carries_the_trace_on_with_its_own_span_id(spans):
    with tracing.tracer().start_as_current_span("entry", context=tracing.extract({"traceparent": CLIENT_TRACEPARENT})) as entry:
        carrier = tracing.inject({})
    version, trace_id, span_id, flags = carrier["traceparent"].split("-")
    assert (version, trace_id, flags) == ("00", CLIENT_TRACE_ID, "01")
    assert span_id == format(entry.get_span_context().span_id, "016x") != CLIENT_SPAN_ID
    assert format(the_span(spans.get_finished_spans(), "entry").parent.span_id, "016x") == CLIENT_SPAN_ID


# ---- spans --------------------------------------------------------------------------------------


def test_span_makes_children_of_the_current_span_and_never_orphans(spans):
    with tracing.span("orphan") as nothing:
        assert nothing is INVALID_SPAN
    with tracing.tracer().start_as_current_span("request"), tracing.span("draft"):
        pass
    finished = spans.get_finished_spans()
    assert sorted(s.name for s in finished) == ["draft", "request"]
    assert the_span(finished, "draft").parent.span_id == the_span(finished, "request").context.span_id


def _request_context(trace_id: int, *, sampled: bool = True) -> SpanContext:
    return SpanContext(trace_id=trace_id, span_id=trace_id + 1, is_remote=False,
                       trace_flags=TraceFlags(TraceFlags.SAMPLED if sampled else TraceFlags.DEFAULT))


def test_a_batch_span_is_the_child_of_the_oldest_sampled_request_and_links_the_others(spans):
    unsampled, oldest, younger = _request_context(10, sampled=False), _request_context(20), _request_context(30)
    with tracing.batch_span("round", [None, unsampled, oldest, younger]):
        pass
    (round_span,) = spans.get_finished_spans()
    assert round_span.context.trace_id == oldest.trace_id and round_span.parent.span_id == oldest.span_id
    assert [link.context.span_id for link in round_span.links] == [unsampled.span_id, younger.span_id]


def test_a_batch_of_untraced_requests_makes_no_span(spans):
    with tracing.batch_span("round", [None, _request_context(10, sampled=False)]) as nothing:
        assert nothing is INVALID_SPAN
    assert spans.get_finished_spans() == ()


def test_a_batch_span_links_at_most_max_round_links_requests(spans):
    contexts = [_request_context(100 + 2 * i) for i in range(tracing.MAX_ROUND_LINKS + 10)]
    with tracing.batch_span("round", contexts):
        pass
    (round_span,) = spans.get_finished_spans()
    assert len(round_span.links) == tracing.MAX_ROUND_LINKS


def test_use_span_context_makes_a_request_current_on_another_thread_without_a_span(spans):
    context = _request_context(40)
    with tracing.use_span_context(context):
        assert tracing.current_span_context() == context
        with tracing.span("admit"):
            pass
    assert tracing.current_span_context() is None
    assert the_span(spans.get_finished_spans(), "admit").parent.span_id == context.span_id


def test_use_tracer_provider_restores_the_previous_state(spans):
    assert tracing.enabled()
    with tracing.use_tracer_provider(None):
        assert not tracing.enabled()
        assert isinstance(tracing.tracer().start_span("x"), NonRecordingSpan)
    assert tracing.enabled()
    assert trace.get_current_span() is INVALID_SPAN
