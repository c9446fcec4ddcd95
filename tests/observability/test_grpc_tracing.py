"""dspark/observability/grpc_tracing.py on real servers (tiny random model, loopback).

Specification: a call made inside a span carries its context to the server, whose SERVER span
is the child of the caller's CLIENT span; a failed call marks both spans as errors with the
status code; a call outside any span (start-up, health checks) makes no span on either side;
the scheduler's Submit is an entry point: a call without a traceparent starts a trace whose
SERVER span the request's engine rounds join, and a call with one continues the caller's trace.
"""

from __future__ import annotations

import grpc
import pytest
from opentelemetry.trace import SpanKind, StatusCode

from dspark.drafters.ngram import NgramDrafter
from dspark.engine.async_engine import AsyncEngine
from dspark.engine.speculative import SpeculativeEngine
from dspark.engine.verifier import LocalVerifier
from dspark.observability import tracing
from dspark.protos.dspark.v1 import common_pb2, scheduler_pb2, scheduler_pb2_grpc
from dspark.sampling.params import SamplingParams
from services.verifier.client import RemoteVerifier
from tests.observability.conftest import CLIENT_SPAN_ID, CLIENT_TRACE_ID, CLIENT_TRACEPARENT, by_name, the_span
from tests.polling import wait_until

VERIFIER_ADD = "dspark.v1.Verifier/AddRequest"


def test_a_call_inside_a_span_is_a_client_span_parenting_the_servers_span(spans, serve, tiny_runtime):
    verifier = RemoteVerifier(serve.verifier(LocalVerifier(tiny_runtime)))
    try:
        with tracing.tracer().start_as_current_span("caller") as caller:
            verifier.add_request("r", [1, 2, 3], SamplingParams(), 16)
    finally:
        verifier.close()
    finished = spans.get_finished_spans()
    client, server = the_span(finished, VERIFIER_ADD, SpanKind.CLIENT), the_span(finished, VERIFIER_ADD, SpanKind.SERVER)
    assert client.parent.span_id == caller.get_span_context().span_id
    assert server.parent.span_id == client.context.span_id and server.context.trace_id == caller.get_span_context().trace_id
    assert client.attributes["rpc.grpc.status_code"] == server.attributes["rpc.grpc.status_code"] == 0
    assert server.attributes["rpc.service"] == "dspark.v1.Verifier" and server.attributes["rpc.method"] == "AddRequest"


def test_a_failed_call_is_an_error_on_both_sides_with_its_status_code(spans, serve, tiny_runtime):
    verifier = RemoteVerifier(serve.verifier(LocalVerifier(tiny_runtime)))
    try:
        with tracing.tracer().start_as_current_span("caller"), pytest.raises(ValueError, match="prompt_ids"):
            verifier.add_request("bad", [tiny_runtime.vocab_size + 5], SamplingParams(), 16)  # a token outside the vocabulary
    finally:
        verifier.close()
    finished = spans.get_finished_spans()
    for kind in (SpanKind.CLIENT, SpanKind.SERVER):
        span = the_span(finished, VERIFIER_ADD, kind)
        assert span.status.status_code == StatusCode.ERROR and "INVALID_ARGUMENT" in span.status.description
        assert span.attributes["rpc.grpc.status_code"] == grpc.StatusCode.INVALID_ARGUMENT.value[0]


def test_calls_outside_any_span_make_no_spans(spans, serve, tiny_runtime):
    verifier = RemoteVerifier(serve.verifier(LocalVerifier(tiny_runtime)))  # GetInfo at construction
    try:
        verifier.add_request("r", [1, 2, 3], SamplingParams(), 16)
        assert verifier.remove_request(["r"]) == 1
        assert verifier.is_serving()
    finally:
        verifier.close()
    assert spans.get_finished_spans() == ()


@pytest.mark.parametrize("traceparent", [None, CLIENT_TRACEPARENT])
def test_scheduler_submit_is_an_entry_point_whose_rounds_join_its_span(spans, serve, tiny_runtime, traceparent):
    engine = AsyncEngine(SpeculativeEngine(tiny_runtime, NgramDrafter(), num_speculative_tokens=3)).start()
    try:
        with grpc.insecure_channel(serve.scheduler(engine)) as channel:
            stub = scheduler_pb2_grpc.SchedulerStub(channel)
            request = scheduler_pb2.GenerationRequest(request_id="s", prompt_ids=[1, 2, 3, 1, 2, 3], max_new_tokens=8,
                                                      params=common_pb2.SamplingParams(temperature=0.0, top_p=1.0))
            metadata = [("traceparent", traceparent)] if traceparent else []
            replies = list(stub.Submit(request, timeout=60, metadata=metadata))
        assert replies[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
        assert wait_until(lambda: by_name(spans.get_finished_spans(), "dspark.v1.Scheduler/Submit"))
    finally:
        serve.stop_all()
        engine.shutdown()
    finished = spans.get_finished_spans()
    submit = the_span(finished, "dspark.v1.Scheduler/Submit", SpanKind.SERVER)
    if traceparent is None:
        assert submit.parent is None  # a trace of its own
    else:
        assert format(submit.context.trace_id, "032x") == CLIENT_TRACE_ID
        assert format(submit.parent.span_id, "016x") == CLIENT_SPAN_ID
    rounds = by_name(finished, "round")
    assert rounds and all(r.parent.span_id == submit.context.span_id for r in rounds)
    assert {s.context.trace_id for s in finished} == {submit.context.trace_id}
