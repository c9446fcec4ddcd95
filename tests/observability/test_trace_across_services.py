"""One request, one trace: gateway -> bus worker -> engine rounds -> drafter and verifier services.

Specification: the embedded gateway (a real uvicorn server, in-memory bus, worker thread) over an
engine whose verifier and drafter are real gRPC servers on loopback (the tiny random model, the
n-gram drafter) turns one HTTP request carrying a client's W3C traceparent into spans of that
client's trace only: the gateway's SERVER span (child of the client's span, annotated with the
response id), the worker's `scheduler.request` (child of the gateway's, through the bus
message), the request's admission calls, and per engine round `round` > `draft` / `schedule` /
`verify`, where `draft` and `verify` hold the CLIENT span of their RPC and the drafter's and
verifier's SERVER spans are children of those (the context crossed in gRPC metadata).
"""

from __future__ import annotations

import httpx
from opentelemetry.trace import SpanKind

from dspark.drafters.ngram import NgramDrafter
from dspark.engine.async_engine import AsyncEngine
from dspark.engine.speculative import SpeculativeEngine
from dspark.engine.verifier import LocalVerifier
from gateway.server import embedded_gateway
from services.drafter.client import RemoteDrafter
from services.verifier.client import RemoteVerifier
from tests.gateway.conftest import ByteTokenizer, live_server
from tests.observability.conftest import CLIENT_SPAN_ID, CLIENT_TRACE_ID, CLIENT_TRACEPARENT, by_name, the_span
from tests.polling import wait_until

MODEL = "tiny-random"


def children(finished, parent) -> list:
    return [s for s in finished if s.parent is not None and s.parent.span_id == parent.context.span_id]


def test_one_request_is_one_trace_from_the_gateway_to_the_drafter_and_verifier_services(spans, serve, tiny_runtime):
    verifier = RemoteVerifier(serve.verifier(LocalVerifier(tiny_runtime)))
    drafter = RemoteDrafter(serve.drafter(NgramDrafter(), vocab_size=tiny_runtime.vocab_size))
    engine = AsyncEngine(SpeculativeEngine.from_parts(verifier=verifier, drafter=drafter, num_speculative_tokens=3)).start()
    gateway = embedded_gateway(engine, ByteTokenizer(), model_name=MODEL)
    try:
        with live_server(gateway.app) as url:
            body = {"model": MODEL, "prompt": "abcdabcdabcdabcd", "max_tokens": 16, "temperature": 0}
            reply = httpx.post(f"{url}/v1/completions", json=body, headers={"traceparent": CLIENT_TRACEPARENT}, timeout=120)
            assert reply.status_code == 200, reply.text
            # the worker's span ends once the final event is acknowledged, just after the response
            assert wait_until(lambda: by_name(spans.get_finished_spans(), "scheduler.request"), 30)
    finally:
        gateway.close()
        engine.shutdown()
        verifier.close()
        drafter.close()
    finished = spans.get_finished_spans()

    assert {s.context.trace_id for s in finished} == {int(CLIENT_TRACE_ID, 16)}  # one trace: the client's

    http = the_span(finished, "POST /v1/completions", SpanKind.SERVER)
    assert http.parent.span_id == int(CLIENT_SPAN_ID, 16)
    assert http.attributes["dspark.request_id"] == reply.json()["id"] and http.attributes["http.response.status_code"] == 200

    request = the_span(finished, "scheduler.request", SpanKind.CONSUMER)
    assert request.parent.span_id == http.context.span_id
    assert request.attributes["dspark.completion_tokens"] == 16
    admission = {s.name for s in children(finished, request)}
    assert {"dspark.v1.Verifier/AddRequest", "dspark.v1.Drafter/AddRequest"} <= admission

    rounds = [s for s in children(finished, request) if s.name == "round"]
    assert len(rounds) == request.attributes["dspark.rounds"] + 1  # the decode rounds and the prefill
    drafted = 0
    for r in rounds:
        phases = {s.name: s for s in children(finished, r) if s.name in ("draft", "schedule", "verify")}
        assert set(phases) == {"draft", "schedule", "verify"}
        (verify_call,) = children(finished, phases["verify"])
        assert (verify_call.name, verify_call.kind) == ("dspark.v1.Verifier/Verify", SpanKind.CLIENT)
        (verify_server,) = children(finished, verify_call)
        assert (verify_server.name, verify_server.kind) == ("dspark.v1.Verifier/Verify", SpanKind.SERVER)
        assert verify_server.attributes["rpc.grpc.status_code"] == 0
        for draft_call in children(finished, phases["draft"]):  # the prefill round drafts nothing
            assert (draft_call.name, draft_call.kind) == ("dspark.v1.Drafter/Draft", SpanKind.CLIENT)
            (draft_server,) = children(finished, draft_call)
            assert (draft_server.name, draft_server.kind) == ("dspark.v1.Drafter/Draft", SpanKind.SERVER)
            assert draft_call.end_time >= draft_server.end_time  # the client's span lasts until its stream ends
            drafted += 1
    assert drafted >= 1  # the drafter service's spans are in the trace
    assert sum(r.attributes["dspark.draft_tokens"] for r in rounds) == request.attributes["dspark.draft_tokens"]
