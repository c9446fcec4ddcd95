"""The EAGLE-3 drafter inside the speculative engine (tiny random target and drafter).

Specification: serving drafts token by token exactly what the training-time-test unroll
computes (the rows returned are the distributions drawn from); its KV cache, caught up round
by round, gives the same drafts as recomputing every entry, alone or batched with other
requests; greedy output equals plain decoding; sampled output has exactly the target's
distribution; it is built by name from a checkpoint (`make_drafter("eagle3", ...)`).
"""

from __future__ import annotations

import pytest
import torch

from dspark.drafters import drafter_capture_layers, make_drafter
from dspark.drafters.base import DraftRequest
from dspark.drafters.dspark.model import BlockBatch
from dspark.drafters.eagle3 import Eagle3Config, Eagle3Drafter, save_checkpoint
from dspark.drafters.eagle3.serving import Eagle3ServingDrafter
from dspark.drafters.shared import SharedWeights
from dspark.engine.speculative import SpeculativeEngine
from dspark.sampling.categorical import sample_categorical
from dspark.sampling.params import SamplingParams, logits_to_probs
from tests.conftest import SMALL_VOCAB_RUNTIME
from tests.drafters.engine_checks import (
    GREEDY,
    assert_sampling_is_lossless,
    greedy_plain_and_speculative,
    steps_of_one_request,
    totals,
)


def make_serving_drafter(runtime, *, seed: int = 0, top_k: int = 0, block_size: int = 4) -> Eagle3ServingDrafter:
    torch.manual_seed(seed)
    config = Eagle3Config.from_target(runtime.config, block_size=block_size, target_layer_ids=runtime.capture_layers)
    return Eagle3ServingDrafter(Eagle3Drafter(config, shared=SharedWeights.from_target(runtime.model)), top_k=top_k)


def random_request_state(runtime, *, length: int, seed: int):
    """Captured features [length, m, hidden] of verified positions 0..length-1 and tokens 0..length."""
    g = torch.Generator().manual_seed(seed)
    features = torch.randn(length, len(runtime.capture_layers), runtime.config.hidden_size, generator=g)
    tokens = torch.randint(0, runtime.config.vocab_size, (length + 1,), generator=g).tolist()
    return features, tokens


def ttt_logits(model: Eagle3Drafter, features, tokens, drafted) -> torch.Tensor:
    """The training unroll's logits [γ, V] for the anchor tokens[-1], teacher-forced with `drafted`."""
    t = len(tokens) - 1
    batch = BlockBatch.from_sequences(contexts=[features], anchor_positions=[torch.tensor([t])], anchor_tokens=[torch.tensor([tokens[-1]])])
    teacher = torch.tensor(drafted + [0] * (model.config.block_size - len(drafted))).view(1, 1, -1)
    out = model(batch, context_token_ids=torch.tensor(tokens).unsqueeze(0), target_tokens=teacher)
    return out.logits[0, 0]


def test_serving_draws_each_token_from_the_unrolls_distribution_and_returns_those_rows(tiny_runtime_factory):
    runtime = tiny_runtime_factory(capture_layers=(1, 3), compute_dtype=torch.float32)
    drafter = make_serving_drafter(runtime, seed=1)
    features, tokens = random_request_state(runtime, length=9, seed=2)
    drafter.observe("a", features[:5])
    drafter.observe("a", features[5:])
    (proposal,) = drafter.propose([DraftRequest("a", tokens, 2, SamplingParams(temperature=0.8), 4, torch.Generator().manual_seed(7))])
    assert proposal.dense_probs is not None and proposal.confidences is None and len(proposal) == 4
    expected = logits_to_probs(ttt_logits(drafter.model, features, tokens, proposal.token_ids.tolist()), temperature=0.8)
    torch.testing.assert_close(proposal.dense_probs, expected, atol=1e-5, rtol=1e-5)
    replay = torch.Generator().manual_seed(7)  # one draw per step, in order, from the returned rows
    drawn = [int(sample_categorical(proposal.dense_probs[k : k + 1], replay)) for k in range(4)]
    assert proposal.token_ids.tolist() == drawn


def test_greedy_drafts_are_the_argmax_chain_of_the_unroll(tiny_runtime_factory):
    runtime = tiny_runtime_factory(capture_layers=(1, 3), compute_dtype=torch.float32)
    drafter = make_serving_drafter(runtime, seed=3)
    features, tokens = random_request_state(runtime, length=6, seed=4)
    drafter.observe("a", features)
    (proposal,) = drafter.propose([DraftRequest("a", tokens, 2, GREEDY, 3, torch.Generator())])
    drafted = proposal.token_ids.tolist()
    assert len(drafted) == 3 and proposal.probs.tolist() == [[1.0]] * 3  # max_draft_tokens, point masses
    assert ttt_logits(drafter.model, features, tokens, drafted)[:3].argmax(-1).tolist() == drafted


