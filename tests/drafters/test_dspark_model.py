"""Specification tests of the DSpark drafter: backbone layout, heads, sampling, checkpoint.

Tiny random configs (vocab 256, hidden 64, γ = 4, rank 16) on the CPU; the backbone is checked
against a plain per-block reference written here from docs/method.md §2, §3 (explicit RoPE, per-head
softmax over [context < t ; block]), the heads against their equations written by hand.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F

from dspark.drafters.dspark import (
    BlockBatch,
    DraftBlock,
    DSparkConfig,
    DSparkDrafter,
    block_attention_mask,
    load_checkpoint,
    save_checkpoint,
)
from dspark.drafters.dspark.heads import (
    ConfidenceHead,
    MarkovHead,
    RNNHead,
    sample_sequential,
    teacher_forced_logits,
)
from dspark.drafters.shared import SharedWeights
from dspark.model.config import ModelConfig
from dspark.model.target_runtime import default_capture_layers
from dspark.sampling.params import logits_to_probs

VOCAB, HIDDEN, M = 256, 64, 2  # DSparkConfig.tiny(): context from target layers (1, 3)


# ---- fixtures -----------------------------------------------------------------------------------


# `target`, the tiny random target (fp32 linear layers) the drafter shares its embedding / LM head
# with: tests/drafters/conftest.py


def make_drafter(target, *, seed: int = 0, **overrides) -> DSparkDrafter:
    """A tiny drafter with every parameter random (W2 too, so the sequential bias is not zero)."""
    torch.manual_seed(seed)
    drafter = DSparkDrafter(DSparkConfig.tiny(**overrides), shared=SharedWeights.from_target(target))
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in drafter.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            elif name.endswith("w2"):
                p.copy_(0.5 * torch.randn(p.shape, generator=g))
    return drafter.eval()


def random_context(length: int, *, seed: int) -> torch.Tensor:  # [length, m, hidden]
    return torch.randn(length, M, HIDDEN, generator=torch.Generator().manual_seed(seed))


def sample_batch() -> BlockBatch:
    """Two sequences (contexts 9 and 6), three and one blocks, anchors including t = 0 and t = L."""
    return BlockBatch.from_sequences(
        contexts=[random_context(9, seed=1), random_context(6, seed=2)],
        anchor_positions=[torch.tensor([0, 4, 9]), torch.tensor([5])],
        anchor_tokens=[torch.tensor([7, 11, 13]), torch.tensor([17])],
    )


# ---- a plain reference of one block (docs/method.md §2, §3) -------------------------------------


def _rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    # x: [n, heads, head_dim] rotated by its absolute position (rotate-half layout)
    half = x.shape[-1] // 2
    freqs = positions.double().unsqueeze(1) / theta ** (torch.arange(half, dtype=torch.float64) * 2 / x.shape[-1])
    cos, sin = freqs.cos().float().unsqueeze(1), freqs.sin().float().unsqueeze(1)  # [n, 1, half]
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def reference_block_hidden(drafter: DSparkDrafter, context: torch.Tensor, anchor: int, token: int) -> torch.Tensor:
    """h_1..h_γ [γ, hidden] of one block, straight from the equations, one head at a time."""
    c = drafter.config
    norm = lambda x, w: x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + c.rms_norm_eps) * w
    h_ctx = norm(context.flatten(1) @ drafter.context_proj.weight.t(), drafter.context_norm)[:anchor]  # positions < t only
    ids = torch.tensor([token] + [c.mask_token_id] * (c.block_size - 1))
    x = drafter.shared.embed[ids]  # [γ, hidden]
    pos_block = anchor + torch.arange(c.block_size)
    pos_ctx = torch.arange(anchor)
    group = c.num_heads // c.num_kv_heads
    for layer in drafter.layers:
        wq, wk, wv = layer.qkv_proj.weight.split([c.q_size, c.kv_size, c.kv_size])
        h = norm(x, layer.input_norm)
        q = (h @ wq.t()).view(-1, c.num_heads, c.head_dim)
        k = (torch.cat([h_ctx, h]) @ wk.t()).view(-1, c.num_kv_heads, c.head_dim)  # [ctx ; block]
        v = (torch.cat([h_ctx, h]) @ wv.t()).view(-1, c.num_kv_heads, c.head_dim)
        if c.qk_norm:
            q, k = norm(q, layer.q_norm), norm(k, layer.k_norm)
        q = _rope(q, pos_block, c.rope_theta)
        k = _rope(k, torch.cat([pos_ctx, pos_block]), c.rope_theta)
        heads = []
        for head in range(c.num_heads):
            kv = head // group
            scores = q[:, head] @ k[:, kv].t() / math.sqrt(c.head_dim)  # [γ, t + γ]: all visible
            heads.append(torch.softmax(scores, dim=-1) @ v[:, kv])
        x = x + torch.cat(heads, dim=-1) @ layer.o_proj.weight.t()
        gate, up = (norm(x, layer.post_attn_norm) @ layer.gate_up_proj.weight.t()).chunk(2, dim=-1)
        x = x + (F.silu(gate) * up) @ layer.down_proj.weight.t()
    return norm(x, drafter.final_norm)


# ---- config -------------------------------------------------------------------------------------


def test_config_round_trips_through_json_and_copies_the_target_geometry():
    target_cfg = ModelConfig.tiny(num_layers=30)
    cfg = DSparkConfig.from_target(target_cfg, head_type="rnn")
    assert DSparkConfig.from_json(cfg.to_json()) == cfg
    assert (cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size) == (64, 4, 2, 16, 128)
    assert cfg.target_layer_ids == default_capture_layers(30) == (1, 8, 14, 20, 27)  # what the runtime captures
    assert (cfg.block_size, cfg.markov_rank, cfg.num_layers) == (7, 256, 2)
    assert (cfg.ce_weight, cfg.tv_weight, cfg.conf_weight, cfg.position_decay) == (0.1, 0.9, 1.0, 4.0)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(head_type="lstm"), "head_type"),
        (dict(block_size=0), "block_size"),
        (dict(mask_token_id=256), "mask_token_id"),
        (dict(target_layer_ids=(1, 4)), "out of range"),
        (dict(hidden_size=32), "embedding and LM head are shared"),
        (dict(num_kv_heads=3), "multiple of num_kv_heads"),
        (dict(bogus=1), "unknown"),
    ],
)
def test_config_rejects_invalid_values_with_what_was_got(overrides, message):
    with pytest.raises(ValueError, match=message):
        DSparkConfig.tiny(**overrides)


# ---- backbone -----------------------------------------------------------------------------------


def test_attention_mask_lets_a_block_see_context_before_its_anchor_and_its_own_block_only():
    mask = block_attention_mask(torch.tensor([[1, 3]]), context_len=4, block_size=2)
    expected = torch.tensor([
        # ctx 0 1 2 3 | block 0 | block 1
        [1, 0, 0, 0, 1, 1, 0, 0],  # block 0 (t = 1), query 0
        [1, 0, 0, 0, 1, 1, 0, 0],  # block 0, query 1
        [1, 1, 1, 0, 0, 0, 1, 1],  # block 1 (t = 3), query 0
        [1, 1, 1, 0, 0, 0, 1, 1],  # block 1, query 1
    ], dtype=torch.bool)
    assert torch.equal(mask[0], expected)


@pytest.mark.parametrize("qk_norm", [False, True])
def test_backbone_matches_a_plain_per_block_reference(target, qk_norm):
    """Covers KV injection order, RoPE positions (context at p, block k at t + k - 1), GQA head
    mapping, the leakage rule and the padding of rows with different context / block counts."""
    drafter = make_drafter(target, qk_norm=qk_norm)
    batch = sample_batch()
    hidden = drafter.encode(batch)  # [2, 3, γ, hidden]
    for row in range(batch.num_rows):
        for j in range(batch.blocks_per_row):
            if not batch.block_valid[row, j]:
                continue
            length = int(batch.context_lens[row])
            ref = reference_block_hidden(drafter, batch.context[row, :length], int(batch.anchor_positions[row, j]), int(batch.anchor_tokens[row, j]))
            torch.testing.assert_close(hidden[row, j], ref, atol=2e-5, rtol=1e-5)


def test_padded_batch_gives_each_block_what_it_gets_alone(target):
    drafter = make_drafter(target)
    blocks = [DraftBlock(random_context(9, seed=1), 4, 11), DraftBlock(random_context(3, seed=2), 3, 17), DraftBlock(random_context(12, seed=3), 0, 5)]
    together = drafter.encode(BlockBatch.from_blocks(blocks))  # [3, 1, γ, hidden]
    for i, block in enumerate(blocks):
        alone = drafter.encode(BlockBatch.from_blocks([block]))
        torch.testing.assert_close(together[i], alone[0], atol=1e-5, rtol=1e-5)


def test_leakage_rule_context_at_or_after_the_anchor_does_not_change_the_block(target):
    drafter = make_drafter(target)
    context, anchor = random_context(10, seed=4), 6
    base = drafter.base_logits(drafter.encode(BlockBatch.from_blocks([DraftBlock(context, anchor, 9)])))
    later = context.clone()
    later[anchor:] += 3.0 * torch.randn(10 - anchor, M, HIDDEN)  # positions >= t: invisible
    out = drafter.base_logits(drafter.encode(BlockBatch.from_blocks([DraftBlock(later, anchor, 9)])))
    assert torch.equal(out, base)
    earlier = context.clone()
    earlier[anchor - 1] += 3.0 * torch.randn(M, HIDDEN)  # position t - 1: visible
    out = drafter.base_logits(drafter.encode(BlockBatch.from_blocks([DraftBlock(earlier, anchor, 9)])))
    assert (out - base).abs().max() > 1e-3


def test_attention_is_bidirectional_within_a_block_and_blind_across_blocks(target):
    drafter = make_drafter(target)
    batch = BlockBatch.from_sequences(contexts=[random_context(8, seed=5)], anchor_positions=[torch.tensor([3, 6])], anchor_tokens=[torch.tensor([1, 2])])
    x = drafter.block_embeddings(batch.anchor_tokens)  # [1, 2, γ, hidden]
    base = drafter.encode(batch, block_embeddings=x)
    changed = x.clone()
    changed[0, 0, -1] += 1.0  # the LAST input of block 0
    out = drafter.encode(batch, block_embeddings=changed)
    assert (out[0, 0, 0] - base[0, 0, 0]).abs().max() > 1e-4  # reaches block 0's FIRST position
    assert torch.equal(out[0, 1], base[0, 1])  # block 1 (same row) never sees block 0


def test_context_is_injected_into_every_layer_not_only_the_first(target):
    drafter = make_drafter(target)
    with torch.no_grad():  # layer 0 becomes the identity: any context effect must enter at layer 1
        drafter.layers[0].o_proj.weight.zero_()
        drafter.layers[0].down_proj.weight.zero_()
    context = random_context(8, seed=6)
    base = drafter.encode(BlockBatch.from_blocks([DraftBlock(context, 8, 3)]))
    out = drafter.encode(BlockBatch.from_blocks([DraftBlock(context + torch.randn_like(context), 8, 3)]))
    assert (out - base).abs().max() > 1e-3


def test_batch_validation_rejects_an_anchor_beyond_its_context():
    with pytest.raises(ValueError, match=r"anchor positions must be in \[0, 5\]"):
        BlockBatch.from_blocks([DraftBlock(random_context(5, seed=0), 6, 1)])


def test_drafter_rejects_context_with_the_wrong_number_of_layers(target):
    drafter = make_drafter(target)
    batch = BlockBatch.from_blocks([DraftBlock(torch.zeros(4, 3, HIDDEN), 2, 1)])
    with pytest.raises(ValueError, match=r"m=2"):
        drafter.encode(batch)


# ---- heads --------------------------------------------------------------------------------------


def test_teacher_forced_logits_add_the_markov_bias_of_the_ground_truth_previous_token(target):
    drafter = make_drafter(target)
    batch = sample_batch()
    targets = torch.randint(0, VOCAB, (2, 3, 4), generator=torch.Generator().manual_seed(0))
    out = drafter(batch, target_tokens=targets)
    prev = torch.cat([batch.anchor_tokens.unsqueeze(-1), targets[..., :-1]], dim=-1)  # x_0, x*_1.. x*_{γ-1}
    expected = drafter.base_logits(out.hidden) + drafter.head.w1.weight[prev] @ drafter.head.w2  # U + W1[x_{k-1}] W2
    torch.testing.assert_close(out.logits, expected, atol=1e-5, rtol=1e-5)


def test_forward_valid_equals_forward_restricted_to_the_valid_blocks(target):
    drafter = make_drafter(target)
    with torch.no_grad():
        drafter.head.w2.normal_(0, 0.1)  # a non-zero Markov bias
    batch = sample_batch()  # row 1 has one valid block and two padding blocks
    targets = torch.randint(0, VOCAB, (2, 3, 4), generator=torch.Generator().manual_seed(0))
    out = drafter(batch, target_tokens=targets)
    logits, conf = drafter.forward_valid(batch, target_tokens=targets)
    assert logits.shape[0] == int(batch.block_valid.sum()) == 4
    torch.testing.assert_close(logits, out.logits[batch.block_valid], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(conf, out.confidence_logits[batch.block_valid], atol=1e-5, rtol=1e-5)


def test_markov_teacher_forced_bias_equals_the_stepwise_bias():
    head = MarkovHead(vocab_size=VOCAB, rank=8)
    torch.nn.init.normal_(head.w2)
    prev = torch.randint(0, VOCAB, (3, 5))
    hidden = torch.randn(3, 5, HIDDEN)
    full = head.teacher_forced(head.w1(prev), hidden)
    for k in range(5):
        step, _ = head.step(head.w1(prev[:, k]), hidden[:, k], None)
        torch.testing.assert_close(full[:, k], step, atol=1e-6, rtol=1e-6)


def test_rnn_head_update_follows_eq6():
    torch.manual_seed(0)
    r = 8
    head = RNNHead(vocab_size=VOCAB, rank=r, hidden_size=HIDDEN)
    torch.nn.init.normal_(head.w2)
    prev = torch.randint(0, VOCAB, (3, 4))
    hidden = torch.randn(3, 4, HIDDEN)
    W, b = head.joint.weight, head.joint.bias  # [3r, 2r + hidden], [3r]
    Wg, Wc, Wo = W[:r], W[r : 2 * r], W[2 * r :]
    s = torch.zeros(3, r)  # s_0 = 0
    expected = []
    for k in range(4):
        z = torch.cat([s, head.w1.weight[prev[:, k]], hidden[:, k]], dim=-1)  # [s_{k-1}; W1[x_{k-1}]; h_k]
        g = torch.sigmoid(z @ Wg.t() + b[:r])
        expected.append(torch.tanh(z @ Wo.t() + b[2 * r :]) @ head.w2)  # B_k = W2ᵀ tanh(W_o z)
        s = g * s + (1 - g) * torch.tanh(z @ Wc.t() + b[r : 2 * r])  # s_k
    torch.testing.assert_close(head.teacher_forced(head.w1(prev), hidden), torch.stack(expected, dim=1), atol=1e-5, rtol=1e-5)


def test_confidence_head_is_a_sigmoid_of_a_linear_map_of_hidden_and_previous_token_embedding():
    torch.manual_seed(0)
    head = ConfidenceHead(hidden_size=HIDDEN, rank=8)
    hidden, prev_emb = torch.randn(5, HIDDEN), torch.randn(5, 8)
    w, b = head.proj.weight[0], head.proj.bias[0]
    expected = torch.sigmoid(hidden @ w[:HIDDEN] + prev_emb @ w[HIDDEN:] + b)
    torch.testing.assert_close(torch.sigmoid(head(hidden, prev_emb)), expected)


def test_confidence_reads_the_same_w1_table_as_the_sequential_head(target):
    drafter = make_drafter(target)
    batch = sample_batch()
    targets = torch.randint(0, VOCAB, (2, 3, 4))
    out = drafter(batch, target_tokens=targets)
    prev = torch.cat([batch.anchor_tokens.unsqueeze(-1), targets[..., :-1]], dim=-1)
    expected = drafter.confidence_head(out.hidden, drafter.head.w1.weight[prev])
    torch.testing.assert_close(out.confidence_logits, expected)


# ---- sampling -----------------------------------------------------------------------------------


@pytest.mark.parametrize("head_type", ["markov", "rnn"])
def test_sampled_rows_are_exactly_softmax_of_backbone_logits_plus_the_bias_of_the_sampled_prefix(target, head_type):
    drafter = make_drafter(target, head_type=head_type)
    batch = sample_batch()
    sample = drafter.draft(batch, temperature=1.0, generator=torch.Generator().manual_seed(0))
    hidden = drafter.encode(batch)[batch.block_valid]  # [4, γ, hidden]
    anchors = batch.valid_anchor_tokens()
    prev = torch.cat([anchors.unsqueeze(1), sample.tokens[:, :-1]], dim=1)  # the SAMPLED x_{k-1}
    logits, conf = teacher_forced_logits(base_logits=drafter.base_logits(hidden), hidden=hidden, prev_tokens=prev,
                                         head=drafter.head, confidence_head=drafter.confidence_head)
    assert sample.dense_probs is not None and sample.tokens.shape == (4, 4)
    torch.testing.assert_close(sample.dense_probs, torch.softmax(logits, dim=-1), atol=1e-7, rtol=1e-5)
    torch.testing.assert_close(sample.confidence_logits, conf, atol=1e-6, rtol=1e-5)
    assert bool((sample.dense_probs.gather(-1, sample.tokens.unsqueeze(-1)) > 0).all())
    # not vacuous: the bias moved the distribution away from the backbone's alone
    assert (sample.dense_probs - torch.softmax(drafter.base_logits(hidden), dim=-1)).abs().max() > 1e-2


@pytest.mark.parametrize("top_k, top_p", [(5, 1.0), (0, 0.8), (20, 0.9)])
def test_truncated_sampling_returns_sparse_rows_equal_to_the_targets_truncation_rule(target, top_k, top_p):
    drafter = make_drafter(target)
    batch = sample_batch()
    sample = drafter.draft(batch, temperature=0.8, top_k=top_k, top_p=top_p, generator=torch.Generator().manual_seed(1))
    hidden = drafter.encode(batch)[batch.block_valid]
    prev = torch.cat([batch.valid_anchor_tokens().unsqueeze(1), sample.tokens[:, :-1]], dim=1)
    logits, _ = teacher_forced_logits(base_logits=drafter.base_logits(hidden), hidden=hidden, prev_tokens=prev,
                                      head=drafter.head, confidence_head=drafter.confidence_head)
    expected = logits_to_probs(logits.reshape(-1, VOCAB), temperature=0.8, top_k=top_k, top_p=top_p).view(4, 4, VOCAB)
    ids, probs = sample.sparse_ids, sample.sparse_probs  # [4, γ, width]
    dense = torch.zeros(4, 4, VOCAB).scatter_add_(-1, ids.clamp_min(0), probs * (ids >= 0))
    torch.testing.assert_close(dense, expected, atol=1e-6, rtol=1e-5)
    assert bool(((ids == sample.tokens.unsqueeze(-1)) & (probs > 0)).any(-1).all())  # every token is in its row
    if top_k:
        assert ids.shape[-1] <= top_k


def test_temperature_zero_drafts_the_argmax_as_a_point_mass(target):
    drafter = make_drafter(target)
    batch = sample_batch()
    sample = drafter.draft(batch, temperature=0.0)
    hidden = drafter.encode(batch)[batch.block_valid]
    prev = torch.cat([batch.valid_anchor_tokens().unsqueeze(1), sample.tokens[:, :-1]], dim=1)
    logits, _ = teacher_forced_logits(base_logits=drafter.base_logits(hidden), hidden=hidden, prev_tokens=prev,
                                      head=drafter.head, confidence_head=drafter.confidence_head)
    assert torch.equal(sample.tokens, logits.argmax(-1))
    assert torch.equal(sample.sparse_ids[..., 0], sample.tokens) and bool((sample.sparse_probs == 1.0).all())
    proposal = sample.proposal(0, num_tokens=3)
    assert proposal.token_ids.tolist() == sample.tokens[0, :3].tolist() and proposal.probs.shape == (3, 1)


def test_same_generator_seed_gives_the_same_drafts(target):
    drafter = make_drafter(target)
    batch = sample_batch()
    a = drafter.draft(batch, temperature=1.0, generator=torch.Generator().manual_seed(7))
    b = drafter.draft(batch, temperature=1.0, generator=torch.Generator().manual_seed(7))
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.dense_probs, b.dense_probs)


def test_sample_sequential_rejects_mismatched_shapes(target):
    drafter = make_drafter(target)
    with pytest.raises(ValueError, match="anchor_tokens"):
        sample_sequential(base_logits=torch.zeros(2, 4, VOCAB), hidden=torch.zeros(2, 4, HIDDEN), anchor_tokens=torch.zeros(3, dtype=torch.long),
                          head=drafter.head, confidence_head=drafter.confidence_head, temperature=1.0)


# ---- frozen shared weights ----------------------------------------------------------------------


def test_frozen_embedding_and_lm_head_get_no_gradient_and_are_not_trained_or_saved(target, tmp_path):
    drafter = make_drafter(target).train()
    embed_before = target.embed.weight.clone()
    shared_ptrs = {target.embed.weight.data_ptr(), target.lm_head_weight.data_ptr()}
    assert drafter.shared.embed.data_ptr() in shared_ptrs  # referenced, not copied
    params = drafter.trainable_parameters()
    assert not {p.data_ptr() for p in params} & shared_ptrs
    assert not any(t.shape == (VOCAB, HIDDEN) and t.data_ptr() in shared_ptrs for t in drafter.state_dict().values())
    optimizer = torch.optim.AdamW(params, lr=1e-2)
    out = drafter(sample_batch(), target_tokens=torch.randint(0, VOCAB, (2, 3, 4)))
    (out.logits.logsumexp(-1).mean() + out.confidence_logits.mean()).backward()
    optimizer.step()
    assert target.embed.weight.grad is None and not drafter.shared.embed.requires_grad
    assert torch.equal(target.embed.weight, embed_before)
    assert all(p.grad is not None for p in params)  # every trainable part is reached
    save_checkpoint(tmp_path, drafter=drafter)
    from safetensors import safe_open

    with safe_open(str(tmp_path / "model.safetensors"), framework="pt") as f:
        saved = set(f.keys())
    assert saved == {name for name, _ in drafter.named_parameters()}  # trainable tensors only
    assert not any("embed" in name or "lm_head" in name for name in saved)


# ---- checkpoint ---------------------------------------------------------------------------------


@pytest.mark.parametrize("head_type", ["markov", "rnn"])
def test_checkpoint_round_trip_gives_identical_drafts_with_the_same_seed(target, tmp_path, head_type):
    drafter = make_drafter(target, head_type=head_type)
    temperatures = torch.tensor([1.5, 2.0, 0.75, 1.0])
    save_checkpoint(tmp_path, drafter=drafter, temperatures=temperatures)
    loaded = load_checkpoint(tmp_path, shared=SharedWeights.from_target(target))
    assert loaded.drafter.config == drafter.config
    assert torch.equal(loaded.temperatures, temperatures)
    batch = sample_batch()
    a = drafter.draft(batch, temperature=1.0, generator=torch.Generator().manual_seed(3))
    b = loaded.drafter.draft(batch, temperature=1.0, generator=torch.Generator().manual_seed(3))
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.dense_probs, b.dense_probs)
    assert torch.equal(a.confidence_logits, b.confidence_logits)


def test_checkpoint_load_names_every_mismatch_between_config_and_weights(target, tmp_path):
    save_checkpoint(tmp_path, drafter=make_drafter(target))
    cfg = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "num_layers": 3, "markov_rank": 8}))
    with pytest.raises(ValueError, match=r"missing layers\.2\..*head\.w2: shape \(16, 256\), config implies \(8, 256\)"):
        load_checkpoint(tmp_path, shared=SharedWeights.from_target(target))


def test_checkpoint_load_rejects_a_target_with_another_hidden_size(target, tmp_path):
    save_checkpoint(tmp_path, drafter=make_drafter(target))
    other = SharedWeights(embed=torch.zeros(VOCAB, 32), lm_head=torch.zeros(VOCAB, 32))
    with pytest.raises(ValueError, match=r"shared embed has shape \(256, 32\)"):
        load_checkpoint(tmp_path, shared=other)


def test_checkpoint_rejects_temperatures_of_the_wrong_length(target, tmp_path):
    with pytest.raises(ValueError, match="expected 4 positive temperatures"):
        save_checkpoint(tmp_path, drafter=make_drafter(target), temperatures=torch.ones(3))


def test_bf16_export_halves_the_file_and_drafts_like_the_bf16_rounded_drafter(target, tmp_path):
    from dspark.drafters.dspark.checkpoint import export_checkpoint

    drafter = make_drafter(target)
    temperatures = torch.tensor([1.5, 2.0, 0.75, 1.0])
    save_checkpoint(tmp_path / "fp32", drafter=drafter, temperatures=temperatures)
    shared = SharedWeights.from_target(target)
    export_checkpoint(tmp_path / "fp32", tmp_path / "bf16", storage_dtype="bfloat16", shared=shared)
    full, half = (tmp_path / d / "model.safetensors" for d in ("fp32", "bf16"))
    assert half.stat().st_size < 0.55 * full.stat().st_size
    loaded = load_checkpoint(tmp_path / "bf16", shared=shared)
    assert torch.equal(loaded.temperatures, temperatures)
    with torch.no_grad():  # the reference: the same drafter with every weight rounded to bf16
        for p in drafter.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    batch = sample_batch()
    a = drafter.draft(batch, temperature=1.0, generator=torch.Generator().manual_seed(3))
    b = loaded.drafter.draft(batch, temperature=1.0, generator=torch.Generator().manual_seed(3))
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.dense_probs, b.dense_probs)
    with pytest.raises(ValueError, match="storage_dtype must be one of"):
        save_checkpoint(tmp_path / "x", drafter=drafter, storage_dtype="int8")
