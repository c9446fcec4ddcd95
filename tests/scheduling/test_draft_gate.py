"""The draft gate (scheduling/draft_gate.py): a round drafts only when the last rounds say it pays.

Specification: with no history it drafts; it compares R(1+g) / (R t_d + T_v(R + Rℓ̄)) with
R / T_v(R) from the SPS table; a drafter whose drafts are never accepted stops being asked (but
is probed every `probe_every` rounds), a good one keeps drafting; inside the engine the gate keeps
greedy output identical to plain decoding and the sampled distribution exactly the target's
(chi-square) while it switches between drafted and skipped rounds.
"""

from __future__ import annotations

import math
from collections import Counter

import numpy as np
import pytest

from dspark.engine.speculative import GenerationRequest, SpeculativeEngine
from dspark.profiling.sps import SPSProfile
from dspark.sampling.params import SamplingParams
from dspark.scheduling.draft_gate import DraftGate
from dspark.scheduling.policies import parse_policy
from tests.distribution_checks import chi_square_pvalue, exact_sequence_probs
from tests.drafters.test_dspark_serving import make_serving_drafter

TABLE = 1.0 / np.array([0.010, 0.010, 0.011, 0.011, 0.012, 0.012, 0.013, 0.013, 0.014, 0.015])  # SPS(B), B = 1..10


def test_it_drafts_before_it_has_seen_a_drafted_round():
    assert DraftGate().should_draft(num_requests=3, sps_table=TABLE)
    assert DraftGate().should_draft(num_requests=3, sps_table=None)  # no profile: nothing to decide with


def test_the_expected_gain_is_the_ratio_of_tokens_per_second_with_and_without_drafting():
    gate = DraftGate(draft_s_per_request=0.002)
    gate.record(num_requests=2, draft_seconds=0.004, verified=8, accepted=2)  # ℓ̄ = 4, g = 1 per request
    # with: 2 * 2 tokens / (2 * 0.002 + T_v(2 + 8 = 10) = 0.015) ; without: 2 / T_v(2) = 2 / 0.010
    expected = (2 * 2 / (0.004 + 0.015)) / (2 / 0.010)
    assert gate.expected_gain(num_requests=2, sps_table=TABLE) == pytest.approx(expected)


def test_a_drafter_that_is_never_accepted_is_skipped_but_probed_less_and_less_often():
    gate = DraftGate(probe_every=3, max_probe_every=6, probe_budget=None)  # the doubling alone (budget: below)
    decisions = []
    for _ in range(25):
        draft = gate.should_draft(num_requests=1, sps_table=TABLE)
        decisions.append(draft)
        if draft:
            gate.record(num_requests=1, draft_seconds=0.003, verified=4, accepted=0)
    # the first round drafts (no history); then 3 skipped rounds and a probe that does not pay,
    # 6 skipped and a probe, then 6 (the cap) each time
    assert [i for i, d in enumerate(decisions) if d] == [0, 4, 11, 18]


def test_a_probe_that_pays_brings_back_the_short_wait():
    gate = DraftGate(probe_every=2, max_probe_every=8, probe_budget=None)
    rounds = []
    for i in range(40):
        draft = gate.should_draft(num_requests=1, sps_table=TABLE)
        if draft:
            rounds.append(i)
            # hopeless until round 20, then every draft is accepted (the request got easy)
            gate.record(num_requests=1, draft_seconds=0.001, verified=4, accepted=4 if i >= 20 else 0)
    assert rounds[:4] == [0, 3, 8, 17] and all(i in rounds for i in range(rounds[rounds.index(next(r for r in rounds if r >= 20)) + 2], 40))


def test_the_probe_waits_are_validated():
    with pytest.raises(ValueError, match="max_probe_every"):
        DraftGate(probe_every=8, max_probe_every=4)
    for budget in (0.0, 1.5):
        with pytest.raises(ValueError, match="probe_budget"):
            DraftGate(probe_budget=budget)


@pytest.mark.parametrize("budget", [0.01, 0.03])
def test_probes_that_do_not_pay_cost_at_most_the_budget_of_decoding_time(budget):
    """A drafter that costs half a step and is never accepted: probes wait long enough that their
    time beyond plain decoding stays within the budget (here 0.005 s a probe: 0.003 s drafting +
    T_v(5) - T_v(1) = 0.002 s; a plain step 0.010 s)."""
    gate = DraftGate(probe_budget=budget)
    probe_s = plain_s = 0.0
    for _ in range(20_000):
        if gate.should_draft(num_requests=1, sps_table=TABLE):
            gate.record(num_requests=1, draft_seconds=0.003, verified=4, accepted=0)
            probe_s += 0.003 + 1 / TABLE[4] - 1 / TABLE[0]
        plain_s += 1 / TABLE[0]
    assert gate.budget_wait(num_requests=1, sps_table=TABLE) == math.ceil(0.005 / (budget * 0.010))
    assert probe_s / plain_s <= budget * 1.05
    assert probe_s > 0  # it still probes


