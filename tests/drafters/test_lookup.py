"""Lookup proposals beside the DSpark drafter (dspark/drafters/lookup.py).

Specification: where the context repeats itself the block is the lookup continuation (point
masses, online confidences) and the model drafter is not run for that request; elsewhere it is
the model drafter's block, or where the drafter has a datastore of the target's answers and
expects more of it, its chain; acceptance is learnt from the tokens emitted after every lookup
and chain found, proposed or outbid, up to the first mismatch; greedy output equals plain decoding
and sampled output has exactly the target's distribution (chi-square) with lookups firing, under
every draft-length policy.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dspark.drafters import make_drafter
from dspark.drafters.base import DraftRequest
from dspark.drafters.datastore import NgramDatastore
from dspark.drafters.lookup import (
    ALL_RIGHT,
    GREEDY_REGIME,
    MISSED,
    NO_HISTORY,
    PARTLY,
    LookupAcceptance,
    LookupDrafter,
    expected_accepted,
    history_bucket,
    longest_match,
    share_bin,
)
from dspark.engine.speculative import GenerationRequest, SpeculativeEngine
from dspark.profiling.sps import SPSProfile
from dspark.scheduling.policies import parse_policy
from tests.conftest import SMALL_VOCAB_RUNTIME
from tests.drafters.engine_checks import GREEDY, assert_sampling_is_lossless, totals
from tests.drafters.test_dspark_serving import make_serving_drafter


def test_the_longest_repeated_suffix_gives_the_continuation():
    tokens = np.array([7, 1, 2, 3, 9, 5, 2, 3, 8, 1, 2, 3])
    # suffix (1, 2, 3) occurred at 1..3 and was followed by 9 5 2; (2, 3) alone would give 8 1 2
    assert longest_match(tokens, min_n=2, max_n=4, k=3) == (3, [9, 5, 2])
    assert longest_match(tokens, min_n=2, max_n=2, k=3) == (2, [8, 1, 2])
    assert longest_match(np.array([1, 2, 3, 4]), min_n=1, max_n=4, k=3) == (0, [])


def test_acceptance_is_counted_up_to_the_first_mismatch():
    acc = LookupAcceptance(max_n=4, block_size=4, prior_hits=0.0, prior_misses=0.0)
    # accepted 5 6, rejected at 7: 8 was never tried
    assert acc.record(2, NO_HISTORY, [5, 6, 7, 8], [5, 6, 9, 8, 1]) == 2
    assert acc.record(2, NO_HISTORY, [5, 6], [5]) == 1  # the next round emitted one token so far: censored after it
    assert acc.tries[2, NO_HISTORY].tolist() == [2, 1, 1, 0] and acc.hits[2, NO_HISTORY].tolist() == [2, 1, 0, 0]
    np.testing.assert_allclose(acc.confidences(2, NO_HISTORY, 3), [1.0, 1.0, 0.0])
    assert acc.tries[2, ALL_RIGHT].sum() == 0  # another history bucket is another estimate
    assert expected_accepted(np.array([1.0, 0.5, 0.0])) == 1.5


def test_the_history_bucket_says_how_the_last_lookup_fared():
    assert [history_bucket(m, 4) for m in (0, 2, 4)] == [MISSED, PARTLY, ALL_RIGHT]


def test_a_datastore_draft_is_calibrated_per_share_and_per_how_often_its_suffix_was_seen():
    assert share_bin(1.0, 1) != share_bin(1.0, 20)  # seen once is weaker evidence than seen 20 times
    assert share_bin(0.95, 5) == share_bin(0.91, 19) != share_bin(0.85, 19)  # same bucket, same share bin
    assert len({share_bin(s / 10, t) for s in range(10) for t in (1, 2, 5, 20)}) == 40


def test_an_unseen_cell_starts_from_the_prior():
    acc = LookupAcceptance(max_n=4, block_size=3)
    np.testing.assert_allclose(acc.confidences(3, ALL_RIGHT, 3), [1 / 3] * 3)


def test_a_request_whose_lookup_was_all_right_is_scored_in_that_bucket_next(tiny_runtime_factory):
    runtime = tiny_runtime_factory(capture_layers=(1, 3))
    drafter = LookupDrafter(make_serving_drafter(runtime))
    toks = [3, 4, 5, 6, 7, 3, 4]
    drafter.observe("a", torch.zeros(len(toks) - 1, 2, runtime.config.hidden_size))
    (p,) = drafter.propose([_request("a", toks)])  # proposes 5 6 7 3
    toks = toks + p.token_ids.tolist() + [4]  # all four accepted, bonus 4
    drafter.observe("a", torch.zeros(5, 2, runtime.config.hidden_size))
    drafter.propose([_request("a", toks)])
    assert drafter.acceptance.hits[2, NO_HISTORY].tolist() == [1, 1, 1, 1]  # the first lookup matched (3, 4)
    assert drafter._pending["a"].history == ALL_RIGHT


def _request(rid, tokens, k=4):
    return DraftRequest(rid, tokens, 2, GREEDY, k, torch.Generator().manual_seed(0))


def test_a_repeating_context_gets_the_lookup_block_and_the_model_is_not_run(tiny_runtime_factory):
    runtime = tiny_runtime_factory(capture_layers=(1, 3))
    drafter = LookupDrafter(make_serving_drafter(runtime))
    asked = []
    model_propose = drafter.model.propose
    drafter.model.propose = lambda reqs: asked.append([r.request_id for r in reqs]) or model_propose(reqs)
    gen = torch.Generator().manual_seed(0)
    repeating, fresh = [3, 4, 5, 6, 7, 3, 4], [10, 11, 12, 13, 14, 15, 16]
    for rid, toks in [("rep", repeating), ("new", fresh)]:
        drafter.observe(rid, torch.randn(len(toks) - 1, 2, runtime.config.hidden_size, generator=gen))
    rep, new = drafter.propose([_request("rep", repeating), _request("new", fresh)])
    assert rep.token_ids.tolist() == [5, 6, 7, 3] and rep.probs.flatten().tolist() == [1.0] * 4
    torch.testing.assert_close(rep.confidences, torch.tensor([1 / 3] * 4))
    assert asked == [["new"]] and len(new) == 4 and new.confidences is not None
    assert drafter.lookup_proposals == 1 and drafter.model_proposals == 1


def test_a_lookup_weaker_than_the_model_gives_way_to_the_model(tiny_runtime_factory):
    runtime = tiny_runtime_factory(capture_layers=(1, 3))
    drafter = LookupDrafter(make_serving_drafter(runtime))
    drafter.model_expected = 3.0  # the model's blocks have been accepted for 3 tokens on average
    toks = [3, 4, 5, 6, 7, 3, 4]
    drafter.observe("a", torch.zeros(len(toks) - 1, 2, runtime.config.hidden_size))
    (p,) = drafter.propose([_request("a", toks)])
    assert drafter.lookup_proposals == 0 and drafter.model_proposals == 1 and len(p) == 4


def test_a_lookup_the_model_outbid_is_still_scored_by_the_tokens_that_followed(tiny_runtime_factory):
    # the emitted tokens have the target's distribution whatever was proposed, so they score the
    # unproposed lookup too; otherwise an estimate that starts below the model's never learns
    runtime = tiny_runtime_factory(capture_layers=(1, 3))
    drafter = LookupDrafter(make_serving_drafter(runtime))
    drafter.model_expected = 3.0
    toks = [3, 4, 5, 6, 7, 3, 4]  # the lookup would propose 5 6 7 3
    drafter.observe("a", torch.zeros(len(toks) - 1, 2, runtime.config.hidden_size))
    (p,) = drafter.propose([_request("a", toks)])
    assert drafter.lookup_proposals == 0 and drafter.model_proposals == 1
    toks = toks + [5, 6, 9]  # the round emitted 5 6 9 (from the model's block or the target)
    drafter.observe("a", torch.zeros(3, 2, runtime.config.hidden_size))
    drafter.propose([_request("a", toks)])
    assert drafter.acceptance.tries[2, NO_HISTORY].tolist() == [1, 1, 1, 0]
    assert drafter.acceptance.hits[2, NO_HISTORY].tolist() == [1, 1, 0, 0]
    assert drafter._history["a"] == PARTLY


def test_where_the_context_does_not_repeat_the_datastore_chain_is_proposed_and_scored(tiny_runtime_factory):
    runtime = tiny_runtime_factory(capture_layers=(1, 3))
    store = NgramDatastore.build([[10, 11, 12, 13, 14, 15], [11, 12, 30]], vocab_size=runtime.config.vocab_size, min_n=2, max_n=3)
    drafter = LookupDrafter(make_serving_drafter(runtime), datastore=store)
    drafter.model_expected = 0.1  # below the chain's prior estimate
    toks = [20, 21, 10, 11, 12]  # no repeated suffix; the store continues (10, 11, 12) with 13 14 15
    drafter.observe("a", torch.zeros(len(toks) - 1, 2, runtime.config.hidden_size))
    (p,) = drafter.propose([_request("a", toks)])
    assert p.token_ids.tolist() == [13, 14, 15] and p.free and p.probs.flatten().tolist() == [1.0] * 3
    assert drafter.datastore_proposals == drafter.lookup_proposals == 1 and drafter.model_proposals == 0
    drafter.observe("a", torch.zeros(2, 2, runtime.config.hidden_size))
    drafter.propose([_request("a", toks + [13, 9])])  # the round emitted 13, then 9
    assert drafter.share_acceptance.tries[GREEDY_REGIME, share_bin(1.0)] == 2
    assert drafter.share_acceptance.hits[GREEDY_REGIME, share_bin(1.0)] == 1


def test_the_model_gets_the_round_when_it_expects_more_than_the_datastore(tiny_runtime_factory):
    runtime = tiny_runtime_factory(capture_layers=(1, 3))
    store = NgramDatastore.build([[10, 11, 12, 13, 14, 15]], vocab_size=runtime.config.vocab_size)
    drafter = LookupDrafter(make_serving_drafter(runtime), datastore=store)
    drafter.model_expected = 3.0
    toks = [20, 21, 10, 11]
    drafter.observe("a", torch.zeros(len(toks) - 1, 2, runtime.config.hidden_size))
    (p,) = drafter.propose([_request("a", toks)])
    assert not p.free and len(p) == 4 and drafter.model_proposals == 1 and drafter.datastore_proposals == 0
    assert drafter._pending_chain["a"].tokens == [12, 13, 14, 15]  # still scored next round


def test_dspark_lookup_loads_a_dspark_checkpoint_by_name(tiny_runtime_factory, tmp_path):
    from dspark.drafters import drafter_capture_layers
    from dspark.drafters.dspark.checkpoint import save_checkpoint

    runtime = tiny_runtime_factory(capture_layers=(1, 3))
    save_checkpoint(tmp_path / "ckpt", drafter=make_serving_drafter(runtime).model)
    drafter = make_drafter("dspark-lookup", runtime=runtime, path=tmp_path / "ckpt")
    assert isinstance(drafter, LookupDrafter) and drafter.spec.name == "dspark-lookup" and drafter.model.spec.name == "dspark"
    assert drafter_capture_layers("dspark-lookup", tmp_path / "ckpt") == (1, 3) == drafter.spec.capture_layers
    with pytest.raises(ValueError, match="unknown drafter"):
        make_drafter("ngram-lookup")


# ---- inside the engine -------------------------------------------------------------------

REPEATING_PROMPTS = [[5, 6, 7, 5, 6, 7, 5, 6], [1, 2, 3, 1, 2, 3, 1, 2], list(range(40, 70))]
PROFILE = SPSProfile(batch_sizes=[1, 4, 8, 16, 64], step_seconds=[0.010, 0.011, 0.013, 0.020, 0.080])


@pytest.mark.parametrize("spec", ["all", "fixed:2", "dspark"])
def test_greedy_output_with_lookups_equals_plain_decoding(tiny_runtime_factory, spec):
    runtime = tiny_runtime_factory(capture_layers=(1, 3))
    drafter = LookupDrafter(make_serving_drafter(runtime), min_n=1)
    policy = None if spec == "all" else parse_policy(spec)

    def generate(d, p):
        engine = SpeculativeEngine(runtime, d, num_speculative_tokens=4, policy=p)
        engine.sps_profile = PROFILE
        return engine.generate([GenerationRequest(f"r{i}", q, 24, GREEDY) for i, q in enumerate(REPEATING_PROMPTS)])

    plain, spec_states = generate(None, None), generate(drafter, policy)
    assert [s.output_ids for s in spec_states] == [s.output_ids for s in plain]
    drafted, accepted = totals(spec_states)
    assert drafted > 0 and accepted > 0 and drafter.lookup_proposals > 0 and drafter.model_proposals > 0
    assert runtime.kv.reserved_tokens == 0

    # with a datastore of the target's own answers (half of them, so that chains also go wrong)
    store = NgramDatastore.build([s.output_ids[:12] for s in plain], vocab_size=runtime.config.vocab_size, min_n=1, max_n=3)
    with_store = LookupDrafter(make_serving_drafter(runtime), min_n=2, datastore=store)
    assert [s.output_ids for s in generate(with_store, policy)] == [s.output_ids for s in plain]
    assert with_store.datastore_proposals > 0


def test_sampled_tokens_with_lookups_have_exactly_the_target_distribution(tiny_runtime_factory):
    runtime = tiny_runtime_factory(**SMALL_VOCAB_RUNTIME)
    drafter = LookupDrafter(make_serving_drafter(runtime, seed=2, block_size=2), min_n=1)
    # the prompt repeats (3, 1): the first round's block is a lookup, later ones either kind
    assert_sampling_is_lossless(runtime, drafter, num_samples=3000, prompt=(3, 1, 4, 1, 5, 3, 1))
    assert drafter.lookup_proposals > 1000 and drafter.model_proposals > 0


def test_sampled_tokens_with_datastore_chains_have_exactly_the_target_distribution(tiny_runtime_factory):
    runtime = tiny_runtime_factory(**SMALL_VOCAB_RUNTIME)
    rng = np.random.default_rng(3)
    store = NgramDatastore.build([rng.integers(0, 8, size=40).tolist() for _ in range(20)], vocab_size=8, min_n=1, max_n=2)
    drafter = LookupDrafter(make_serving_drafter(runtime, seed=2, block_size=2), min_n=3, datastore=store)
    drafter.model_expected = -1.0  # never updated below the chains: every round proposes one
    drafter.smoothing = 0.0
    assert_sampling_is_lossless(runtime, drafter, num_samples=3000, prompt=(3, 1, 4, 1, 5, 2, 6))
    assert drafter.datastore_proposals > 1000


def test_rounds_the_draft_gate_skips_still_get_lookups_and_never_the_model(tiny_runtime_factory):
    from dspark.scheduling.draft_gate import DraftGate

    runtime = tiny_runtime_factory(capture_layers=(1, 3))
    drafter = LookupDrafter(make_serving_drafter(runtime), min_n=1)
    engine = SpeculativeEngine(runtime, drafter, num_speculative_tokens=4, policy=parse_policy("dspark"))
    engine.sps_profile = PROFILE
    # drafting "costs" 10 s a request: after the first drafted round the gate skips the model
    engine.draft_gate = DraftGate(draft_s_per_request=10.0, probe_every=1000, max_probe_every=1000)
    states = engine.generate([GenerationRequest(f"r{i}", q, 24, GREEDY) for i, q in enumerate(REPEATING_PROMPTS)])
    plain = SpeculativeEngine(runtime, None).generate(
        [GenerationRequest(f"p{i}", q, 24, GREEDY) for i, q in enumerate(REPEATING_PROMPTS)])
    assert [s.output_ids for s in states] == [s.output_ids for s in plain]
    assert engine.counters.rounds_without_drafting > 3
    assert drafter.model_proposals <= len(REPEATING_PROMPTS)  # the first drafted round only
    assert drafter.lookup_proposals > engine.counters.rounds_without_drafting  # lookups on the skipped rounds
    drafted, accepted = totals(states)
    assert drafted > 0 and accepted > 0


def test_the_draft_gate_learns_from_the_models_proposals_only(tiny_runtime_factory):
    """A lookup costs no model forward: the gate, which decides whether the MODEL drafts, records
    per round only the requests the model drafted for (none: no record), so cheap, well-accepted
    lookups cannot talk it into running a model that does not pay."""
    from dspark.scheduling.draft_gate import DraftGate

    class RecordingGate(DraftGate):
        def record(self, *, num_requests, draft_seconds, verified, accepted):
            calls.append(num_requests)
            super().record(num_requests=num_requests, draft_seconds=draft_seconds, verified=verified, accepted=accepted)

    runtime = tiny_runtime_factory(capture_layers=(1, 3))
    drafter = LookupDrafter(make_serving_drafter(runtime), min_n=1)
    engine = SpeculativeEngine(runtime, drafter, num_speculative_tokens=4, policy=parse_policy("dspark"))
    engine.sps_profile = PROFILE
    engine.draft_gate = RecordingGate(draft_s_per_request=0.001, probe_every=2)  # a fixed price: no timing noise
    prompts = [*REPEATING_PROMPTS, list(range(40, 60))]  # repetitive ones get lookups, the last one the model
    for i, q in enumerate(prompts):
        engine.add_request(GenerationRequest(f"r{i}", q, 24, GREEDY))
    per_round = []
    while engine.has_unfinished:
        calls, before = [], drafter.model_proposals
        engine.step()
        per_round.append((drafter.model_proposals - before, calls))
    assert all(calls == ([n] if n else []) for n, calls in per_round), per_round
    assert drafter.lookup_proposals > 0 and any(n for n, _ in per_round)  # both kinds happened