def test_the_kv_cache_caught_up_over_rounds_and_batching_give_the_drafts_of_a_fresh_drafter(tiny_runtime_factory):
    runtime = tiny_runtime_factory(capture_layers=(1, 3), compute_dtype=torch.float32)
    features_a, tokens_a = random_request_state(runtime, length=14, seed=5)
    features_b, tokens_b = random_request_state(runtime, length=7, seed=6)
    rounds = make_serving_drafter(runtime, seed=8)  # verifies a few tokens per round, as the engine would
    done = 0
    for verified in (4, 5, 9, 14):  # the prefill, then rounds that accepted 0, 3 and 4 drafts
        rounds.observe("a", features_a[done:verified])
        done = verified
        rounds.propose([DraftRequest("a", tokens_a[: verified + 1], 2, GREEDY, 4, torch.Generator())])
        assert rounds.num_entries("a") == verified + 1  # committed: entries 0..anchor
    rounds.observe("b", features_b)
    params = SamplingParams(temperature=1.0)
    batched = rounds.propose([DraftRequest("a", tokens_a, 2, params, 4, torch.Generator().manual_seed(1)),
                              DraftRequest("b", tokens_b, 2, params, 4, torch.Generator().manual_seed(2))])
    for rid, features, tokens, seed, proposal in [("a", features_a, tokens_a, 1, batched[0]), ("b", features_b, tokens_b, 2, batched[1])]:
        fresh = make_serving_drafter(runtime, seed=8)
        fresh.observe(rid, features)
        (alone,) = fresh.propose([DraftRequest(rid, tokens, 2, params, 4, torch.Generator().manual_seed(seed))])
        torch.testing.assert_close(proposal.dense_probs, alone.dense_probs, atol=1e-5, rtol=1e-5)
        assert proposal.token_ids.tolist() == alone.token_ids.tolist()


def test_a_request_is_refused_when_its_features_do_not_reach_the_anchor(tiny_runtime_factory):
    runtime = tiny_runtime_factory(capture_layers=(1, 3))
    drafter = make_serving_drafter(runtime)
    features, tokens = random_request_state(runtime, length=6, seed=0)
    drafter.observe("a", features[:5])
    with pytest.raises(RuntimeError, match="must observe"):
        drafter.propose([DraftRequest("a", tokens, 2, GREEDY, 4, torch.Generator())])
    assert len(drafter.propose([DraftRequest("a", tokens, 2, GREEDY, 0, torch.Generator())])[0]) == 0


def test_greedy_output_with_the_eagle3_drafter_equals_plain_decoding(tiny_runtime_factory):
    runtime = tiny_runtime_factory(vocab_size=8, capture_layers=(1, 3))  # a small vocabulary: some drafts get accepted
    drafter = make_serving_drafter(runtime, seed=8)  # an untrained drafter whose drafts this target sometimes accepts
    plain, spec = greedy_plain_and_speculative(runtime, drafter, [[5, 6, 7, 1, 2], [1, 2, 3, 1, 2, 3, 1, 2], [4, 0, 3] * 8])
    assert [s.output_ids for s in spec] == [s.output_ids for s in plain]
    drafted, accepted = totals(spec)
    assert drafted > 0 and accepted > 0  # drafts were made and some verified: not vacuous
    assert runtime.kv.reserved_tokens == 0 and not drafter._kv and not drafter._features  # finished requests are freed


def test_sampled_tokens_have_exactly_the_target_distribution(tiny_runtime_factory):
    runtime = tiny_runtime_factory(**SMALL_VOCAB_RUNTIME)
    assert_sampling_is_lossless(runtime, make_serving_drafter(runtime, seed=2, block_size=2), num_samples=2000)


def test_the_drafter_holds_features_of_exactly_the_verified_positions(tiny_runtime_factory):
    runtime = tiny_runtime_factory(capture_layers=(1, 3))
    drafter = make_serving_drafter(runtime)
    for state in steps_of_one_request(runtime, drafter):
        assert drafter.context_len("a") == runtime.context_len("a") == len(state.all_token_ids) - 1
        assert drafter.num_entries("a") <= drafter.context_len("a")  # committed entries never pass the verified tokens
    assert drafter.context_len("a") == 0 and drafter.num_entries("a") == 0  # aborted: its state is freed


def test_make_drafter_builds_it_from_a_checkpoint(tiny_runtime_factory, tmp_path):
    runtime = tiny_runtime_factory(capture_layers=(1, 3))
    save_checkpoint(tmp_path / "eagle3", drafter=make_serving_drafter(runtime, seed=4).model)
    assert drafter_capture_layers("eagle3", tmp_path / "eagle3") == (1, 3)
    drafter = make_drafter("eagle3", runtime=runtime, path=tmp_path / "eagle3")
    assert isinstance(drafter, Eagle3ServingDrafter) and drafter.spec.name == "eagle3"
    assert drafter.spec.needs_hidden_states and not drafter.spec.provides_confidences
    with pytest.raises(ValueError, match="holds a 'eagle3' drafter checkpoint; use --drafter eagle3"):
        make_drafter("dflash", runtime=runtime, path=tmp_path / "eagle3")
    with pytest.raises(ValueError, match="capture_layers"):
        SpeculativeEngine(tiny_runtime_factory(capture_layers=(0, 2)), drafter)
