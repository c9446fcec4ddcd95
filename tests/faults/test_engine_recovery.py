"""The scheduler-side engine over real gRPC services that crash and restart (dspark/engine/faults.py).

A crash is the server stopped with its calls in flight cut off; a restart is a new server on the
same port around a fresh component (a new runtime, a new drafter: all per-request state gone), as
a restarted process has.

Specification: a drafter killed mid-generation leaves the greedy output unchanged (rounds go on
without drafts) and is drafted with again once it is back, also a drafter that reads the target's
hidden states (its requests are rebuilt on the verifier, whose prefill hands it every position);
a verifier killed mid-generation, noticed or restarted between two rounds, has its requests
rebuilt from prompt + output when it is back, with the greedy output unchanged and no KV left
behind; a verifier that does not come back fails its requests, and those arriving after them,
with an error that says so, within the configured bound; a request a dead scheduler left on the
services is replaced when a new scheduler continues it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import pytest

from dspark.drafters.ngram import NgramDrafter
from dspark.engine.async_engine import AsyncEngine, EngineError
from dspark.engine.faults import FaultPolicy
from dspark.engine.speculative import GenerationRequest, SpeculativeEngine
from dspark.engine.verifier import LocalVerifier
from dspark.sampling.params import SamplingParams
from services.drafter.client import RemoteDrafter
from services.drafter.server import start_drafter_server
from services.grpc_common import GrpcServer
from services.verifier.client import RemoteVerifier
from services.verifier.server import start_verifier_server
from tests.conftest import make_tiny_runtime
from tests.drafters.test_dspark_serving import make_serving_drafter
from tests.polling import wait_until

GREEDY = SamplingParams(temperature=0.0)
PROMPTS = [[5, 6, 7, 8] * 3, [1, 2, 3, 1, 2, 3, 1, 2], list(range(40, 60))]
CAPTURE = (1, 3)  # the layers the tiny DSpark drafter reads
FAST_RETRY = FaultPolicy(retry_interval_s=0.05)


class Restartable:
    """A gRPC server on a fixed port, killed and started again around a fresh component."""

    def __init__(self, start: Callable[[str], GrpcServer]):
        self._start = start
        self.server = start("127.0.0.1:0")
        self.address = f"127.0.0.1:{self.server.port}"
        self.up = True

    def kill(self) -> None:
        self.server.stop(None)  # no grace: calls in flight are cut off
        self.up = False

    def restart(self) -> None:
        self.server = self._start(self.address)
        self.up = True


class Deployment:
    """A verifier and a drafter service, each restartable; engines over them."""

    def __init__(self, drafter: str):
        self.runtimes = []  # every verifier runtime, latest last
        self.drafters = []  # every drafter instance, latest last
        self.verifier = Restartable(self._start_verifier)
        self.drafter = Restartable(lambda bind: self._start_drafter(drafter, bind))

    def _start_verifier(self, bind: str) -> GrpcServer:
        self.runtimes.append(make_tiny_runtime(capture_layers=CAPTURE))
        return start_verifier_server(LocalVerifier(self.runtimes[-1]), bind=bind)

    def _start_drafter(self, name: str, bind: str) -> GrpcServer:
        runtime = make_tiny_runtime(capture_layers=CAPTURE)  # the DSpark drafter reads the target's embedding and head
        self.drafters.append(NgramDrafter() if name == "ngram" else make_serving_drafter(runtime))
        return start_drafter_server(self.drafters[-1], vocab_size=runtime.vocab_size, hidden_size=runtime.config.hidden_size,
                                    bind=bind)

    def engine(self, faults: FaultPolicy = FAST_RETRY) -> SpeculativeEngine:
        return SpeculativeEngine.from_parts(verifier=RemoteVerifier(self.verifier.address),
                                            drafter=RemoteDrafter(self.drafter.address), num_speculative_tokens=4, faults=faults)

    def stop(self) -> None:
        for part in (self.drafter, self.verifier):
            if part.up:
                part.kill()


@pytest.fixture
def deployment():
    made = []

    def make(drafter: str = "ngram") -> Deployment:
        made.append(Deployment(drafter))
        return made[-1]

    yield make
    for d in made:
        d.stop()


def requests(max_new_tokens: int = 60, prefix: str = "r") -> list[GenerationRequest]:
    return [GenerationRequest(f"{prefix}{i}", p, max_new_tokens, GREEDY) for i, p in enumerate(PROMPTS)]


def plain_greedy(max_new_tokens: int = 60) -> list[list[int]]:
    states = SpeculativeEngine(make_tiny_runtime(capture_layers=CAPTURE), None).generate(requests(max_new_tokens, prefix="plain"))
    return [s.output_ids for s in states]


def drafted(states) -> int:
    return sum(s.draft_tokens for s in states)


def run_until(engine: SpeculativeEngine, done: Callable[[], bool], timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not done():
        assert time.monotonic() < deadline, f"not done after {timeout_s} s"
        engine.step()
        time.sleep(engine.stalled_for_s())  # as AsyncEngine does while every request waits for the verifier


def start(engine: SpeculativeEngine, max_new_tokens: int = 60):
    states = []
    for r in requests(max_new_tokens):
        engine.add_request(r)
        states.append(engine.running[r.request_id])
    return states


@pytest.mark.parametrize("drafter", ["ngram", "dspark"])
def test_a_drafter_killed_mid_generation_leaves_greedy_output_unchanged_and_is_used_again_once_back(deployment, drafter):
    d = deployment(drafter)
    engine = d.engine()
    states = start(engine)
    run_until(engine, lambda: drafted(states) > 0 and min(len(s.output_ids) for s in states) >= 8)

    d.drafter.kill()
    at_kill = drafted(states), [len(s.output_ids) for s in states]
    for _ in range(4):
        engine.step()
    assert engine.drafter_outage is not None and drafted(states) == at_kill[0]  # rounds went on without drafts
    assert all(len(s.output_ids) > n for s, n in zip(states, at_kill[1]))

    d.drafter.restart()
    assert wait_until(engine.drafter.is_serving, 10)  # the client's channel has dialled it again
    run_until(engine, lambda: not engine.has_unfinished)
    assert [s.output_ids for s in states] == plain_greedy()
    assert drafted(states) > at_kill[0]  # registered with the restarted drafter and drafted again
    if drafter == "dspark":  # its context came from a rebuild on the verifier; all of it is freed now
        assert all(d.drafters[-1].context_len(s.request.request_id) == 0 for s in states)
    assert d.runtimes[-1].kv.reserved_tokens == 0


@pytest.mark.parametrize("noticed", [True, False], ids=["killed-then-restarted", "restarted-between-rounds"])
def test_a_verifier_killed_mid_generation_is_rebuilt_when_it_is_back_and_greedy_output_is_unchanged(deployment, noticed):
    d = deployment("dspark")  # the rebuilt requests' context features reach the drafter too
    engine = d.engine()
    states = start(engine)
    run_until(engine, lambda: drafted(states) > 0 and min(len(s.output_ids) for s in states) >= 8)

    d.verifier.kill()
    if noticed:
        assert engine.step() == [] and all(s.needs_rebuild for s in states)
        assert engine.step() == [] and engine.verifier_outage is not None  # waits; nothing is failed
    d.verifier.restart()  # empty: every request's KV is gone
    at_restart = drafted(states)
    run_until(engine, lambda: not engine.has_unfinished)
    assert [s.output_ids for s in states] == plain_greedy()
    assert all(s.verifier_failures == 1 for s in states)
    assert drafted(states) > at_restart  # drafting went on after the rebuild
    assert d.runtimes[-1].kv.reserved_tokens == 0 and engine.verifier_outage is None


def test_a_verifier_that_does_not_come_back_fails_its_requests_with_a_clear_error_within_the_bound(deployment):
    d = deployment("ngram")
    async_engine = AsyncEngine(d.engine(FaultPolicy(retry_interval_s=0.05, verifier_timeout_s=1.0)), idle_poll_s=0.01).start()

    async def scenario() -> tuple[list[BaseException], BaseException]:
        streams = [await async_engine.submit(r) for r in requests(max_new_tokens=300)]
        for stream in streams:
            await anext(stream)  # generating
        d.verifier.kill()
        errors = []
        for stream in streams:
            with pytest.raises(EngineError) as failed:
                async for _ in stream:
                    pass
            errors.append(failed.value)
        late = await async_engine.submit(GenerationRequest("late", [1, 2, 3], 5, GREEDY))
        with pytest.raises(EngineError) as late_failed:
            await anext(late)
        return errors, late_failed.value

    try:
        errors, late_error = asyncio.run(asyncio.wait_for(scenario(), timeout=30))
    finally:
        async_engine.shutdown()
    assert all("the verifier has not answered for" in str(e) and "limit 1 s" in str(e) for e in errors)
    assert "the verifier has not answered for" in str(late_error)


def test_a_request_left_on_the_services_by_a_dead_scheduler_is_replaced_when_a_new_one_continues_it(deployment):
    d = deployment("dspark")
    dead = d.engine()
    (first,) = [dead.add_request(r) or dead.running[r.request_id] for r in requests(40)[:1]]
    run_until(dead, lambda: len(first.output_ids) >= 10)  # then this scheduler dies: nothing is freed

    new = d.engine()
    emitted = list(first.output_ids)
    continued = GenerationRequest("r0", PROMPTS[0] + emitted, 40 - len(emitted), GREEDY)  # what the bus worker sends
    (rest,) = new.generate([continued])
    assert emitted + rest.output_ids == plain_greedy(40)[0]
    assert d.runtimes[-1].kv.reserved_tokens == 0  # the dead scheduler's KV was replaced, not leaked
    assert d.drafters[-1].context_len("r0") == 0
