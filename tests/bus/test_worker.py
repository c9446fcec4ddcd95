"""run_worker: bus requests through a real AsyncEngine (tiny random model), on both buses.

Specification: the output stream of a request holds exactly the engine's tokens, once, after an
empty "accepted" event, and the request is acknowledged after its final event; a worker that
dies mid-request leaves it pending, another worker re-claims it and continues from the
published tokens, so the client sees every token exactly once and (greedy) the same text as a
single uninterrupted run; a worker that was presumed dead and wakes up cannot write any more; a
cancel signal aborts the engine request within a round or two and ends the stream with
`cancelled`; a request the engine refuses ends with an `invalid_request` error; a worker that
stops leaves its requests pending for others.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time

import pytest

from dspark.bus.base import Delivery, Published
from dspark.bus.messages import BusRequest, OutputEvent
from dspark.bus.worker import continuation_request, continuation_seed, run_worker, start_worker_thread
from dspark.engine.async_engine import AsyncEngine
from dspark.engine.speculative import GenerationRequest, SpeculativeEngine
from dspark.sampling.params import SamplingParams
from tests.conftest import make_tiny_runtime
from tests.polling import wait_until

pytestmark = pytest.mark.anyio

GREEDY = SamplingParams(temperature=0.0)
PROMPT = [11, 42, 7, 99, 3, 5]


class CountingEngine:
    """A started AsyncEngine over the tiny model whose rounds are counted, can be slowed down, and
    stop after `hold_after_steps` until `release()` (a request that cannot finish too early)."""

    def __init__(self, *, step_delay_s: float = 0.0, kv_budget_tokens: int = 1 << 14, hold_after_steps: int | None = None):
        self.spec = SpeculativeEngine(make_tiny_runtime(kv_budget_tokens=kv_budget_tokens), None)
        self.steps = 0
        self.hold_after_steps = hold_after_steps
        self.gate = threading.Event()
        self.gate.set()
        step = self.spec.step

        def counted_step():  # runs on the engine thread
            if self.hold_after_steps is not None and self.steps >= self.hold_after_steps:
                self.gate.clear()
            self.gate.wait()
            if step_delay_s:
                time.sleep(step_delay_s)
            self.steps += 1
            return step()

        self.spec.step = counted_step
        self.engine = AsyncEngine(self.spec, idle_poll_s=0.01).start()

    def release(self) -> None:
        self.hold_after_steps = None
        self.gate.set()

    @property
    def kv_reserved(self) -> int:
        return self.spec.runtime.kv.reserved_tokens


@pytest.fixture
def engines():
    made: list[CountingEngine] = []

    def make(**kwargs) -> CountingEngine:
        made.append(CountingEngine(**kwargs))
        return made[-1]

    yield make
    for e in made:
        e.release()
        e.engine.shutdown()


def reference(prompt: list[int], max_new_tokens: int) -> list[int]:
    """The greedy output of one uninterrupted run, on the engine directly."""
    (state,) = SpeculativeEngine(make_tiny_runtime(), None).generate([GenerationRequest("ref", prompt, max_new_tokens, GREEDY)])
    return state.output_ids


@contextlib.asynccontextmanager
async def worker(bus, engine: AsyncEngine, consumer: str, **kwargs):
    stop = asyncio.Event()
    task = asyncio.create_task(run_worker(bus, engine, consumer=consumer, stop=stop, block_s=0.05, **kwargs))
    try:
        yield task
    finally:
        stop.set()
        if not task.done():
            await asyncio.wait_for(task, 10)


async def tail_all(bus, rid: str, *, timeout: float = 60.0) -> list[OutputEvent]:
    async def run():
        return [e async for e in bus.tail(rid)]

    return await asyncio.wait_for(run(), timeout)


async def wait_for_tokens(bus, rid: str, n: int, *, timeout: float = 30.0) -> None:
    async def run():
        async for e in bus.tail(rid):
            if e.end >= n:
                return

    await asyncio.wait_for(run(), timeout)


def tokens_of(events: list[OutputEvent]) -> list[int]:
    return [t for e in events for t in e.token_ids]


def assert_contiguous(events: list[OutputEvent]) -> None:
    end = 0
    for e in events:
        assert e.offset == end, f"event at offset {e.offset} after {end} tokens: a token was lost or duplicated"
        end = e.end
    assert events[-1].final and sum(e.final for e in events) == 1


async def test_the_stream_holds_the_engine_output_once_and_the_request_is_acked(make_bus, engines):
    bus, engine = make_bus(), engines()
    await bus.submit(BusRequest("cmpl-a", PROMPT, 24, GREEDY))
    async with worker(bus, engine.engine, "w1"):
        events = await tail_all(bus, "cmpl-a")
        assert await asyncio.to_thread(wait_until, lambda: engine.kv_reserved == 0, 5.0)
    assert events[0].token_ids == [] and events[0].offset == 0 and not events[0].final  # accepted
    assert_contiguous(events)
    assert tokens_of(events) == reference(PROMPT, 24)
    final = events[-1]
    assert final.finish_reason == "length"
    assert final.stats.completion_tokens == 24 and final.stats.prompt_tokens == len(PROMPT)
    assert await bus.queue_depth() == 0


async def test_a_request_of_a_dead_worker_is_reclaimed_and_every_token_arrives_exactly_once(make_bus, engines):
    gateway = make_bus(claim_idle_s=0.8)
    bus_a, bus_b = make_bus(claim_idle_s=0.8), make_bus(claim_idle_s=0.8)
    engine_a, engine_b = engines(hold_after_steps=8), engines()  # a cannot finish before it dies
    await gateway.submit(BusRequest("cmpl-dies", PROMPT, 60, GREEDY))
    tail = asyncio.ensure_future(tail_all(gateway, "cmpl-dies"))
    async with worker(bus_a, engine_a.engine, "a") as task_a:
        await wait_for_tokens(gateway, "cmpl-dies", 5)
        task_a.cancel()  # the scheduler dies mid-request: no final event, no ack
        await asyncio.gather(task_a, return_exceptions=True)
    partial = [e async for e in _events_so_far(gateway, "cmpl-dies")]
    assert 5 <= partial[-1].end <= 8 and not partial[-1].final
    assert await gateway.queue_depth() == 1  # still pending
    async with worker(bus_b, engine_b.engine, "b"):
        events = await tail
    assert_contiguous(events)
    assert tokens_of(events) == reference(PROMPT, 60)
    assert events[-1].stats.completion_tokens == 60 and events[-1].stats.prompt_tokens == len(PROMPT)
    assert engine_b.steps > 0 and await gateway.queue_depth() == 0


async def test_a_worker_presumed_dead_cannot_write_after_the_takeover(make_bus, engines, caplog):
    gateway, bus_b = make_bus(claim_idle_s=0.8), make_bus(claim_idle_s=0.8)
    engine_a, engine_b = engines(hold_after_steps=6), engines()
    await gateway.submit(BusRequest("cmpl-zombie", PROMPT, 40, GREEDY))
    # Worker a runs on its own thread and event loop (its own process, as far as the bus can tell).
    worker_a = start_worker_thread(lambda: make_bus(claim_idle_s=0.8), engine_a.engine, consumer="a", block_s=0.05)
    try:
        await wait_for_tokens(gateway, "cmpl-zombie", 2)
        frozen = threading.Event()
        worker_a._loop.call_soon_threadsafe(frozen.wait)  # the whole worker stalls: no publishes, no keep-alives
        async with worker(bus_b, engine_b.engine, "b"):
            events = await tail_all(gateway, "cmpl-zombie")
        assert engine_a.engine.num_running == 1, "a's engine should still be generating when a wakes up"
        frozen.set()  # a wakes up and goes on: its next publish is refused, and it aborts its engine request
        engine_a.release()
        assert await asyncio.to_thread(wait_until, lambda: engine_a.engine.num_running == 0 and engine_a.kv_reserved == 0, 10.0)
    finally:
        worker_a.stop()
    assert_contiguous(events)
    assert tokens_of(events) == reference(PROMPT, 40)
    assert engine_b.steps > 0
    assert any("taken over" in r.getMessage() for r in caplog.records), "a never tried to write after the take-over"


async def test_cancel_frees_the_engine_request_within_a_round_or_two(make_bus, engines):
    bus, engine = make_bus(), engines(step_delay_s=0.05)
    await bus.submit(BusRequest("cmpl-cancel", PROMPT, 400, GREEDY))
    async with worker(bus, engine.engine, "w"):
        await wait_for_tokens(bus, "cmpl-cancel", 3)
        steps_at_cancel = engine.steps
        await bus.cancel("cmpl-cancel")
        assert await asyncio.to_thread(wait_until, lambda: engine.engine.num_running == 0 and engine.kv_reserved == 0, 10.0)
        assert engine.steps - steps_at_cancel <= 2
        events = await tail_all(bus, "cmpl-cancel")
    assert events[-1].finish_reason == "cancelled" and events[-1].end < 400
    assert_contiguous(events)
    assert await bus.queue_depth() == 0


async def test_a_request_cancelled_before_any_worker_saw_it_never_runs(make_bus, engines):
    bus, engine = make_bus(), engines()
    await bus.submit(BusRequest("cmpl-early", PROMPT, 10, GREEDY))
    await bus.cancel("cmpl-early")
    async with worker(bus, engine.engine, "w"):
        events = await tail_all(bus, "cmpl-early")
    assert [e.finish_reason for e in events] == ["cancelled"] and engine.steps == 0


async def test_a_request_the_engine_refuses_ends_with_an_invalid_request_error(make_bus, engines):
    bus, engine = make_bus(), engines(kv_budget_tokens=32)
    await bus.submit(BusRequest("cmpl-big", PROMPT, 100, GREEDY))  # needs 106 KV tokens of 32
    async with worker(bus, engine.engine, "w"):
        (event,) = await tail_all(bus, "cmpl-big")
    assert event.finish_reason == "error" and event.error.kind == "invalid_request"
    assert "KV" in event.error.message
    assert await bus.queue_depth() == 0


async def test_a_stopping_worker_leaves_its_requests_pending_for_others(make_bus, engines):
    bus = make_bus(claim_idle_s=0.3)
    engine_a, engine_b = engines(hold_after_steps=4), engines()
    await bus.submit(BusRequest("cmpl-handover", PROMPT, 30, GREEDY))
    async with worker(bus, engine_a.engine, "a"):
        await wait_for_tokens(bus, "cmpl-handover", 2)
    assert await bus.queue_depth() == 1
    engine_a.release()
    assert await asyncio.to_thread(wait_until, lambda: engine_a.engine.num_running == 0, 5.0)  # aborted on stop
    async with worker(bus, engine_b.engine, "b"):
        events = await tail_all(bus, "cmpl-handover")
    assert_contiguous(events)
    assert tokens_of(events) == reference(PROMPT, 30)


async def test_logprobs_travel_with_their_tokens(make_bus, engines):
    """Requested logprobs ride on each event with its tokens: the stream holds the logprobs of the
    engine's own run. (A take-over mid-request is left to test_a_continuation_... below: a worker
    test that held one engine and moved the request to another hung intermittently under load.)"""
    engine = SpeculativeEngine(make_tiny_runtime(), None)
    expected = [out.logprobs for out in _steps(engine, GenerationRequest("ref", PROMPT, 12, GREEDY, logprobs=2))]
    expected_lps = [x for lp in expected for x in lp.logprobs]
    bus = make_bus()
    await bus.submit(BusRequest("cmpl-logprobs", PROMPT, 12, GREEDY, logprobs=2))
    async with worker(bus, engines().engine, "a"):
        events = await tail_all(bus, "cmpl-logprobs")
    assert_contiguous(events)
    assert tokens_of(events) == reference(PROMPT, 12)
    got = [x for e in events if e.logprobs is not None for x in e.logprobs.logprobs]
    assert all(e.logprobs is not None for e in events if e.token_ids)
    assert got == expected_lps
    assert all(len(ids) == 2 for e in events if e.logprobs is not None for ids in e.logprobs.top_ids)


def _steps(engine: SpeculativeEngine, request: GenerationRequest):
    engine.add_request(request)
    while engine.has_unfinished:
        yield from engine.step()


def test_a_continuation_prompts_with_the_published_tokens_and_derives_a_fresh_seed():
    req = BusRequest("r", [1, 2], 10, SamplingParams(temperature=1.0, seed=7), stop_token_ids=frozenset({0}))
    fresh = continuation_request(Delivery(req, "1-0", "c", 1, Published([], None, False)))
    assert fresh.prompt_ids == [1, 2] and fresh.max_new_tokens == 10 and fresh.params.seed == 7
    cont = continuation_request(Delivery(req, "1-0", "c", 2, Published([5, 6, 9], None, False)))
    assert cont.prompt_ids == [1, 2, 5, 6, 9] and cont.max_new_tokens == 7 and cont.stop_token_ids == frozenset({0})
    assert cont.params.seed == continuation_seed(7, 3) != 7  # not a replay of the first tokens' random numbers
    assert cont.logprobs is None
    assert continuation_request(Delivery(BusRequest("r", [1], 4, logprobs=5), "1-0", "c", 1, Published([3], None, False))).logprobs == 5
    assert continuation_seed(7, 3) == continuation_seed(7, 3) != continuation_seed(7, 4)
    assert 0 <= continuation_seed(-5, 1) < 2**63


async def _events_so_far(bus, rid: str):
    """The events published up to now (an unfinished stream's tail would wait for more)."""
    seen = []

    async def read():
        async for e in bus.tail(rid):
            seen.append(e)

    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(read(), 0.5)
    for e in seen:
        yield e
