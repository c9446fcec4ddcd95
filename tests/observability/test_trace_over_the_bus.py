"""The trace context crosses the bus: in-memory and real Redis (tiny random model, in-process engine).

Specification: a request through the gateway app reaches a bus worker as a message whose
traceparent is the gateway span's, so the worker's `scheduler.request` span is that span's child
and the engine's rounds are its children, all in the client's trace; the trace id is the same
on both buses (the Redis message is JSON between processes).
"""

from __future__ import annotations

import asyncio

import httpx
import pytest
from opentelemetry.trace import SpanKind

from dspark.bus.worker import run_worker
from dspark.drafters.ngram import NgramDrafter
from dspark.engine.async_engine import AsyncEngine
from dspark.engine.speculative import SpeculativeEngine
from gateway.app import create_app
from tests.bus.conftest import anyio_backend, make_bus  # noqa: F401 - the parametrised bus fixture (memory, redis)
from tests.conftest import make_tiny_runtime
from tests.gateway.conftest import ByteTokenizer
from tests.observability.conftest import CLIENT_TRACE_ID, CLIENT_TRACEPARENT, by_name, the_span

pytestmark = pytest.mark.anyio

MODEL = "tiny-random"


async def test_the_worker_continues_the_gateways_span_on_either_bus(spans, make_bus):  # noqa: F811 - the imported fixture
    spec = SpeculativeEngine(make_tiny_runtime(), NgramDrafter(), num_speculative_tokens=3)
    engine = AsyncEngine(spec, idle_poll_s=0.01).start()
    stop = asyncio.Event()
    worker = asyncio.create_task(run_worker(make_bus(), engine, consumer="w", stop=stop, block_s=0.05))
    app = create_app(make_bus(), ByteTokenizer(), model_name=MODEL, max_model_len=engine.max_model_len, vocab_size=256)
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gateway", timeout=60) as client:
            reply = await client.post("/v1/completions", headers={"traceparent": CLIENT_TRACEPARENT},
                                      json={"model": MODEL, "prompt": "abcabcabc", "max_tokens": 8, "temperature": 0})
        assert reply.status_code == 200, reply.text
        for _ in range(500):  # the worker's span ends once the final event is acknowledged
            if by_name(spans.get_finished_spans(), "scheduler.request"):
                break
            await asyncio.sleep(0.02)
    finally:
        stop.set()
        await worker
        engine.shutdown()
    finished = spans.get_finished_spans()
    http = the_span(finished, "POST /v1/completions", SpanKind.SERVER)
    request = the_span(finished, "scheduler.request", SpanKind.CONSUMER)
    assert request.parent.span_id == http.context.span_id
    assert request.attributes["dspark.request_id"] == reply.json()["id"]
    rounds = by_name(finished, "round")
    assert rounds and all(r.parent.span_id == request.context.span_id for r in rounds)
    assert {s.context.trace_id for s in finished} == {int(CLIENT_TRACE_ID, 16)}
