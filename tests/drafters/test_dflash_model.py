"""Specification tests of the DFlash baseline drafter: config, block layout, checkpoint.

Tiny random configs (vocab 256, hidden 64, γ = 4) on the CPU. DFlash is DSpark's parallel
backbone in its original form: its block is [x_0, mask × γ] (γ + 1 inputs) and the γ masks
predict x_1..x_γ, each from its own softmax. The backbone is checked against the plain
per-block reference of the DSpark tests (written from docs/method.md §2, §3).
"""

from __future__ import annotations

import json

import pytest
import torch

from dspark.drafters.checkpoint_io import checkpoint_algo
from dspark.drafters.dflash import DFlashConfig, DFlashDrafter, load_checkpoint, save_checkpoint
from dspark.drafters.dspark import DSparkConfig, DSparkDrafter
from dspark.drafters.dspark import save_checkpoint as save_dspark_checkpoint
from dspark.drafters.dspark.model import BlockBatch, DraftBlock
from dspark.drafters.shared import SharedWeights
from dspark.model.config import ModelConfig
from tests.drafters.conftest import with_random_norms
from tests.drafters.test_dspark_model import HIDDEN, M, random_context, reference_block_hidden, sample_batch


def make_dflash(target, *, seed: int = 0, **overrides) -> DFlashDrafter:
    """A tiny DFlash drafter with random norms too (so a wrong norm would show)."""
    torch.manual_seed(seed)
    return with_random_norms(DFlashDrafter(DFlashConfig.tiny(**overrides), shared=SharedWeights.from_target(target)), seed=seed + 1)


# ---- config -------------------------------------------------------------------------------------


def test_config_round_trips_through_json_with_the_algo_field_and_copies_the_target_geometry():
    cfg = DFlashConfig.from_target(ModelConfig.tiny(num_layers=30))
    assert DFlashConfig.from_json(cfg.to_json()) == cfg
    assert json.loads(cfg.to_json())["algo"] == "dflash"
    dspark = DSparkConfig.from_target(ModelConfig.tiny(num_layers=30))
    # same target layers, mask row, depth, block size and draft-layer geometry as DSpark's default
    for name in ("target_layer_ids", "mask_token_id", "num_layers", "block_size", "hidden_size", "num_heads", "head_dim"):
        assert getattr(cfg, name) == getattr(dspark, name), name
    assert (cfg.block_size, cfg.block_len, cfg.position_decay) == (7, 8, 4.0)


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"block_size": 0}, "block_size"),
        ({"mask_token_id": 256}, "mask_token_id"),
        ({"target_layer_ids": (1, 4)}, "out of range"),
        ({"num_kv_heads": 3}, "multiple of num_kv_heads"),
        ({"position_decay": 0.0}, "position_decay"),
        ({"markov_rank": 8}, "unknown DFlashConfig fields"),
    ],
)
def test_config_rejects_invalid_values_with_what_was_got(overrides, message):
    with pytest.raises(ValueError, match=message):
        DFlashConfig.tiny(**overrides)


def test_a_dspark_config_is_not_read_as_a_dflash_one():
    with pytest.raises(ValueError, match="not a DFlashConfig"):
        DFlashConfig.from_json(DSparkConfig.tiny().to_json())


# ---- the block ----------------------------------------------------------------------------------


def test_the_block_is_the_anchor_plus_gamma_masks_through_dsparks_backbone(target):
    """DFlash = the DSpark backbone with γ + 1 inputs [x_0, mask × γ] at t..t+γ; the anchor's
    output is dropped and mask k predicts x_k through the shared LM head."""
    drafter = make_dflash(target)
    gamma = drafter.config.block_size
    # a DSpark drafter whose block is γ + 1 long, carrying the same backbone weights
    twin = DSparkDrafter(DSparkConfig.tiny(block_size=gamma + 1), shared=SharedWeights.from_target(target))
    missing, unexpected = twin.load_state_dict(drafter.state_dict(), strict=False)
    assert not unexpected and all(k.startswith(("head.", "confidence_head.")) for k in missing)
    batch = sample_batch()
    logits = drafter(batch)  # [2, 3, γ, V]
    assert logits.shape == (2, 3, gamma, drafter.config.vocab_size)
    for row in range(batch.num_rows):
        for j in range(batch.blocks_per_row):
            if not batch.block_valid[row, j]:
                continue
            length = int(batch.context_lens[row])
            ref = reference_block_hidden(twin, batch.context[row, :length], int(batch.anchor_positions[row, j]),
                                         int(batch.anchor_tokens[row, j]))  # [γ + 1, hidden], straight from the equations
            expected = ref[1:] @ target.lm_head_weight.t()  # the masks' outputs only
            torch.testing.assert_close(logits[row, j], expected, atol=1e-4, rtol=1e-4)


