"""dspark/observability/round_feed.py inside the engine: one RoundEvent per round, only while watched.

Specification (tiny random model, in process): an engine nobody watches builds no round event at
all; a subscriber gets one event per engine step, and its numbers are the engine's: per request
the emitted tokens concatenate to the output, the drafts verified and accepted and the decode
rounds add up to the request's statistics, the accepted tokens are the drafts' prefix, B is what
the metrics count; under Algorithm 1 the event's Θ is τ*·SPS(B) of the round's ℓ on the profile
the feed sent first, and the break names the draft after the admitted prefix; the wire form
round-trips; a subscriber that falls behind is dropped without slowing the others, and a feed
that fails never changes a round's output.
"""

from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest

from dspark.drafters.ngram import NgramDrafter
from dspark.engine.async_engine import AsyncEngine
from dspark.engine.speculative import GenerationRequest, SpeculativeEngine
from dspark.observability.round_feed import Dropped, RoundEvent, SpsProfile, message_from_wire
from dspark.profiling.sps import SPSProfile
from dspark.sampling.params import SamplingParams
from dspark.scheduling.policies import parse_policy
from dspark.scheduling.prefix_scheduler import throughput_objective
from tests.drafters.test_dspark_serving import make_serving_drafter

pytestmark = pytest.mark.anyio

GREEDY = SamplingParams(temperature=0.0)
PROMPTS = [[1, 2, 3, 4, 1, 2, 3, 4, 1, 2, 3, 4, 1, 2], [5, 6, 7, 8, 9], list(range(40, 70))]
PROFILE = SPSProfile(batch_sizes=[1, 4, 8, 16, 64], step_seconds=[0.010, 0.011, 0.013, 0.020, 0.080])


@pytest.fixture
def anyio_backend():
    return "asyncio"


def requests(max_new_tokens: int = 16) -> list[GenerationRequest]:
    return [GenerationRequest(f"r{i}", p, max_new_tokens, GREEDY) for i, p in enumerate(PROMPTS)]


def rounds_of(messages: list) -> list[RoundEvent]:
    return [m for m in messages if isinstance(m, RoundEvent)]


async def test_an_engine_nobody_watches_builds_no_round_event(tiny_runtime, monkeypatch):
    built = []
    monkeypatch.setattr(SpeculativeEngine, "_request_rounds", staticmethod(lambda *a: built.append(a) or []))
    engine = SpeculativeEngine(tiny_runtime, NgramDrafter(), num_speculative_tokens=3)
    engine.generate(requests())
    assert engine.counters.steps > 3 and built == [] and engine.round_feed.published == 0
    sub = engine.round_feed.subscribe()  # watched from now on: the next request's rounds are built
    engine.generate([GenerationRequest("later", PROMPTS[0], 4, GREEDY)])
    assert built and engine.round_feed.published == len(built)
    sub.close()
    assert not engine.round_feed.watched


async def test_a_subscriber_gets_every_round_with_the_engines_numbers(tiny_runtime):
    engine = SpeculativeEngine(tiny_runtime, NgramDrafter(), num_speculative_tokens=3)
    sub = engine.round_feed.subscribe()
    states = engine.generate(requests())
    events = rounds_of(sub.get_nowait())
    assert [e.round_id for e in events] == list(range(engine.counters.steps))  # one per step, in order, none lost
    for state in states:
        rid = state.request.request_id
        parts = [(e, r) for e in events for r in e.requests if r.request_id == rid]
        decode = [r for _, r in parts if not r.prefill]
        assert [t for _, r in parts for t in r.emitted] == state.output_ids
        assert len(decode) == state.rounds and sum(r.admitted for r in decode) == state.draft_tokens > 0
        assert sum(r.accepted for r in decode) == state.accepted_tokens > 0
        assert sum(len(r.emitted) for r in decode) == state.emitted_in_rounds
        for r in decode:  # no policy: every draft is verified; accepted tokens are the drafts' prefix
            assert r.admitted == len(r.drafted) and r.emitted[: r.accepted] == r.drafted[: r.accepted]
        assert parts[-1][1].finish_reason == "length"
    for e in events:
        prefill = sum(len(PROMPTS[int(r.request_id[1:])]) for r in e.requests if r.prefill)
        assert e.batch_tokens == prefill + sum(1 + r.admitted for r in e.requests if not r.prefill)
        assert e.verify_s > 0 and e.draft_s >= 0 and e.policy is None and e.schedule is None and e.sps_key is None
    assert events[-1].running == 0
    sub.close()


