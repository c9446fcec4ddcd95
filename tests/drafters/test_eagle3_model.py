"""Specification tests of the EAGLE-3 baseline drafter: config, the TTT unroll, checkpoint.

Tiny random configs (vocab 256, hidden 64, γ = 4, features fused from 2 target layers) on the
CPU. The training-time-test forward is checked against a plain reference written here from the
definition in dspark/drafters/eagle3/model.py: entries [embed(x_p) ; g_{p-1}] processed one at a
time, each attending to every earlier entry, per head, with explicit RoPE; from step 2 on the
feature input is the drafter's own previous output.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F

from dspark.drafters.checkpoint_io import checkpoint_algo
from dspark.drafters.dspark.model import BlockBatch
from dspark.drafters.eagle3 import Eagle3Config, Eagle3Drafter, load_checkpoint, save_checkpoint
from dspark.drafters.shared import SharedWeights
from dspark.model.config import ModelConfig
from dspark.model.target_runtime import default_capture_layers
from tests.drafters.conftest import with_random_norms
from tests.drafters.test_dspark_model import _rope

VOCAB, HIDDEN, M = 256, 64, 2


def make_eagle3(target, *, seed: int = 0, **overrides) -> Eagle3Drafter:
    """A tiny EAGLE-3 drafter with random norms too (so a wrong norm would show)."""
    torch.manual_seed(seed)
    return with_random_norms(Eagle3Drafter(Eagle3Config.tiny(**overrides), shared=SharedWeights.from_target(target)), seed=seed + 1)


def random_sequences(seed: int = 0):
    """Two sequences (lengths 12 and 8) with tokens and captured features, anchors incl. t = 1."""
    g = torch.Generator().manual_seed(seed)
    tokens = [torch.randint(0, VOCAB, (12,), generator=g), torch.randint(0, VOCAB, (8,), generator=g)]
    captured = [torch.randn(12, M, HIDDEN, generator=g), torch.randn(8, M, HIDDEN, generator=g)]
    anchors = [torch.tensor([1, 5, 7]), torch.tensor([3])]
    return tokens, captured, anchors


def ttt_batch(tokens, captured, anchors, gamma: int):
    """BlockBatch + context tokens + teacher tokens as the trainer builds them (build_batch)."""
    contexts = [c[: int(a.max())] for c, a in zip(captured, anchors)]
    batch = BlockBatch.from_sequences(contexts=contexts, anchor_positions=anchors,
                                      anchor_tokens=[tok[a] for tok, a in zip(tokens, anchors)])
    rows, ctx_len = batch.context.shape[:2]
    context_ids = torch.zeros(rows, ctx_len + 1, dtype=torch.long)
    teacher = torch.zeros(rows, batch.blocks_per_row, gamma, dtype=torch.long)
    for r, (tok, a) in enumerate(zip(tokens, anchors)):
        context_ids[r, : int(a.max()) + 1] = tok[: int(a.max()) + 1]
        for j, t in enumerate(a.tolist()):
            teacher[r, j] = tok[t + 1 : t + 1 + gamma]
    return batch, context_ids, teacher


# ---- a plain reference --------------------------------------------------------------------------


def reference_entry(drafter: Eagle3Drafter, emb, feature, position: int, past_k: list, past_v: list):
    """One entry through the layer, attending to `past_k/past_v` (lists of [kvh, head_dim]) and itself."""
    c, layer = drafter.config, drafter.layer
    norm = lambda x, w: x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + c.rms_norm_eps) * w
    x = torch.cat([norm(emb, layer.embed_norm), norm(feature, layer.feature_norm)])  # [2 hidden]
    wq, wk, wv = layer.qkv_proj.weight.split([c.q_size, c.kv_size, c.kv_size])
    q, k = (x @ wq.t()).view(1, c.num_heads, c.head_dim), (x @ wk.t()).view(1, c.num_kv_heads, c.head_dim)
    if c.qk_norm:  # per-head RMSNorm before RoPE (Qwen3-style targets)
        q, k = norm(q, layer.q_norm), norm(k, layer.k_norm)
    q = _rope(q, torch.tensor([position]), c.rope_theta)[0]
    k = _rope(k, torch.tensor([position]), c.rope_theta)[0]
    v = (x @ wv.t()).view(c.num_kv_heads, c.head_dim)
    keys, values = [*past_k, k], [*past_v, v]
    group = c.num_heads // c.num_kv_heads
    heads = []
    for h in range(c.num_heads):
        scores = torch.stack([q[h] @ key[h // group] for key in keys]) / math.sqrt(c.head_dim)
        heads.append(torch.softmax(scores, dim=0) @ torch.stack([val[h // group] for val in values]))
    out = feature + torch.cat(heads) @ layer.o_proj.weight.t()
    gate, up = (norm(out, layer.post_attn_norm) @ layer.gate_up_proj.weight.t()).chunk(2)
    return out + (F.silu(gate) * up) @ layer.down_proj.weight.t(), k, v


def reference_chain(drafter: Eagle3Drafter, tokens, captured, anchor: int, teacher) -> torch.Tensor:
    """Logits [γ, V] of one draft chain: entries 0..t with target features, then γ-1 entries
    [embed(x*_{j-1}) ; own previous output] attending to entries 0..t and the chain so far."""
    embed, lm_head = drafter.shared.embed, drafter.shared.lm_head
    fused = captured.flatten(1) @ drafter.fc.weight.t()  # [T, hidden] g_p
    past_k, past_v, out = [], [], None
    for p in range(anchor + 1):
        feature = fused[p - 1] if p > 0 else torch.zeros(HIDDEN)
        out, k, v = reference_entry(drafter, embed[tokens[p]], feature, p, past_k, past_v)
        past_k.append(k)
        past_v.append(v)
    outs = [out]
    for j in range(2, drafter.config.block_size + 1):
        out, k, v = reference_entry(drafter, embed[teacher[j - 2]], out, anchor + j - 1, past_k, past_v)
        past_k.append(k)
        past_v.append(v)
        outs.append(out)
    hidden = torch.stack(outs)  # [γ, hidden]
    norm = hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + drafter.config.rms_norm_eps) * drafter.final_norm
    return norm @ lm_head.t()


# ---- config -------------------------------------------------------------------------------------


def test_config_round_trips_through_json_with_the_algo_field_and_fuses_the_captured_layers():
    cfg = Eagle3Config.from_target(ModelConfig.tiny(num_layers=30))
    assert Eagle3Config.from_json(cfg.to_json()) == cfg
    assert json.loads(cfg.to_json())["algo"] == "eagle3"
    assert cfg.target_layer_ids == default_capture_layers(30)  # the same 5 layers DSpark and DFlash read
    assert (cfg.block_size, cfg.step_decay) == (7, 0.8)


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"block_size": 0}, "block_size"),
        ({"target_layer_ids": (1, 4)}, "out of range"),
        ({"target_layer_ids": (1, 1)}, "distinct"),
        ({"num_kv_heads": 3}, "multiple of num_kv_heads"),
        ({"step_decay": 1.5}, "step_decay"),
        ({"hidden_size": 32}, "embedding and LM head are shared"),
        ({"num_layers": 2}, "unknown Eagle3Config fields"),
    ],
)
def test_config_rejects_invalid_values_with_what_was_got(overrides, message):
    with pytest.raises(ValueError, match=message):
        Eagle3Config.tiny(**overrides)


# ---- training-time test ---------------------------------------------------------------------------


@pytest.mark.parametrize("qk_norm", [False, True])
def test_the_ttt_unroll_matches_a_plain_step_by_step_reference(target, qk_norm):
    drafter = make_eagle3(target, qk_norm=qk_norm)
    tokens, captured, anchors = random_sequences()
    batch, context_ids, teacher = ttt_batch(tokens, captured, anchors, drafter.config.block_size)
    out = drafter(batch, context_token_ids=context_ids, target_tokens=teacher)
    assert out.logits.shape == (2, 3, 4, VOCAB)
    for r, a in enumerate(anchors):
        for j, t in enumerate(a.tolist()):
            ref = reference_chain(drafter, tokens[r], captured[r], t, teacher[r, j])
            torch.testing.assert_close(out.logits[r, j], ref, atol=1e-4, rtol=1e-4)


def test_steps_after_the_first_feed_the_drafters_own_hidden_state_not_the_target_feature(target):
    drafter = make_eagle3(target)
    tokens, captured, anchors = random_sequences()
    gamma = drafter.config.block_size
    batch, context_ids, teacher = ttt_batch(tokens, captured, anchors, gamma)
    out = drafter(batch, context_token_ids=context_ids, target_tokens=teacher)
    # the anchor t = 5 of row 0 (whose row context reaches 7: target features g_5, g_6 exist there)
    t, block = 5, 1
    # (1) the target features at positions >= t change nothing in its chain, at any step
    changed = [c.clone() for c in captured]
    changed[0][t:] += 3.0 * torch.randn_like(changed[0][t:])
    batch2, _, _ = ttt_batch(tokens, changed, anchors, gamma)
    out2 = drafter(batch2, context_token_ids=context_ids, target_tokens=teacher)
    assert torch.equal(out2.logits[0, block], out.logits[0, block])
    assert (out2.logits[0, 2] - out.logits[0, 2]).abs().max() > 1e-3  # anchor 7's context did change
    # (2) step 2 is the layer applied to [embed(x*_1) ; o_t] with o_t the step-1 output
    fused = captured[0].flatten(1) @ drafter.fc.weight.t()  # [T, hidden] target features g_p
    with_own = reference_chain(drafter, tokens[0], captured[0], t, teacher[0, block])[1]
    torch.testing.assert_close(out.logits[0, block, 1], with_own, atol=1e-4, rtol=1e-4)
    past = _reference_entries(drafter, tokens[0], fused, t)
    o_t = out.hidden[0, block, 0]
    step2_own, _, _ = reference_entry(drafter, drafter.shared.embed[teacher[0, block, 0]], o_t, t + 1, *past)
    step2_target, _, _ = reference_entry(drafter, drafter.shared.embed[teacher[0, block, 0]], fused[t], t + 1, *past)
    torch.testing.assert_close(out.hidden[0, block, 1], step2_own, atol=1e-4, rtol=1e-4)
    assert (out.hidden[0, block, 1] - step2_target).abs().max() > 1e-2  # teacher-forcing the feature differs


def _reference_entries(drafter, tokens, fused, anchor):
    past_k, past_v = [], []
    for p in range(anchor + 1):
        feature = fused[p - 1] if p > 0 else torch.zeros(HIDDEN)
        _, k, v = reference_entry(drafter, drafter.shared.embed[tokens[p]], feature, p, past_k, past_v)
        past_k.append(k)
        past_v.append(v)
    return past_k, past_v


def test_gradients_flow_through_the_unrolled_hidden_states(target):
    drafter = make_eagle3(target).train()
    tokens, captured, anchors = random_sequences()
    batch, context_ids, teacher = ttt_batch(tokens, captured, anchors, drafter.config.block_size)
    out = drafter(batch, context_token_ids=context_ids, target_tokens=teacher)
    out.logits[0, 0, -1].logsumexp(-1).backward()  # the last step's loss only
    assert drafter.fc.weight.grad.abs().sum() > 0  # reaches fc through o_t -> ... -> step γ
    assert drafter.layer.feature_norm.grad.abs().sum() > 0


def test_the_batch_must_carry_the_context_tokens_that_match_its_anchors(target):
    drafter = make_eagle3(target)
    tokens, captured, anchors = random_sequences()
    batch, context_ids, teacher = ttt_batch(tokens, captured, anchors, drafter.config.block_size)
    with pytest.raises(ValueError, match=r"context_token_ids must be \[rows, ctx_len \+ 1\]"):
        drafter(batch, context_token_ids=context_ids[:, :-1], target_tokens=teacher)
    wrong = context_ids.clone()
    wrong[0, 5] = (wrong[0, 5] + 1) % VOCAB
    with pytest.raises(ValueError, match="disagree with the blocks' anchor tokens"):
        drafter(batch, context_token_ids=wrong, target_tokens=teacher)
    with pytest.raises(ValueError, match="target_tokens must be"):
        drafter(batch, context_token_ids=context_ids, target_tokens=teacher[..., :2])


# ---- checkpoint ---------------------------------------------------------------------------------


def test_checkpoint_round_trip_gives_identical_outputs(target, tmp_path):
    drafter = make_eagle3(target)
    save_checkpoint(tmp_path / "ckpt", drafter=drafter)
    assert checkpoint_algo(tmp_path / "ckpt") == "eagle3"
    loaded = load_checkpoint(tmp_path / "ckpt", shared=SharedWeights.from_target(target))
    assert loaded.config == drafter.config
    assert {n for n, _ in loaded.named_parameters()} == {n for n, _ in drafter.named_parameters()}
    tokens, captured, anchors = random_sequences()
    batch, context_ids, teacher = ttt_batch(tokens, captured, anchors, drafter.config.block_size)
    a = drafter(batch, context_token_ids=context_ids, target_tokens=teacher).logits
    b = loaded(batch, context_token_ids=context_ids, target_tokens=teacher).logits
    assert torch.equal(a, b)
    with pytest.raises(ValueError, match="holds a 'eagle3' drafter, not a 'dflash' one"):
        from dspark.drafters.dflash import load_checkpoint as load_dflash

        load_dflash(tmp_path / "ckpt", shared=SharedWeights.from_target(target))
