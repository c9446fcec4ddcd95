"""dspark/observability/rounds.py inside the engine: every round's spans and metrics.

Specification (on the tiny random model with the n-gram drafter, in process): a traced request
alone gets one `round` span per engine step as its child, each with `draft`, `schedule` and
`verify` children in that order; with two traced requests a round is the child of the older
and links the younger; untraced requests make no spans; the metrics move by exactly what the
requests' own statistics say (drafts, accepted tokens, per position, generated tokens, rounds).
"""

from __future__ import annotations

import pytest
from prometheus_client import REGISTRY

from dspark.drafters.ngram import NgramDrafter
from dspark.engine.speculative import GenerationRequest, SpeculativeEngine
from dspark.observability import tracing
from dspark.sampling.params import SamplingParams
from tests.observability.conftest import by_name

GREEDY = SamplingParams(temperature=0.0)
REPETITIVE = [1, 2, 3, 4, 1, 2, 3, 4, 1, 2, 3, 4, 1, 2]  # the n-gram drafter finds matches in it
GAMMA = 3


def counters() -> dict[str, float]:
    names = ["dspark_rounds_total", "dspark_draft_tokens_total", "dspark_accepted_tokens_total", "dspark_generation_tokens_total",
             "dspark_prompt_tokens_total", "dspark_verify_tokens_per_request_count", "dspark_verify_tokens_per_request_sum"]
    out = {n: REGISTRY.get_sample_value(n) or 0.0 for n in names}
    for p in range(1, GAMMA + 1):
        out[f"drafted@{p}"] = REGISTRY.get_sample_value("dspark_draft_tokens_per_position_total", {"position": str(p)}) or 0.0
        out[f"accepted@{p}"] = REGISTRY.get_sample_value("dspark_accepted_tokens_per_position_total", {"position": str(p)}) or 0.0
    return out


def run_to_completion(engine: SpeculativeEngine) -> int:
    steps = 0
    while engine.has_unfinished:
        engine.step()
        steps += 1
    return steps


def test_a_traced_request_alone_has_a_round_span_per_step_with_its_phases(spans, tiny_runtime):
    engine = SpeculativeEngine(tiny_runtime, NgramDrafter(), num_speculative_tokens=GAMMA)
    with tracing.tracer().start_as_current_span("request") as request_span:
        engine.add_request(GenerationRequest("r", REPETITIVE, 12, GREEDY))
    state = engine.running["r"]
    steps = run_to_completion(engine)
    finished = spans.get_finished_spans()
    rounds = by_name(finished, "round")
    assert len(rounds) == steps == state.rounds + 1  # the prefill is a round too
    for r in rounds:
        assert r.parent.span_id == request_span.get_span_context().span_id and r.links == ()
        phases = sorted((s for s in finished if s.parent is not None and s.parent.span_id == r.context.span_id),
                        key=lambda s: s.start_time)
        assert [s.name for s in phases] == ["draft", "schedule", "verify"]
        assert r.attributes["dspark.batch_size"] == 1
    assert sum(r.attributes["dspark.draft_tokens"] for r in rounds) == state.draft_tokens > 0
    assert sum(r.attributes["dspark.accepted_tokens"] for r in rounds) == state.accepted_tokens


def test_a_round_of_two_traced_requests_is_the_older_ones_child_and_links_the_younger(spans, tiny_runtime):
    engine = SpeculativeEngine(tiny_runtime, NgramDrafter(), num_speculative_tokens=GAMMA)
    with tracing.tracer().start_as_current_span("older") as older:
        engine.add_request(GenerationRequest("old", REPETITIVE, 6, GREEDY))
    with tracing.tracer().start_as_current_span("younger") as younger:
        engine.add_request(GenerationRequest("young", REPETITIVE[::-1], 6, GREEDY))
    run_to_completion(engine)
    both = [r for r in by_name(spans.get_finished_spans(), "round") if r.attributes["dspark.batch_size"] == 2]
    assert both
    for r in both:
        assert r.context.trace_id == older.get_span_context().trace_id != younger.get_span_context().trace_id
        assert r.parent.span_id == older.get_span_context().span_id
        assert [link.context.span_id for link in r.links] == [younger.get_span_context().span_id]


def test_untraced_requests_make_no_spans(spans, tiny_runtime):
    engine = SpeculativeEngine(tiny_runtime, NgramDrafter(), num_speculative_tokens=GAMMA)
    engine.generate([GenerationRequest("r", REPETITIVE, 8, GREEDY)])
    assert spans.get_finished_spans() == ()


def test_the_metrics_move_by_what_the_requests_report(tiny_runtime):
    engine = SpeculativeEngine(tiny_runtime, NgramDrafter(), num_speculative_tokens=GAMMA)
    before = counters()
    states = engine.generate([GenerationRequest("a", REPETITIVE, 16, GREEDY), GenerationRequest("b", REPETITIVE[2:], 9, GREEDY)])
    delta = {k: v - before[k] for k, v in counters().items()}
    drafted, accepted = sum(s.draft_tokens for s in states), sum(s.accepted_tokens for s in states)
    decode_rounds = sum(s.rounds for s in states)
    assert drafted > 0
    assert delta["dspark_rounds_total"] == engine.counters.steps
    assert delta["dspark_draft_tokens_total"] == drafted == sum(delta[f"drafted@{p}"] for p in range(1, GAMMA + 1))
    assert delta["dspark_accepted_tokens_total"] == accepted == sum(delta[f"accepted@{p}"] for p in range(1, GAMMA + 1))
    assert delta["dspark_generation_tokens_total"] == sum(len(s.output_ids) for s in states) == 16 + 9
    assert delta["dspark_prompt_tokens_total"] == len(REPETITIVE) + len(REPETITIVE[2:])
    assert delta["dspark_verify_tokens_per_request_count"] == decode_rounds
    assert delta["dspark_verify_tokens_per_request_sum"] == drafted + decode_rounds  # Σ (ℓ + 1)
    # acceptance can only fall with the position: a draft at p is accepted only if p - 1 was
    assert [delta[f"accepted@{p}"] for p in range(1, GAMMA + 1)] == sorted((delta[f"accepted@{p}"] for p in range(1, GAMMA + 1)),
                                                                           reverse=True)


@pytest.mark.parametrize("phase", ["prefill", "tokenize"])
def test_a_phase_outside_draft_schedule_verify_is_refused(phase):
    from dspark.observability.rounds import RoundObserver

    with RoundObserver(0, []) as observed, pytest.raises(ValueError, match="phase must be one of"), observed.phase(phase):
        pass