async def test_under_algorithm_1_the_event_carries_its_theta_and_break(tiny_runtime_factory):
    runtime = tiny_runtime_factory(capture_layers=(1, 3))
    engine = SpeculativeEngine(runtime, make_serving_drafter(runtime), num_speculative_tokens=4, policy=parse_policy("dspark"))
    engine.sps_profile = PROFILE
    sub = engine.round_feed.subscribe()
    engine.generate(requests(20))
    messages = sub.get_nowait()
    profile = messages[0]
    assert isinstance(profile, SpsProfile) and profile.batch_sizes == PROFILE.batch_sizes  # first: the curve
    assert sum(isinstance(m, SpsProfile) for m in messages) == 1  # and only once while it does not change
    scheduled = [e for e in rounds_of(messages) if e.schedule is not None]
    assert len(scheduled) >= 5 and {e.schedule.stop for e in scheduled} & {"break"}
    for e in scheduled:
        decoding = [r for r in e.requests if not r.prefill]
        width = max(len(r.drafted) for r in decoding)
        confidences = np.zeros((len(decoding), max(width, 1)))
        for i, r in enumerate(decoding):
            confidences[i, : len(r.confidences)] = r.confidences
        s = e.schedule
        prefill_tokens = s.base_batch - len(decoding)
        kwargs = {"confidences": confidences, "num_drafts": [len(r.drafted) for r in decoding],
                  "sps_table": PROFILE.table(upto=s.base_batch + width * len(decoding)),
                  "prefill_tokens": prefill_tokens, "prefill_emitted": sum(r.prefill for r in e.requests)}
        lengths = [r.admitted for r in decoding]
        assert e.sps_key == profile.key and s.admitted == sum(lengths) and e.batch_tokens == s.base_batch + s.admitted
        assert s.theta == pytest.approx(throughput_objective(draft_lengths=lengths, **kwargs), rel=1e-12)
        if s.stop == "break":
            (cut,) = [r for r in decoding if r.request_id == s.break_request]
            assert s.break_position == cut.admitted + 1 <= len(cut.drafted) and s.thetas[-1] <= s.thetas[-2]
    sub.close()


async def test_the_wire_form_round_trips(tiny_runtime_factory):
    runtime = tiny_runtime_factory(capture_layers=(1, 3))
    engine = SpeculativeEngine(runtime, make_serving_drafter(runtime), num_speculative_tokens=4, policy=parse_policy("dspark"))
    engine.sps_profile = PROFILE
    sub = engine.round_feed.subscribe()
    engine.generate(requests(8))
    messages = sub.get_nowait()
    assert [message_from_wire(json.loads(json.dumps(m.to_wire()))) for m in messages] == messages
    with pytest.raises(ValueError, match="accepted <= admitted"):
        bad = rounds_of(messages)[-1].to_wire()
        bad["requests"][0]["accepted"] = 99
        message_from_wire(bad)
    sub.close()


async def test_a_subscriber_that_falls_behind_is_dropped_and_the_others_get_everything(tiny_runtime):
    engine = SpeculativeEngine(tiny_runtime, NgramDrafter(), num_speculative_tokens=3)
    slow, fast = engine.round_feed.subscribe(maxsize=2), engine.round_feed.subscribe()
    engine.generate(requests())
    with pytest.raises(Dropped):
        slow.get_nowait()
    with pytest.raises(Dropped):
        await slow.get(timeout=0.1)
    assert len(rounds_of(fast.get_nowait())) == engine.counters.steps
    fast.close()
    assert not engine.round_feed.watched  # the dropped one was detached by the feed itself


async def test_a_feed_that_fails_never_changes_a_round(tiny_runtime_factory, monkeypatch, caplog):
    plain = SpeculativeEngine(tiny_runtime_factory(), NgramDrafter(), num_speculative_tokens=3).generate(requests())
    engine = SpeculativeEngine(tiny_runtime_factory(), NgramDrafter(), num_speculative_tokens=3)
    sub = engine.round_feed.subscribe()

    def broken(*args, **kwargs):
        raise RuntimeError("a bug in the feed")

    monkeypatch.setattr(engine.round_feed, "publish", broken)
    states = engine.generate(requests())
    assert [s.output_ids for s in states] == [s.output_ids for s in plain]
    assert "publishing round" in caplog.text
    sub.close()


async def test_a_subscriber_on_another_loop_is_woken_by_the_engine_thread(tiny_runtime):
    engine = AsyncEngine(SpeculativeEngine(tiny_runtime, NgramDrafter(), num_speculative_tokens=3)).start()
    try:
        sub = engine.engine.round_feed.subscribe()
        stream = await engine.submit(GenerationRequest("a", PROMPTS[0], 12, GREEDY))
        tokens = [t async for delta in stream for t in delta.new_token_ids]
        got = []
        while len(got) < engine.engine.counters.steps:
            message = await asyncio.wait_for(sub.get(timeout=5), 10)
            assert message is not None
            got.append(message)
        assert [t for e in got for r in e.requests for t in r.emitted] == tokens
        sub.close()
    finally:
        engine.shutdown()