def test_a_probe_costs_what_it_takes_beyond_plain_decoding_of_its_accepted_tokens():
    gate = DraftGate(draft_s_per_request=0.002, probe_budget=0.01)
    gate.record(num_requests=2, draft_seconds=0.004, verified=8, accepted=0.5)  # ℓ̄ = 4, g = 0.25 per request
    # 2 * 0.002 + T_v(10) = 0.015 - 1.25 * T_v(2) = 0.0125 -> 0.0065 s, over 1% of 0.010 s
    assert gate.budget_wait(num_requests=2, sps_table=TABLE) == math.ceil(0.0065 / (0.01 * 0.010))


def test_a_drafter_that_pays_keeps_drafting():
    gate = DraftGate()
    for _ in range(10):
        assert gate.should_draft(num_requests=2, sps_table=TABLE)
        gate.record(num_requests=2, draft_seconds=0.002, verified=8, accepted=6)


def test_the_gate_runs_in_the_synchronous_dspark_policy_only():
    # dspark-async reads confidences of two rounds earlier: rounds without drafts would starve it
    for spec, gated in [("none", False), ("fixed:3", False), ("threshold:0.5", False), ("dspark", True), ("dspark-async", False)]:
        assert parse_policy(spec).gates_drafting is gated


# ---- inside the engine ------------------------------------------------------------------------

PROFILE = SPSProfile(batch_sizes=[1, 4, 8, 16, 64, 4096], step_seconds=[0.010, 0.011, 0.013, 0.020, 0.080, 5.0])


def gated_engine(runtime, *, draft_s_per_request: float, probe_every: int = 2) -> SpeculativeEngine:
    engine = SpeculativeEngine(runtime, make_serving_drafter(runtime, seed=2, block_size=2), num_speculative_tokens=2,
                               policy=parse_policy("dspark"))
    engine.sps_profile = PROFILE
    # a fixed probe period (no backoff, no time budget): these tests price drafting so that the decision flips
    engine.draft_gate = DraftGate(draft_s_per_request=draft_s_per_request, probe_every=probe_every,
                                  max_probe_every=probe_every, probe_budget=None)
    return engine


def test_greedy_output_is_plain_decoding_while_the_gate_switches(tiny_runtime_factory):
    runtime = tiny_runtime_factory(capture_layers=(1, 3))
    prompts = [[5, 6, 7, 8, 9], list(range(40, 70))]
    greedy = SamplingParams(temperature=0.0)
    plain = SpeculativeEngine(runtime, None).generate([GenerationRequest(f"p{i}", p, 24, greedy) for i, p in enumerate(prompts)])
    engine = gated_engine(runtime, draft_s_per_request=1.0)  # drafting "costs" a second: only probes draft
    spec = engine.generate([GenerationRequest(f"s{i}", p, 24, greedy) for i, p in enumerate(prompts)])
    assert [s.output_ids for s in spec] == [s.output_ids for s in plain]
    assert engine.counters.rounds_without_drafting > 0 and sum(s.draft_tokens for s in spec) > 0
    assert sum(s.accepted_tokens for s in spec) > 0  # the probes' drafts were verified, some accepted


def test_sampled_output_keeps_the_target_distribution_while_the_gate_switches(tiny_runtime_factory):
    """Whether a round drafts depends on earlier rounds' acceptance (here: a cost that makes the
    decision flip with it), never on the round's own drafts: the output stays exact."""
    runtime = tiny_runtime_factory(vocab_size=8, num_layers=2, embed_std=0.12, seed=11, capture_layers=(0, 1))
    prompt, num_tokens, n = [3, 1, 4, 1, 5], 3, 3000
    exact = exact_sequence_probs(runtime, prompt, num_tokens)
    # drafting priced so that it pays only when about one draft per request is accepted: the
    # decision follows the recent acceptance, which varies from batch to batch
    engine = gated_engine(runtime, draft_s_per_request=0.001, probe_every=3)
    states = []
    for batch in range(n // 5):  # 600 batches of 5 requests: the gate's state carries across them
        states += engine.generate([GenerationRequest(f"b{batch}-{i}", prompt, num_tokens + 1,
                                                     SamplingParams(temperature=1.0, seed=batch * 5 + i)) for i in range(5)])
    drafted = sum(s.draft_tokens for s in states)
    decode_rounds = engine.counters.steps - n // 5  # one prefill round per batch
    assert 0.1 * decode_rounds < engine.counters.rounds_without_drafting < 0.9 * decode_rounds and drafted > 500
    samples = Counter(tuple(s.output_ids[:num_tokens]) for s in states)
    assert chi_square_pvalue(samples, exact, n) > 1e-3
