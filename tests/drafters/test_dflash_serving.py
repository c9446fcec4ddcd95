"""The DFlash drafter inside the speculative engine (tiny random target and drafter).

Specification: the rows a proposal carries are exactly the distributions its tokens were drawn
from; greedy output equals plain decoding; sampled output has exactly the target's
distribution; the drafter is built by name from a checkpoint (`make_drafter("dflash", ...)`,
`--drafter dflash`) and reads the layers the runtime captures; it offers no confidences.
"""

from __future__ import annotations

import pytest
import torch

from dspark.drafters import drafter_capture_layers, make_drafter
from dspark.drafters.base import DraftRequest
from dspark.drafters.dflash import DFlashConfig, DFlashDrafter, save_checkpoint
from dspark.drafters.dflash.serving import DFlashServingDrafter
from dspark.drafters.dspark.model import BlockBatch, DraftBlock
from dspark.drafters.shared import SharedWeights
from dspark.engine.speculative import SpeculativeEngine
from dspark.sampling.categorical import sample_categorical
from dspark.sampling.params import SamplingParams, logits_to_probs
from dspark.scheduling.policies import parse_policy
from tests.conftest import SMALL_VOCAB_RUNTIME
from tests.drafters.engine_checks import (
    GREEDY,
    assert_sampling_is_lossless,
    greedy_plain_and_speculative,
    steps_of_one_request,
    totals,
)


def make_serving_drafter(runtime, *, seed: int = 0, top_k: int = 0, block_size: int = 4, **overrides) -> DFlashServingDrafter:
    torch.manual_seed(seed)
    config = DFlashConfig.from_target(runtime.config, block_size=block_size, num_layers=1, target_layer_ids=runtime.capture_layers,
                                      **overrides)
    return DFlashServingDrafter(DFlashDrafter(config, shared=SharedWeights.from_target(runtime.model)), top_k=top_k)


def observed_drafter(runtime, *, seed: int = 0, top_k: int = 0):
    """A drafter that has observed 9 random verified positions of request "a" (anchor at 9)."""
    drafter = make_serving_drafter(runtime, seed=seed, top_k=top_k)
    features = torch.randn(9, 2, runtime.config.hidden_size, generator=torch.Generator().manual_seed(seed))
    drafter.observe("a", features[:4])
    drafter.observe("a", features[4:])
    return drafter, features


def test_proposed_rows_are_exactly_the_distributions_the_tokens_were_drawn_from(tiny_runtime_factory):
    runtime = tiny_runtime_factory(capture_layers=(1, 3), compute_dtype=torch.float32)
    drafter, features = observed_drafter(runtime)
    tokens = list(range(3, 13))  # anchor x_0 = 12 at position 9
    params = SamplingParams(temperature=0.7)
    (proposal,) = drafter.propose([DraftRequest("a", tokens, 2, params, 4, torch.Generator().manual_seed(5))])
    assert proposal.dense_probs is not None and proposal.confidences is None
    # the rows: softmax(U_k / T) of the masks' logits, recomputed from the raw features
    logits = drafter.model(BlockBatch.from_blocks([DraftBlock(features, 9, 12)]))[0, 0]  # [γ, V]
    torch.testing.assert_close(proposal.dense_probs, logits_to_probs(logits, temperature=0.7), atol=1e-5, rtol=1e-5)
    # the tokens: one independent draw per row, replayed bit for bit from the returned rows
    replay = sample_categorical(proposal.dense_probs, torch.Generator().manual_seed(5))
    assert torch.equal(proposal.token_ids, replay)


