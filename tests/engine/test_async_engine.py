"""AsyncEngine: the engine on one background thread behind an asyncio API (tiny random model).

Specification: requests beyond the KV budget queue in FIFO order; a bad request fails only its
own consumer; a failing step fails the running requests and the loop goes on; leaving a stream
or cancelling frees KV; output equals the engine run directly; shutdown refuses new requests;
start() frees the OpenMP workers of the thread that built the engine (one compute thread).
"""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch

from dspark.drafters.ngram import NgramDrafter
from dspark.engine.async_engine import AsyncEngine, EngineError
from dspark.engine.speculative import GenerationRequest, SpeculativeEngine
from dspark.model.config import ModelConfig
from dspark.model.target_runtime import TargetRuntime
from dspark.model.transformer import Transformer
from dspark.sampling.params import SamplingParams
from tests.model.test_compute_thread import needs_openmp_pool, on_a_fresh_thread, os_threads, parallel_region
from tests.polling import wait_until

GREEDY = SamplingParams(temperature=0.0)


async def collect(engine: AsyncEngine, request: GenerationRequest):
    tokens, last = [], None
    async for delta in engine.generate(request):
        tokens += delta.new_token_ids
        last = delta
    return tokens, last


def tiny_runtime(*, kv_budget_tokens: int = 4096, seed: int = 0) -> TargetRuntime:
    """A random 4-layer model (vocab 256): milliseconds per forward."""
    torch.manual_seed(seed)
    model = Transformer(ModelConfig.tiny(), compute_dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.2)
    model.eval().requires_grad_(False)
    model.prepare_for_inference()
    return TargetRuntime(model, kv_budget_tokens=kv_budget_tokens)


@pytest.fixture
def tiny_engine():
    """Factory: a started AsyncEngine over a tiny random model; all are shut down afterwards."""
    made: list[AsyncEngine] = []

    def make(*, kv_budget_tokens: int = 4096, drafter=None) -> AsyncEngine:
        engine = AsyncEngine(SpeculativeEngine(tiny_runtime(kv_budget_tokens=kv_budget_tokens), drafter), idle_poll_s=0.01)
        made.append(engine.start())
        return engine

    yield make
    for e in made:
        e.shutdown()


@pytest.fixture
def anyio_backend():
    return "asyncio"


# ---- AsyncEngine on a tiny random model ---------------------------------------------------


@pytest.mark.anyio
async def test_requests_beyond_the_kv_budget_wait_in_fifo_order_and_all_complete(tiny_engine):
    engine = tiny_engine(kv_budget_tokens=70)  # each request reserves 10 + 20 = 30: two at a time
    admitted, peak, gate = [], [], threading.Event()
    add, step = engine.engine.add_request, engine.engine.step

    def recording_add(req):
        add(req)
        admitted.append(req.request_id)

    def gated_step():
        gate.wait(10)  # hold the first step until every request is queued
        peak.append(len(engine.engine.running))
        return step()

    engine.engine.add_request, engine.engine.step = recording_add, gated_step
    reqs = [GenerationRequest(f"r{i}", list(range(1 + i, 11 + i)), 20, GREEDY) for i in range(5)]
    tasks = [asyncio.ensure_future(collect(engine, r)) for r in reqs]  # their submissions run in this order
    await asyncio.sleep(0.1)
    gate.set()
    results = await asyncio.gather(*tasks)
    assert all(last.finish_reason == "length" and len(toks) == 20 for toks, last in results)
    assert admitted == [r.request_id for r in reqs]
    assert max(peak) == 2
    assert engine.runtime.kv.reserved_tokens == 0


@pytest.mark.anyio
async def test_bad_requests_fail_only_their_consumer(tiny_engine):
    engine = tiny_engine(kv_budget_tokens=100)
    with pytest.raises(ValueError, match="token ids must be in"):
        await collect(engine, GenerationRequest("bad", [1, 999], 4, GREEDY))
    with pytest.raises(ValueError, match="whole KV budget is 100"):
        await collect(engine, GenerationRequest("huge", [1] * 50, 60, GREEDY))
    with pytest.raises(ValueError, match="empty"):
        await collect(engine, GenerationRequest("empty", [], 4, GREEDY))
    tokens, last = await collect(engine, GenerationRequest("good", [1, 2, 3], 5, GREEDY))
    assert len(tokens) == 5 and last.stats.completion_tokens == 5 and last.stats.prompt_tokens == 3


