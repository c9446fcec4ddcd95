"""Draft-length policies inside the engine: every policy leaves the output exactly the target's.

Greedy output equals plain decoding for none, fixed:K, threshold:C, dspark and dspark-async,
with drafts verified and some accepted (none: no drafts at all); the policies really change how
many drafts are verified; at temperature 1 the dspark policy (Algorithm 1 with the break) and
dspark-async keep the sampled distribution exact (chi-square), and the same test rejects a policy
whose decision to verify a draft depends on that draft.
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from dspark.engine.speculative import GenerationRequest, SpeculativeEngine
from dspark.profiling.sps import SPSProfile
from dspark.sampling.params import SamplingParams
from dspark.scheduling.policies import parse_policy
from tests.conftest import SMALL_VOCAB_RUNTIME
from tests.distribution_checks import P_PASS, P_WRONG, chi_square_pvalue, exact_sequence_probs, losslessness_pvalue
from tests.drafters.engine_checks import sample_continuations
from tests.drafters.test_dspark_serving import make_serving_drafter

GREEDY = SamplingParams(temperature=0.0)
# A verifier whose step time grows slowly with B: Algorithm 1 admits some drafts, not all.
PROFILE = SPSProfile(batch_sizes=[1, 4, 8, 16, 64], step_seconds=[0.010, 0.011, 0.013, 0.020, 0.080])
PROMPTS = [[5, 6, 7, 8, 9], [1, 2, 3, 1, 2, 3, 1, 2], list(range(40, 70))]


def run(runtime, drafter, policy, prompts, params=GREEDY, max_new_tokens=20):
    engine = SpeculativeEngine(runtime, drafter, num_speculative_tokens=4, policy=policy)
    engine.sps_profile = PROFILE
    return engine.generate([GenerationRequest(f"r{i}", p, max_new_tokens, params) for i, p in enumerate(prompts)])


@pytest.mark.parametrize("spec", ["none", "fixed:1", "fixed:3", "threshold:0.3", "dspark", "dspark-async"])
def test_greedy_output_is_plain_decoding_whatever_the_policy(tiny_runtime_factory, spec):
    runtime = tiny_runtime_factory(capture_layers=(1, 3))
    plain = run(runtime, None, None, PROMPTS)
    spec_states = run(runtime, make_serving_drafter(runtime), parse_policy(spec), PROMPTS)
    for a, b in zip(plain, spec_states):
        assert a.output_ids == b.output_ids
    drafted, accepted = sum(s.draft_tokens for s in spec_states), sum(s.accepted_tokens for s in spec_states)
    if spec == "none":
        assert drafted == 0
    else:  # drafts were verified and some accepted: an engine that never speculates fails here
        assert drafted > 0 and accepted > 0
    assert runtime.kv.reserved_tokens == 0


def test_policies_change_how_many_drafts_are_verified(tiny_runtime_factory):
    runtime = tiny_runtime_factory(capture_layers=(1, 3))
    drafted = {}
    for spec in ["none", "fixed:1", "fixed:4"]:
        states = run(runtime, make_serving_drafter(runtime), parse_policy(spec), PROMPTS)
        drafted[spec] = sum(s.draft_tokens for s in states) / sum(s.rounds for s in states)
    # (the last round of a request may have fewer drafts: it must not pass max_new_tokens)
    assert drafted["none"] == 0 and 0.8 < drafted["fixed:1"] <= 1 and drafted["fixed:4"] > 2


@pytest.mark.parametrize("spec, most", [("none", 0), ("fixed:1", 1), ("fixed:3", 3), ("dspark", 4)])
def test_the_drafter_is_asked_for_no_more_drafts_than_the_policy_can_verify(tiny_runtime_factory, spec, most):
    """fixed:1 (MTP-1) must not pay for drafting γ positions it never verifies."""
    runtime = tiny_runtime_factory(capture_layers=(1, 3))
    drafter = make_serving_drafter(runtime)
    asked = []
    propose = drafter.propose
    drafter.propose = lambda reqs: asked.extend(r.max_draft_tokens for r in reqs) or propose(reqs)
    states = run(runtime, drafter, parse_policy(spec), PROMPTS)
    assert max(asked, default=0) == most
    plain = run(runtime, None, None, PROMPTS)
    assert [s.output_ids for s in states] == [s.output_ids for s in plain]


def test_the_dspark_policy_needs_an_sps_profile(tiny_runtime_factory):
    runtime = tiny_runtime_factory(capture_layers=(1, 3))
    engine = SpeculativeEngine(runtime, make_serving_drafter(runtime), num_speculative_tokens=4, policy=parse_policy("dspark"))
    engine.add_request(GenerationRequest("a", [5, 6, 7], 10, GREEDY))
    engine.step()  # prefill: no drafts yet
    with pytest.raises(ValueError, match="SPS"):
        engine.step()


def test_sampled_tokens_keep_the_target_distribution_under_algorithm_1(tiny_runtime_factory):
    runtime = tiny_runtime_factory(**SMALL_VOCAB_RUNTIME)
    prompt, num_samples, num_tokens = [3, 1, 4, 1, 5], 3000, 3
    exact = exact_sequence_probs(runtime, prompt, num_tokens)
    drafter = make_serving_drafter(runtime, seed=2, block_size=2)
    engine = SpeculativeEngine(runtime, drafter, num_speculative_tokens=2, policy=parse_policy("dspark"))
    # All samples run as one batch of 3000 requests: a step time that grows slowly with B makes
    # Algorithm 1 admit only drafts with a high survival probability (about a > 0.2 here).
    engine.sps_profile = SPSProfile(batch_sizes=[1, 10_000], step_seconds=[0.010, 0.020])
    states = engine.generate([
        GenerationRequest(f"s{i}", prompt, num_tokens + 1, SamplingParams(temperature=1.0, seed=i)) for i in range(num_samples)
    ])
    drafted = sum(s.draft_tokens for s in states)
    assert 0 < drafted < 2 * sum(s.rounds for s in states)  # Algorithm 1 admitted some drafts, not all
    samples = Counter(tuple(s.output_ids[:num_tokens]) for s in states)
    assert chi_square_pvalue(samples, exact, num_samples) > 1e-3


class VerifiesOnlyWhenTheSecondConfidenceIsHigh:
    """A wrong policy: dspark-async, except that a request's drafts are verified only when c_2 is
    above the round's median. c_2 depends on x_1, so whether x_1 is verified depends on x_1 itself
    (dspark-async's own choice of draft k depends only on c_1..c_k, i.e. on x_1..x_{k-1})."""

    spec, needs_confidences, needs_sps_profile, max_drafts, gates_drafting, skips_unpayable_rounds = "peeking", True, True, None, False, False

    def __init__(self):
        self.inner = parse_policy("dspark-async")

    def draft_lengths(self, *, request_ids, num_drafts, confidences=None, sps_table=None, prefill_tokens=0, prefill_emitted=0):
        ell = self.inner.draft_lengths(request_ids=request_ids, num_drafts=num_drafts, confidences=confidences,
                                       sps_table=sps_table, prefill_tokens=prefill_tokens, prefill_emitted=prefill_emitted)
        c = np.asarray(confidences)  # [R, γ]
        return np.where(c[:, 1] < np.median(c[:, 1]), 0, ell) if c.shape[1] >= 2 else ell

    def remove_request(self, request_id):
        self.inner.remove_request(request_id)


def dspark_async_pvalue(runtime, policy, *, num_samples: int = 3000) -> float:
    """Chi-square p-value of 3-token continuations sampled at temperature 1 under `policy`, after a
    warm-up: dspark-async sizes a round from confidences two rounds old, so an engine's first two
    rounds admit no drafts; the warm-up's rounds give the new requests a population row to borrow."""
    prompt, num_tokens = [3, 1, 4, 1, 5], 3
    exact = exact_sequence_probs(runtime, prompt, num_tokens)
    engine = SpeculativeEngine(runtime, make_serving_drafter(runtime, seed=2, block_size=2), num_speculative_tokens=2,
                               policy=policy)
    engine.sps_profile = SPSProfile(batch_sizes=[1, 10_000], step_seconds=[0.010, 0.020])  # admits some drafts, not all
    engine.generate([GenerationRequest(f"warm{i}", prompt, 6, SamplingParams(temperature=1.0, seed=10**6 + i)) for i in range(8)])
    rounds_before = engine.counters.decode_request_rounds
    samples, drafted, accepted = sample_continuations(engine, prompt, num_samples=num_samples, num_tokens=num_tokens)
    decode_rounds = engine.counters.decode_request_rounds - rounds_before
    assert num_samples <= drafted < 2 * decode_rounds  # the policy admitted drafts, but not every one
    assert 0.05 * drafted < accepted < 0.95 * drafted
    return losslessness_pvalue(samples, exact, num_samples)


def test_sampled_tokens_keep_the_target_distribution_under_dspark_async(tiny_runtime_factory):
    runtime = tiny_runtime_factory(**SMALL_VOCAB_RUNTIME)
    assert dspark_async_pvalue(runtime, parse_policy("dspark-async")) > P_PASS


def test_the_same_test_rejects_a_policy_whose_choice_of_a_draft_depends_on_that_draft(tiny_runtime_factory):
    runtime = tiny_runtime_factory(**SMALL_VOCAB_RUNTIME)
    assert dspark_async_pvalue(runtime, VerifiesOnlyWhenTheSecondConfidenceIsHigh()) < P_WRONG


def test_a_policy_that_needs_confidences_refuses_a_drafter_without_them(tiny_runtime):
    from dspark.drafters.ngram import NgramDrafter

    with pytest.raises(ValueError, match="confidences"):
        SpeculativeEngine(tiny_runtime, NgramDrafter(), policy=parse_policy("dspark"))


def test_prefills_riding_in_a_round_are_counted_in_the_policys_batch(tiny_runtime_factory):
    """A request that joins while another decodes is prefilled in the same forward: the policy
    is told its tokens (they count in B) and that it emits one token (it counts in τ*)."""
    seen = []

    class Recording:
        spec, needs_confidences, needs_sps_profile, max_drafts, gates_drafting, skips_unpayable_rounds = "recording", True, True, None, False, False

        def draft_lengths(self, *, request_ids, num_drafts, confidences=None, sps_table=None, prefill_tokens=0, prefill_emitted=0):
            seen.append((list(request_ids), prefill_tokens, prefill_emitted, len(sps_table)))
            return parse_policy("dspark").draft_lengths(
                request_ids=request_ids, num_drafts=num_drafts, confidences=confidences, sps_table=sps_table,
                prefill_tokens=prefill_tokens, prefill_emitted=prefill_emitted)

        def remove_request(self, request_id):
            pass

    runtime = tiny_runtime_factory(capture_layers=(1, 3))
    engine = SpeculativeEngine(runtime, make_serving_drafter(runtime), num_speculative_tokens=4, policy=Recording())
    engine.sps_profile = PROFILE
    engine.add_request(GenerationRequest("a", [5, 6, 7], 10, GREEDY))
    engine.step()  # a's prefill: nothing decodes yet, the policy is not asked
    engine.add_request(GenerationRequest("b", list(range(40, 52)), 10, GREEDY))
    engine.step()  # a decodes while b's 12 prompt tokens are prefilled in the same forward
    engine.step()  # both decode
    assert seen[0][:3] == (["a"], 12, 1) and seen[0][3] >= 12 + 1 * (1 + 4)  # the table covers B with every draft
    assert seen[1][:3] == (["a", "b"], 0, 0)
