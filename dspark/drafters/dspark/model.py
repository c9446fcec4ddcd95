"""The DSpark drafter: parallel backbone (DFlash-style KV injection) + sequential heads.

This module owns the block layout (`DraftBlock`, `BlockBatch`), the attention mask that
enforces the leakage rule (`block_attention_mask`), the draft layers, `ParallelBackbone` (the
KV-injected backbone, shared with the DFlash baseline of dspark.drafters.dflash) and
`DSparkDrafter`, which composes it with the heads of heads.py in two modes: `forward`
(teacher-forced, training) and `draft` (sampling, serving).

One block (docs/method.md §2, §3), anchor x_0 at absolute position t, γ = block_size:
  * context features  H_ctx = RMSNorm(W_c [H(l_1); ...; H(l_m)])  [ctx_len, hidden], from the
    target's layer outputs at positions 0..t-1 (`TargetRuntime.forward(..., capture=True)`);
  * block input       [embed(x_0), embed(mask) × (γ-1)] at positions t, t+1, ..., t+γ-1;
  * every draft layer: queries from the block; keys/values [W_K H_ctx ; W_K H_d] (context first,
    then block: KV injection into EVERY layer); RoPE at the absolute positions above;
  * attention: bidirectional inside the block; context positions < t only (leakage rule: the
    anchor enters as a token embedding, its own hidden state does not exist at serving time);
  * output: final-normed h_1..h_γ and U_k = LMHead(h_k), so block position k (input x_0 or a
    mask) predicts the token at t + k.
The embedding and LM head are the target's own tensors, referenced (`SharedWeights`, drafters/shared.py), frozen:
they are neither parameters of the drafter nor in its state_dict / checkpoint.

Layout: padded 2-D, one row per sequence, several blocks per row (training: many anchors of
one sequence share its context keys; serving: one block per request). The production path
packs blocks of many sequences with token-level attention indices instead of a padded
[rows, Q, ctx + Q] mask; this module is the plain reference it will be tested against.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from dspark.drafters.dspark.config import DSparkConfig
from dspark.drafters.dspark.heads import (
    ConfidenceHead,
    DraftSample,
    make_sequential_head,
    sample_sequential,
    teacher_forced_logits,
)
from dspark.drafters.shared import SharedWeights, checked_shared
from dspark.model.transformer import apply_rope, rms_norm, rope_inv_freq


# ---- the block layout ---------------------------------------------------------------------------


@dataclass
class DraftBlock:
    """One block to draft: the anchor and the target context before it."""

    context: torch.Tensor  # [ctx_len, m, hidden] target layer outputs at positions 0..ctx_len-1
    anchor_position: int  # t, absolute position of x_0; needs ctx_len >= t (positions < t are read)
    anchor_token: int  # x_0


@dataclass
class BlockBatch:
    """Blocks grouped by the sequence whose context they read, padded to a rectangle.

    Row i holds one sequence's context (positions 0..context_lens[i]-1, zero padded after) and
    its blocks; padding blocks have block_valid False (their outputs are meaningless). Every
    valid anchor satisfies 0 <= t <= context_lens[i], so padded context positions (>= its
    context length >= t) are always masked by the leakage rule."""

    context: torch.Tensor  # [num_rows, ctx_len, m, hidden] fp32
    context_lens: torch.Tensor  # [num_rows] int64
    anchor_positions: torch.Tensor  # [num_rows, blocks_per_row] int64
    anchor_tokens: torch.Tensor  # [num_rows, blocks_per_row] int64
    block_valid: torch.Tensor  # [num_rows, blocks_per_row] bool

    @classmethod
    def from_sequences(
        cls,
        *,
        contexts: list[torch.Tensor],  # each [ctx_len_i, m, hidden]
        anchor_positions: list[torch.Tensor],  # each [num_blocks_i] int64
        anchor_tokens: list[torch.Tensor],  # each [num_blocks_i] int64
    ) -> BlockBatch:
        if not contexts or not len(contexts) == len(anchor_positions) == len(anchor_tokens):
            raise ValueError(
                f"need one anchor_positions and anchor_tokens tensor per context, got {len(contexts)} contexts, "
                f"{len(anchor_positions)} anchor_positions, {len(anchor_tokens)} anchor_tokens"
            )
        shape = tuple(contexts[0].shape[1:])
        for i, (ctx, pos, tok) in enumerate(zip(contexts, anchor_positions, anchor_tokens)):
            if ctx.dim() != 3 or tuple(ctx.shape[1:]) != shape:
                raise ValueError(f"context {i}: expected [ctx_len, {shape[0]}, {shape[1]}], got {tuple(ctx.shape)}")
            if pos.dim() != 1 or pos.shape != tok.shape or pos.numel() == 0:
                raise ValueError(f"sequence {i}: anchor_positions {tuple(pos.shape)} and anchor_tokens {tuple(tok.shape)} must be equal non-empty 1-D")
            if int(pos.min()) < 0 or int(pos.max()) > ctx.shape[0]:
                raise ValueError(f"sequence {i}: anchor positions must be in [0, {ctx.shape[0]}] (its context length), got {pos.tolist()}")
        rows, max_ctx = len(contexts), max(c.shape[0] for c in contexts)
        max_blocks = max(p.numel() for p in anchor_positions)
        context = contexts[0].new_zeros(rows, max_ctx, *shape)
        positions = torch.zeros(rows, max_blocks, dtype=torch.long)
        tokens = torch.zeros(rows, max_blocks, dtype=torch.long)
        valid = torch.zeros(rows, max_blocks, dtype=torch.bool)
        for i, (ctx, pos, tok) in enumerate(zip(contexts, anchor_positions, anchor_tokens)):
            context[i, : ctx.shape[0]] = ctx
            positions[i, : pos.numel()] = pos
            tokens[i, : tok.numel()] = tok
            valid[i, : pos.numel()] = True
        lens = torch.tensor([c.shape[0] for c in contexts], dtype=torch.long)
        return cls(context=context, context_lens=lens, anchor_positions=positions, anchor_tokens=tokens, block_valid=valid)

    @classmethod
    def from_blocks(cls, blocks: list[DraftBlock]) -> BlockBatch:
        """One row per block (serving: one block per request)."""
        return cls.from_sequences(
            contexts=[b.context for b in blocks],
            anchor_positions=[torch.tensor([b.anchor_position]) for b in blocks],
            anchor_tokens=[torch.tensor([b.anchor_token]) for b in blocks],
        )

    @property
    def num_rows(self) -> int:
        return int(self.context.shape[0])

    @property
    def blocks_per_row(self) -> int:
        return int(self.anchor_positions.shape[1])

    def valid_anchor_tokens(self) -> torch.Tensor:  # [num_valid_blocks] int64, row-major
        return self.anchor_tokens[self.block_valid]


def block_attention_mask(
    anchor_positions: torch.Tensor,  # [num_rows, blocks_per_row] int64 anchor position t of each block
    *,
    context_len: int,  # L, padded context length (keys 0..L-1 are context positions 0..L-1)
    block_size: int,  # γ
) -> torch.Tensor:  # [num_rows, blocks_per_row * γ, L + blocks_per_row * γ] bool, True = attend
    """Which keys each block query may attend to. Queries are the rows' blocks, flattened
    (query q belongs to block q // γ); keys are the L context positions, then the blocks' own
    positions in the same order. Query q of block b attends to
      * context key p iff p < t_b (leakage rule: strictly before the anchor), and
      * block key j iff j belongs to block b (bidirectional inside the block, blind to others)."""
    num_blocks = anchor_positions.shape[1]
    q_len = num_blocks * block_size
    device = anchor_positions.device
    q_block = torch.arange(q_len, device=device) // block_size  # [Q]
    kv = torch.arange(context_len + q_len, device=device)  # [K]
    anchor_of_query = anchor_positions[:, q_block]  # [rows, Q]
    is_context = kv < context_len  # [K]
    context_ok = is_context & (kv.view(1, 1, -1) < anchor_of_query.unsqueeze(-1))  # [rows, Q, K]
    kv_block = torch.div(kv - context_len, block_size, rounding_mode="floor")  # [K], negative for context keys
    block_ok = ~is_context & (kv_block.view(1, -1) == q_block.view(-1, 1))  # [Q, K]
    return context_ok | block_ok.unsqueeze(0)


def block_positions(anchor_positions: torch.Tensor, block_size: int) -> torch.Tensor:
    # anchor_positions: [...] -> [..., γ]: block position k-1 (input x_0 or a mask) sits at t + k - 1
    return anchor_positions.unsqueeze(-1) + torch.arange(block_size, device=anchor_positions.device)


def _rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    # positions: [...] int64 -> cos, sin [..., 1, head_dim] (rotate-half layout, as the target)
    freqs = positions.float().unsqueeze(-1) * inv_freq  # [..., head_dim // 2]
    emb = torch.cat((freqs, freqs), dim=-1).unsqueeze(-2)
    return emb.cos(), emb.sin()


# ---- draft layers -------------------------------------------------------------------------------


class DraftLayer(nn.Module):
    """A pre-norm decoder layer whose keys/values are [context ; block] (KV injection).

    The context features enter every layer as keys and values only (W_K H_ctx, W_V H_ctx, with
    the same k-norm and RoPE as block keys); they are not updated by the draft layers."""

    def __init__(self, config: DSparkConfig):
        super().__init__()
        c = self.config = config
        self.input_norm = nn.Parameter(torch.ones(c.hidden_size))
        self.post_attn_norm = nn.Parameter(torch.ones(c.hidden_size))
        self.qkv_proj = nn.Linear(c.hidden_size, c.q_size + 2 * c.kv_size, bias=False)  # rows: W_Q, W_K, W_V
        self.o_proj = nn.Linear(c.q_size, c.hidden_size, bias=False)
        self.gate_up_proj = nn.Linear(c.hidden_size, 2 * c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)
        if c.qk_norm:
            self.q_norm = nn.Parameter(torch.ones(c.head_dim))
            self.k_norm = nn.Parameter(torch.ones(c.head_dim))
        self.__dict__["kv_gemm"] = None  # serving: H_ctx -> [W_K; W_V] H_ctx, row-invariant (dspark/drafters/serving_gemms.py)

    def _norm_heads(self, x: torch.Tensor, weight_name: str) -> torch.Tensor:
        # x: [..., heads, head_dim]; per-head RMSNorm when the target uses qk-norm (Qwen3)
        return rms_norm(x, getattr(self, weight_name), self.config.rms_norm_eps) if self.config.qk_norm else x

    def context_kv(
        self,
        context: torch.Tensor,  # [rows, L, hidden] H_ctx
        context_rope: tuple[torch.Tensor, torch.Tensor],  # cos, sin [L, 1, head_dim] at the context's positions
    ) -> tuple[torch.Tensor, torch.Tensor]:  # keys, values [rows, L, kv_heads, head_dim]
        """The context's keys/values in this layer: the same W_K, W_V, k-norm and RoPE as block
        keys (no W_Q: the context never queries). Position-wise, so serving caches them."""
        c = self.config
        rows, ctx_len, _ = context.shape
        gemm = self.__dict__["kv_gemm"]
        if gemm is None:
            kv = F.linear(context, self.qkv_proj.weight[c.q_size :])  # [rows, L, 2 * kv_size]
        else:
            kv = gemm(context.reshape(-1, c.hidden_size)).view(rows, ctx_len, 2 * c.kv_size)
        k_ctx, v_ctx = kv.split([c.kv_size, c.kv_size], dim=-1)
        k_ctx = self._norm_heads(k_ctx.view(rows, ctx_len, c.num_kv_heads, c.head_dim), "k_norm")
        return apply_rope(k_ctx, *context_rope), v_ctx.view(rows, ctx_len, c.num_kv_heads, c.head_dim)

    def forward(
        self,
        x: torch.Tensor,  # [rows, Q, hidden] block residual stream (Q = blocks_per_row * γ)
        context_kv: tuple[torch.Tensor, torch.Tensor],  # keys, values [rows, L, kv_heads, head_dim] (context_kv())
        block_rope: tuple[torch.Tensor, torch.Tensor],  # cos, sin [rows, Q, 1, head_dim]
        mask: torch.Tensor,  # [rows, 1, Q, L + Q] bool
    ) -> torch.Tensor:  # [rows, Q, hidden]
        c = self.config
        rows, q_len, _ = x.shape
        h = rms_norm(x, self.input_norm, c.rms_norm_eps)
        q, k, v = self.qkv_proj(h).split([c.q_size, c.kv_size, c.kv_size], dim=-1)
        q = self._norm_heads(q.view(rows, q_len, c.num_heads, c.head_dim), "q_norm")
        k = self._norm_heads(k.view(rows, q_len, c.num_kv_heads, c.head_dim), "k_norm")
        q, k = apply_rope(q, *block_rope), apply_rope(k, *block_rope)
        k_ctx, v_ctx = context_kv
        keys = torch.cat([k_ctx, k], dim=1)  # [rows, L + Q, kv_heads, head_dim]: context first, then block
        values = torch.cat([v_ctx, v.view(rows, q_len, c.num_kv_heads, c.head_dim)], dim=1)
        # query head h reads KV head h // (heads / kv_heads), as HF's repeat_kv; SDPA's GQA mode
        # reads the shared heads in place instead of copying the context keys per query head
        attn = F.scaled_dot_product_attention(q.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2),
                                              attn_mask=mask, enable_gqa=True)  # [rows, heads, Q, head_dim]
        x = x + self.o_proj(attn.transpose(1, 2).reshape(rows, q_len, c.q_size))
        gate, up = self.gate_up_proj(rms_norm(x, self.post_attn_norm, c.rms_norm_eps)).chunk(2, dim=-1)
        return x + self.down_proj(F.silu(gate) * up)


# ---- the drafter --------------------------------------------------------------------------------


@dataclass
class TeacherForcedOutput:
    logits: torch.Tensor  # [rows, blocks_per_row, γ, V] U_k + B_k given the ground-truth x_{k-1}
    confidence_logits: torch.Tensor  # [rows, blocks_per_row, γ] raw logits of c_k
    hidden: torch.Tensor  # [rows, blocks_per_row, γ, hidden] h_k (final-normed)


class ParallelBackbone(nn.Module):
    """The parallel backbone DSpark shares with the DFlash baseline: W_c + context norm, the
    KV-injected draft layers, the final norm (trainable); the target's embedding and LM head
    (`shared`, referenced, frozen).

    A block is `block_len` positions [embed(x_0), embed(mask) × (block_len - 1)] at t .. t +
    block_len - 1, bidirectional inside, context positions < t injected into every layer. DSpark
    uses block_len = γ (the anchor position is its first prediction); DFlash uses γ + 1 (the
    anchor predicts nothing, the γ masks do). `config` is DSparkConfig or any flat config with
    the same draft-layer geometry fields (dspark.drafters.dflash.DFlashConfig)."""

    def __init__(self, config: DSparkConfig, *, shared: SharedWeights, block_len: int):
        super().__init__()
        c = self.config = config
        if block_len < 1:
            raise ValueError(f"block_len must be >= 1, got {block_len}")
        self.block_len = block_len
        self.context_proj = nn.Linear(c.num_context_layers * c.hidden_size, c.hidden_size, bias=False)  # W_c
        self.context_norm = nn.Parameter(torch.ones(c.hidden_size))
        self.layers = nn.ModuleList(DraftLayer(c) for _ in range(c.num_layers))
        self.final_norm = nn.Parameter(torch.ones(c.hidden_size))
        # rope_inv_freq reads head_dim / rope_theta / rope_scaling, which DSparkConfig names as ModelConfig does
        self.register_buffer("inv_freq", rope_inv_freq(c), persistent=False)  # [head_dim // 2], derived: not saved
        self.attach_shared(shared)

    def attach_shared(self, shared: SharedWeights) -> None:
        """Point the drafter at the target's embedding / LM head (a plain attribute: not a
        parameter, not a buffer, not in state_dict). Call again after moving the target."""
        self.shared = checked_shared(shared, self.config)

    # ---- backbone --------------------------------------------------------------------------

    def context_features(self, context: torch.Tensor) -> torch.Tensor:
        # context: [..., L, m, hidden] -> H_ctx = RMSNorm(W_c [H(l_1); ...; H(l_m)]) [..., L, hidden]
        flat = context.flatten(-2).float()  # [..., L, m * hidden], layer-major as target_layer_ids
        return rms_norm(self.context_proj(flat), self.context_norm, self.config.rms_norm_eps)

    def block_embeddings(self, anchor_tokens: torch.Tensor) -> torch.Tensor:
        # anchor_tokens: [...] -> [..., block_len, hidden]: [embed(x_0), embed(mask) × (block_len-1)]
        ids = torch.full((*anchor_tokens.shape, self.block_len), self.config.mask_token_id,
                         dtype=torch.long, device=anchor_tokens.device)
        ids[..., 0] = anchor_tokens
        return F.embedding(ids, self.shared.embed).float()

    def encode(self, batch: BlockBatch, *, block_embeddings: torch.Tensor | None = None) -> torch.Tensor:
        """The parallel backbone: final-normed hidden states [rows, blocks_per_row, block_len, hidden]
        (DSpark: h_1..h_γ).

        block_embeddings: [rows, blocks_per_row, block_len, hidden] to override the block input (tests)."""
        self._check_batch(batch)
        ctx_len = batch.context.shape[1]
        kv = self.context_kv(batch.context, positions=torch.arange(ctx_len, device=batch.context.device))
        return self.encode_with_context_kv(
            anchor_positions=batch.anchor_positions, anchor_tokens=batch.anchor_tokens, context_kv=kv,
            block_embeddings=block_embeddings,
        )

    def context_kv(
        self,
        context: torch.Tensor,  # [rows, L, m, hidden] target layer outputs
        *,
        positions: torch.Tensor,  # [L] int64 absolute positions of the context rows
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:  # per draft layer: keys, values [rows, L, kv_heads, head_dim]
        """Every layer's context keys/values (KV injection). Each context position's entries depend
        on that position alone, so serving computes them once per verified token and caches them."""
        features = self.context_features(context)  # [rows, L, hidden]
        rope = _rope_cos_sin(positions, self.inv_freq)
        return [layer.context_kv(features, rope) for layer in self.layers]

    def encode_with_context_kv(
        self,
        *,
        anchor_positions: torch.Tensor,  # [rows, blocks_per_row] int64
        anchor_tokens: torch.Tensor,  # [rows, blocks_per_row] int64
        context_kv: list[tuple[torch.Tensor, torch.Tensor]],  # per layer: [rows, L, kv_heads, head_dim] x 2
        block_embeddings: torch.Tensor | None = None,
    ) -> torch.Tensor:  # [rows, blocks_per_row, block_len, hidden]
        """The backbone from precomputed context keys/values; context positions >= an anchor are
        masked (leakage rule), so rows may be padded to a common L with anything."""
        c, block_len = self.config, self.block_len
        rows, num_blocks = anchor_positions.shape
        ctx_len = context_kv[0][0].shape[1]
        x = self.block_embeddings(anchor_tokens) if block_embeddings is None else block_embeddings
        x = x.reshape(rows, num_blocks * block_len, c.hidden_size)  # [rows, Q, hidden]
        block_rope = _rope_cos_sin(block_positions(anchor_positions, block_len).flatten(1), self.inv_freq)
        mask = block_attention_mask(anchor_positions, context_len=ctx_len, block_size=block_len).unsqueeze(1)
        for layer, kv in zip(self.layers, context_kv):
            x = layer(x, kv, block_rope, mask)
        x = rms_norm(x, self.final_norm, c.rms_norm_eps)
        return x.view(rows, num_blocks, block_len, c.hidden_size)

    def base_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # hidden: [..., hidden] -> U [..., V] fp32 through the frozen shared LM head
        return hidden.float() @ self.shared.lm_head.float().t()

    def _check_batch(self, batch: BlockBatch) -> None:
        c = self.config
        m, d = c.num_context_layers, c.hidden_size
        if batch.context.dim() != 4 or tuple(batch.context.shape[2:]) != (m, d):
            raise ValueError(f"batch.context must be [rows, ctx_len, m={m}, hidden={d}], got {list(batch.context.shape)}")
        pos, lens = batch.anchor_positions, batch.context_lens.unsqueeze(1)  # [rows, nb], [rows, 1]
        bad = batch.block_valid & ((pos < 0) | (pos > lens))
        if bool(bad.any()):
            raise ValueError(f"valid anchors need 0 <= t <= context length of their row; got anchors {pos[bad].tolist()}")
        tokens = batch.anchor_tokens
        if tokens.numel() and (int(tokens.min()) < 0 or int(tokens.max()) >= c.vocab_size):
            raise ValueError(f"anchor tokens must be in [0, {c.vocab_size}), got range [{int(tokens.min())}, {int(tokens.max())}]")

    def trainable_parameters(self) -> list[nn.Parameter]:
        """What the optimizer updates: every parameter (the shared tensors are not parameters)."""
        return [p for p in self.parameters() if p.requires_grad]


class DSparkDrafter(ParallelBackbone):
    """DSpark: the parallel backbone over [x_0, mask × (γ-1)] (block_len = γ) plus the sequential
    head and the confidence head. Trainable: the backbone's W_c + context norm, draft layers and
    final norm, the sequential head, the confidence head. Referenced, frozen: the target's
    embedding and LM head (`shared`)."""

    def __init__(self, config: DSparkConfig, *, shared: SharedWeights, draft_to_target: torch.Tensor | None = None):
        super().__init__(config, shared=shared, block_len=config.block_size)
        c = config
        self.head = make_sequential_head(head_type=c.head_type, vocab_size=c.vocab_size, rank=c.markov_rank,
                                         hidden_size=c.hidden_size, output_size=c.output_vocab_size)
        self.confidence_head = ConfidenceHead(hidden_size=c.hidden_size, rank=c.markov_rank, reads_prev=c.confidence_reads_prev)
        # [N] int64, the target id of each draft index (a saved buffer: the map is part of the
        # checkpoint); absent without a draft vocabulary. Loading a checkpoint overwrites it.
        if c.draft_vocab_size is not None:
            if draft_to_target is None:
                draft_to_target = torch.arange(c.draft_vocab_size)
            check_draft_vocabulary(draft_to_target, vocab_size=c.vocab_size, size=c.draft_vocab_size)
            self.register_buffer("draft_to_target", draft_to_target.clone().long())
        elif draft_to_target is not None:
            raise ValueError("draft_to_target given but the config has no draft_vocab_size")
        else:
            self.draft_to_target = None
        self._draft_head_key: tuple | None = None
        self._draft_head: torch.Tensor | None = None

    def draft_lm_head(self) -> torch.Tensor:  # [N, hidden] fp32: the shared LM head's rows of the draft vocabulary
        """The target's LM head restricted to the draft vocabulary (the head itself when N = V).
        Gathered once and reused while neither the map nor the shared head changes."""
        head = self.shared.lm_head
        if self.draft_to_target is None:
            return head
        key = (head.data_ptr(), self.draft_to_target.data_ptr(), self.draft_to_target._version, head.device)
        if key != self._draft_head_key:
            self._draft_head = head.float()[self.draft_to_target].contiguous()
            self._draft_head_key = key
        return self._draft_head

    def base_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # hidden: [..., hidden] -> U [..., N] fp32 through the frozen shared LM head's draft rows
        return hidden.float() @ self.draft_lm_head().t()

    def target_to_draft(self) -> torch.Tensor:  # [V] int64: draft index of each target token, -1 outside the draft vocabulary
        V = self.config.vocab_size
        if self.draft_to_target is None:
            return torch.arange(V, device=self.final_norm.device)
        inverse = torch.full((V,), -1, dtype=torch.long, device=self.draft_to_target.device)
        inverse[self.draft_to_target] = torch.arange(self.draft_to_target.numel(), device=self.draft_to_target.device)
        return inverse

    # ---- the two modes ---------------------------------------------------------------------

    def forward(self, batch: BlockBatch, *, target_tokens: torch.Tensor) -> TeacherForcedOutput:
        """Training: draft logits U_k + B(x*_{k-1}) [rows, nb, γ, N] and confidence logits, teacher forced.

        target_tokens: [rows, blocks_per_row, γ] int64, x*_k = the token at t + k (any valid id
        where it does not exist; mask those positions out of the loss)."""
        c = self.config
        expected = (*batch.anchor_positions.shape, c.block_size)
        if tuple(target_tokens.shape) != expected:
            raise ValueError(f"target_tokens must be [rows, blocks_per_row, γ] = {list(expected)}, got {list(target_tokens.shape)}")
        hidden = self.encode(batch)  # [rows, nb, γ, hidden]
        prev = torch.cat([batch.anchor_tokens.unsqueeze(-1), target_tokens[..., :-1]], dim=-1)  # [rows, nb, γ] x_0, x*_1..x*_{γ-1}
        n = batch.num_rows * batch.blocks_per_row
        logits, conf = self._teacher_forced_heads(hidden.view(n, c.block_size, -1), prev.reshape(n, c.block_size))
        return TeacherForcedOutput(logits=logits.view(*expected, -1), confidence_logits=conf.view(expected), hidden=hidden)

    def forward_valid(self, batch: BlockBatch, *, target_tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`forward` on the VALID blocks only (row-major, as `[batch.block_valid]`): draft logits
        [n, γ, V] and confidence logits [n, γ]. Training's path: padding blocks never reach the
        vocabulary-sized LM head and Markov products (nor their backward)."""
        c = self.config
        expected = (*batch.anchor_positions.shape, c.block_size)
        if tuple(target_tokens.shape) != expected:
            raise ValueError(f"target_tokens must be [rows, blocks_per_row, γ] = {list(expected)}, got {list(target_tokens.shape)}")
        valid = batch.block_valid  # [rows, nb]
        hidden = self.encode(batch)[valid]  # [n, γ, hidden]
        prev = torch.cat([batch.anchor_tokens.unsqueeze(-1), target_tokens[..., :-1]], dim=-1)[valid]  # [n, γ]
        return self._teacher_forced_heads(hidden, prev)

    def _teacher_forced_heads(self, hidden: torch.Tensor, prev: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # hidden: [n, γ, hidden] h_k; prev: [n, γ] x_0, x*_1..x*_{γ-1} -> logits [n, γ, V], confidence logits [n, γ]
        return teacher_forced_logits(base_logits=self.base_logits(hidden), hidden=hidden, prev_tokens=prev,
                                     head=self.head, confidence_head=self.confidence_head)

    @torch.no_grad()
    def draft(
        self,
        batch: BlockBatch,
        *,
        temperature: float,
        top_k: int = 0,
        top_p: float = 1.0,
        generator: torch.Generator | None = None,
    ) -> DraftSample:
        """Serving: γ draft tokens for every VALID block (rows of the result in row-major block
        order), with the exact rows they were sampled from and raw confidence logits."""
        hidden = self.encode(batch)[batch.block_valid]  # [n, γ, hidden]
        return sample_sequential(
            base_logits=self.base_logits(hidden),
            hidden=hidden,
            anchor_tokens=batch.valid_anchor_tokens(),
            head=self.head,
            confidence_head=self.confidence_head,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            generator=generator,
            draft_to_target=self.draft_to_target,
        )


def check_draft_vocabulary(draft_to_target: torch.Tensor, *, vocab_size: int, size: int) -> None:
    """A draft vocabulary is `size` distinct target ids in [0, vocab_size)."""
    if draft_to_target.dim() != 1 or draft_to_target.numel() != size or draft_to_target.is_floating_point():
        raise ValueError(f"draft_to_target must be a 1-D integer tensor of {size} target ids, got {draft_to_target.dtype} {tuple(draft_to_target.shape)}")
    if size and (int(draft_to_target.min()) < 0 or int(draft_to_target.max()) >= vocab_size):
        raise ValueError(f"draft_to_target ids must be in [0, {vocab_size})")
    if torch.unique(draft_to_target).numel() != size:
        raise ValueError("draft_to_target ids must be distinct")


__all__ = [
    "BlockBatch", "DSparkDrafter", "check_draft_vocabulary", "DraftBlock", "DraftLayer", "ParallelBackbone", "TeacherForcedOutput",
    "block_attention_mask", "block_positions",
]