def test_greedy_and_truncated_proposals_carry_point_masses_and_sparse_rows(tiny_runtime_factory):
    runtime = tiny_runtime_factory(capture_layers=(1, 3), compute_dtype=torch.float32)
    drafter, features = observed_drafter(runtime, top_k=3)
    logits = drafter.model(BlockBatch.from_blocks([DraftBlock(features, 9, 12)]))[0, 0]  # [γ, V]
    tokens = list(range(3, 13))
    greedy, sampled = drafter.propose([
        DraftRequest("a", tokens, 2, GREEDY, 3, torch.Generator()),
        DraftRequest("a", tokens, 2, SamplingParams(temperature=1.0), 4, torch.Generator().manual_seed(1)),
    ])
    assert greedy.token_ids.tolist() == logits[:3].argmax(-1).tolist()  # at most max_draft_tokens
    assert greedy.probs.tolist() == [[1.0]] * 3
    top3 = logits.topk(3, dim=-1).indices  # [γ, 3]
    assert sampled.prob_ids.shape == (4, 3) and torch.equal(sampled.prob_ids.sort(-1).values, top3.sort(-1).values)
    assert all(t in row for t, row in zip(sampled.token_ids.tolist(), sampled.prob_ids.tolist()))
    torch.testing.assert_close(sampled.probs.sum(-1), torch.ones(4))


def test_greedy_output_with_the_dflash_drafter_equals_plain_decoding(tiny_runtime_factory):
    runtime = tiny_runtime_factory(vocab_size=8, capture_layers=(1, 3))  # a small vocabulary: some drafts get accepted
    # An untrained DFlash drafter mostly predicts its mask token (the masks' residual streams start at
    # its embedding); this tiny target keeps repeating token 5, so 5 as the mask row gets drafts accepted.
    drafter = make_serving_drafter(runtime, mask_token_id=5)
    plain, spec = greedy_plain_and_speculative(runtime, drafter, [[5, 6, 7, 1, 2], [1, 2, 3, 1, 2, 3, 1, 2], [4, 0, 3] * 8])
    assert [s.output_ids for s in spec] == [s.output_ids for s in plain]
    drafted, accepted = totals(spec)
    assert drafted > 0 and accepted > 0  # drafts were made and some verified: not vacuous
    assert runtime.kv.reserved_tokens == 0


def test_sampled_tokens_have_exactly_the_target_distribution(tiny_runtime_factory):
    runtime = tiny_runtime_factory(**SMALL_VOCAB_RUNTIME)
    assert_sampling_is_lossless(runtime, make_serving_drafter(runtime, seed=2, block_size=2), num_samples=2000)


def test_the_context_cache_covers_exactly_the_verified_positions(tiny_runtime_factory):
    runtime = tiny_runtime_factory(capture_layers=(1, 3))
    drafter = make_serving_drafter(runtime)
    for state in steps_of_one_request(runtime, drafter):
        assert drafter.context_len("a") == runtime.context_len("a") == len(state.all_token_ids) - 1
    assert drafter.context_len("a") == 0  # aborted: its cache is freed


def test_make_drafter_builds_it_from_a_checkpoint_and_it_offers_no_confidences(tiny_runtime_factory, tmp_path):
    runtime = tiny_runtime_factory(capture_layers=(1, 3))
    save_checkpoint(tmp_path / "dflash", drafter=make_serving_drafter(runtime, seed=4).model)
    assert drafter_capture_layers("dflash", tmp_path / "dflash") == (1, 3)
    drafter = make_drafter("dflash", runtime=runtime, path=tmp_path / "dflash")
    assert isinstance(drafter, DFlashServingDrafter) and drafter.spec.name == "dflash"
    assert drafter.spec.needs_hidden_states and not drafter.spec.provides_confidences
    with pytest.raises(ValueError, match="needs calibrated confidences"):
        SpeculativeEngine(runtime, drafter, policy=parse_policy("dspark"))
    with pytest.raises(ValueError, match="holds a 'dflash' drafter checkpoint; use --drafter dflash"):
        make_drafter("dspark", runtime=runtime, path=tmp_path / "dflash")
    with pytest.raises(ValueError, match="needs a checkpoint directory"):
        make_drafter("dflash", runtime=runtime)


def test_the_drafter_must_read_the_layers_the_runtime_captures(tiny_runtime_factory):
    drafter = make_serving_drafter(tiny_runtime_factory(capture_layers=(0, 2)))
    with pytest.raises(ValueError, match="capture_layers"):
        SpeculativeEngine(tiny_runtime_factory(capture_layers=(1, 3)), drafter)