def test_leakage_rule_context_at_or_after_the_anchor_does_not_change_the_drafts(target):
    drafter = make_dflash(target)
    context, anchor = random_context(10, seed=4), 6
    base = drafter(BlockBatch.from_blocks([DraftBlock(context, anchor, 9)]))
    later = context.clone()
    later[anchor:] += 3.0 * torch.randn(10 - anchor, M, HIDDEN)
    assert torch.equal(drafter(BlockBatch.from_blocks([DraftBlock(later, anchor, 9)])), base)
    earlier = context.clone()
    earlier[anchor - 1] += 3.0 * torch.randn(M, HIDDEN)
    assert (drafter(BlockBatch.from_blocks([DraftBlock(earlier, anchor, 9)])) - base).abs().max() > 1e-3


def test_every_mask_position_sees_the_anchor_token(target):
    drafter = make_dflash(target)
    context = random_context(8, seed=2)
    a = drafter(BlockBatch.from_blocks([DraftBlock(context, 5, 9)]))[0, 0]  # [γ, V]
    b = drafter(BlockBatch.from_blocks([DraftBlock(context, 5, 10)]))[0, 0]
    assert ((a - b).abs().amax(dim=-1) > 1e-4).all()


def test_dflash_has_only_backbone_parameters(target):
    names = {n.split(".")[0] for n, _ in make_dflash(target).named_parameters()}
    assert names == {"context_proj", "context_norm", "layers", "final_norm"}


# ---- checkpoint ---------------------------------------------------------------------------------


def test_checkpoint_round_trip_gives_identical_drafts_and_holds_no_pickle(target, tmp_path):
    drafter = make_dflash(target)
    save_checkpoint(tmp_path / "ckpt", drafter=drafter)
    assert checkpoint_algo(tmp_path / "ckpt") == "dflash"
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["config.json", "model.safetensors"]
    loaded = load_checkpoint(tmp_path / "ckpt", shared=SharedWeights.from_target(target))
    assert loaded.config == drafter.config
    batch = sample_batch()
    assert torch.equal(loaded(batch), drafter(batch))


def test_a_bf16_checkpoint_is_half_the_size_and_loads_the_rounded_weights(target, tmp_path):
    drafter = make_dflash(target)
    save_checkpoint(tmp_path / "fp32", drafter=drafter)
    save_checkpoint(tmp_path / "bf16", drafter=drafter, storage_dtype="bfloat16")
    full, half = ((tmp_path / d / "model.safetensors").stat().st_size for d in ("fp32", "bf16"))
    assert half < 0.55 * full
    loaded = load_checkpoint(tmp_path / "bf16", shared=SharedWeights.from_target(target))
    for name, p in drafter.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], p.to(torch.bfloat16).float())


def test_loading_names_what_is_wrong(target, tmp_path):
    shared = SharedWeights.from_target(target)
    with pytest.raises(FileNotFoundError, match="no config.json"):
        load_checkpoint(tmp_path / "nothing", shared=shared)
    torch.manual_seed(0)
    save_dspark_checkpoint(tmp_path / "dspark", drafter=DSparkDrafter(DSparkConfig.tiny(), shared=shared))
    with pytest.raises(ValueError, match="holds a 'dspark' drafter, not a 'dflash' one"):
        load_checkpoint(tmp_path / "dspark", shared=shared)
    save_checkpoint(tmp_path / "deep", drafter=make_dflash(target, num_layers=3))
    config = json.loads((tmp_path / "deep" / "config.json").read_text())
    config["num_layers"] = 2
    (tmp_path / "deep" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"unexpected layers\.2\."):
        load_checkpoint(tmp_path / "deep", shared=shared)