@pytest.mark.anyio
async def test_a_failing_step_fails_running_requests_and_the_loop_goes_on(tiny_engine):
    engine = tiny_engine()
    step, calls = engine.engine.step, []

    def flaky_step():
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("boom")
        return step()

    engine.engine.step = flaky_step
    with pytest.raises(EngineError, match="boom"):
        await collect(engine, GenerationRequest("a", [1, 2, 3], 10, GREEDY))
    assert engine.runtime.kv.reserved_tokens == 0 and not engine.engine.running
    tokens, last = await collect(engine, GenerationRequest("b", [1, 2, 3], 4, GREEDY))
    assert len(tokens) == 4 and last.finish_reason == "length"


@pytest.mark.anyio
async def test_leaving_generate_early_aborts_and_frees_kv(tiny_engine):
    engine = tiny_engine(drafter=NgramDrafter())
    async for delta in engine.generate(GenerationRequest("long", [5, 6, 7], 400, GREEDY)):
        assert engine.runtime.kv.reserved_tokens == 403
        break
    assert await asyncio.to_thread(wait_until, lambda: engine.runtime.kv.reserved_tokens == 0, 5.0)
    assert not engine.engine.running and engine.num_running == 0


@pytest.mark.anyio
async def test_a_cancelled_consumer_leaves_the_kv_queue(tiny_engine):
    engine = tiny_engine(kv_budget_tokens=40)
    first = await engine.submit(GenerationRequest("first", [1, 2, 3], 27, GREEDY))  # holds 30 of 40
    await first.__anext__()
    waiter = asyncio.ensure_future(collect(engine, GenerationRequest("waiter", [1, 2, 3], 27, GREEDY)))
    assert await asyncio.to_thread(wait_until, lambda: engine.num_waiting == 1, 5.0)
    waiter.cancel()
    assert await asyncio.to_thread(wait_until, lambda: engine.num_waiting == 0, 5.0)
    first.abort()
    assert await asyncio.to_thread(wait_until, lambda: engine.runtime.kv.reserved_tokens == 0, 5.0)
    tokens, _ = await collect(engine, GenerationRequest("next", [1, 2, 3], 27, GREEDY))
    assert len(tokens) == 27


@pytest.mark.anyio
async def test_async_engine_output_equals_the_engine_run_directly(tiny_engine):
    engine = tiny_engine(drafter=NgramDrafter())
    req = GenerationRequest("x", [3, 4, 5, 3, 4, 5, 3, 4], 24, SamplingParams(temperature=0.8, seed=7))
    tokens, last = await collect(engine, req)
    direct = SpeculativeEngine(TargetRuntime(engine.runtime.model, kv_budget_tokens=100), NgramDrafter())
    (state,) = direct.generate([req])
    assert tokens == state.output_ids
    assert (last.stats.rounds, last.stats.draft_tokens, last.stats.accepted_tokens) == (
        state.rounds, state.draft_tokens, state.accepted_tokens)
    assert state.draft_tokens > 0  # the n-gram drafter drafted: the statistics compared are not all zero


@pytest.mark.anyio
async def test_shutdown_fails_unfinished_requests_and_refuses_new_ones(tiny_engine):
    engine = tiny_engine()
    stream = await engine.submit(GenerationRequest("long", [1, 2], 400, GREEDY))
    await stream.__anext__()
    await asyncio.to_thread(engine.shutdown)
    with pytest.raises(EngineError):
        async for _ in stream:
            pass
    with pytest.raises(EngineError):
        await engine.submit(GenerationRequest("late", [1, 2], 4, GREEDY))
    assert engine.runtime.kv.reserved_tokens == 0


@needs_openmp_pool
def test_start_frees_the_openmp_workers_of_the_thread_that_built_the_engine():
    # Two pools on a 2-core machine make libgomp put idle workers to sleep at once: the served
    # forward ran 1.5x slower (dspark/model/compute_thread.py). Only the engine thread computes.
    workers = torch.get_num_threads() - 1

    def build_warm_and_start() -> tuple[int, int, AsyncEngine]:
        engine = AsyncEngine(SpeculativeEngine(tiny_runtime(), None))
        parallel_region()  # e.g. the warm-up and SPS(B) profile this thread ran
        before = os_threads()
        engine.start()  # + the engine thread, - this thread's workers
        return before, os_threads(), engine

    before, after, engine = on_a_fresh_thread(build_warm_and_start)
    try:
        assert after == before + 1 - workers
        tokens, _ = asyncio.run(collect(engine, GenerationRequest("r", [1, 2, 3], 4, GREEDY)))
        assert len(tokens) == 4
    finally:
        engine.shutdown()
