"""The EAGLE-3 drafter: one autoregressive decoder layer over fused target features.

Entries. The drafter runs causally over its own sequence of entries, one per position p:
    entry p = [embed(x_p) ; g_{p-1}]       (g_{-1} = 0)
where x_p is the token at p and g_{p-1} the feature that produced it: for a verified position,
the fused target feature g = fc([H(l_1); ...; H(l_m)]) of the target's output at p - 1; for a
drafted position, the drafter's own output at p - 1. The layer's input is
[RMSNorm(embed) ; RMSNorm(feature)] (2 × hidden), its residual stream starts at the feature,
and its output o_p gives p_d(x_{p+1}) = softmax(LMHead(RMSNorm(o_p))). RoPE at absolute
positions; keys/values of verified entries are cached (serving.py).

One draft chain (anchor x_0 at t, γ = block_size), the same in training and serving:
    step 1   entry t = [embed(x_0) ; g_{t-1}] attends to entries 0..t     -> o_t   -> x_1
    step j   entry t+j-1 = [embed(x_{j-1}) ; o_{t+j-2}] attends to entries 0..t and the
             chain's own entries t+1..t+j-1                             -> o_{t+j-1} -> x_j
Leakage rule: nothing of the target at positions >= t is read (g_{t-1} is the last feature).

Training-time test (`forward`): teacher-forced tokens x*_{j-1}, but from step 2 on the
feature input is the drafter's OWN previous output (with gradient), exactly as at serving
time; the unroll covers γ steps for every sampled anchor at once: step 1 is one causal pass
over the row's entries 0..L, steps 2..γ query one entry per anchor, attending to the step-1
entries <= its anchor and to its own chain (EAGLE-3's "diagonal" keys).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from dspark.drafters.dspark.model import BlockBatch
from dspark.drafters.eagle3.config import Eagle3Config
from dspark.drafters.shared import SharedWeights, checked_shared
from dspark.model.transformer import apply_rope, rms_norm, rope_inv_freq

KV = tuple[torch.Tensor, torch.Tensor]  # keys, values [rows, n, kv_heads, head_dim] (keys after RoPE)


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    # positions: [...] int64 -> cos, sin [..., 1, head_dim] (rotate-half layout, as the target)
    freqs = positions.float().unsqueeze(-1) * inv_freq  # [..., head_dim // 2]
    emb = torch.cat((freqs, freqs), dim=-1).unsqueeze(-2)
    return emb.cos(), emb.sin()


class Eagle3Layer(nn.Module):
    """A pre-norm decoder layer whose attention reads [RMSNorm(embed) ; RMSNorm(feature)] and
    whose residual stream is the feature (EAGLE-3's first-layer design)."""

    def __init__(self, config: Eagle3Config):
        super().__init__()
        c = self.config = config
        self.embed_norm = nn.Parameter(torch.ones(c.hidden_size))
        self.feature_norm = nn.Parameter(torch.ones(c.hidden_size))
        self.qkv_proj = nn.Linear(2 * c.hidden_size, c.q_size + 2 * c.kv_size, bias=False)  # rows: W_Q, W_K, W_V
        self.o_proj = nn.Linear(c.q_size, c.hidden_size, bias=False)
        self.post_attn_norm = nn.Parameter(torch.ones(c.hidden_size))
        self.gate_up_proj = nn.Linear(c.hidden_size, 2 * c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)
        if c.qk_norm:
            self.q_norm = nn.Parameter(torch.ones(c.head_dim))
            self.k_norm = nn.Parameter(torch.ones(c.head_dim))

    def forward(
        self,
        embeds: torch.Tensor,  # [rows, Q, hidden] embed(x_p) of the new entries
        features: torch.Tensor,  # [rows, Q, hidden] g_{p-1} or the drafter's own o_{p-1}
        rope: tuple[torch.Tensor, torch.Tensor],  # cos, sin [rows, Q, 1, head_dim] at the entries' positions
        prefix_kv: KV,  # [rows, P, kv_heads, head_dim] x 2: entries attended to before the new ones
        mask: torch.Tensor,  # [rows, 1, Q, P + Q] bool, True = attend (keys: prefix, then the new entries)
    ) -> tuple[torch.Tensor, KV]:  # o_p [rows, Q, hidden], the new entries' keys/values [rows, Q, kvh, head_dim]
        c = self.config
        rows, q_len, _ = features.shape
        eps = c.rms_norm_eps
        x = torch.cat([rms_norm(embeds, self.embed_norm, eps), rms_norm(features, self.feature_norm, eps)], dim=-1)
        q, k, v = self.qkv_proj(x).split([c.q_size, c.kv_size, c.kv_size], dim=-1)
        q = q.view(rows, q_len, c.num_heads, c.head_dim)
        k = k.view(rows, q_len, c.num_kv_heads, c.head_dim)
        v = v.view(rows, q_len, c.num_kv_heads, c.head_dim)
        if c.qk_norm:
            q, k = rms_norm(q, self.q_norm, eps), rms_norm(k, self.k_norm, eps)
        q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        keys = torch.cat([prefix_kv[0], k], dim=1)  # [rows, P + Q, kv_heads, head_dim]
        values = torch.cat([prefix_kv[1], v], dim=1)
        group = c.num_heads // c.num_kv_heads  # query head h reads KV head h // group (as HF's repeat_kv)
        keys = keys.repeat_interleave(group, dim=2).transpose(1, 2)  # [rows, heads, P + Q, head_dim]
        values = values.repeat_interleave(group, dim=2).transpose(1, 2)
        attn = F.scaled_dot_product_attention(q.transpose(1, 2), keys, values, attn_mask=mask)  # [rows, heads, Q, head_dim]
        h = features + self.o_proj(attn.transpose(1, 2).reshape(rows, q_len, c.q_size))
        gate, up = self.gate_up_proj(rms_norm(h, self.post_attn_norm, eps)).chunk(2, dim=-1)
        return h + self.down_proj(F.silu(gate) * up), (k, v)


@dataclass
class TTTOutput:
    logits: torch.Tensor  # [rows, blocks_per_row, γ, V] step j's logits of x_j (teacher-forced tokens, own features)
    hidden: torch.Tensor  # [rows, blocks_per_row, γ, hidden] o_{t+j-1}, the drafter's own outputs (pre final norm)


class Eagle3Drafter(nn.Module):
    """Trainable: fc (feature fusion), the decoder layer, the final norm. Referenced, frozen: the
    target's embedding and LM head (`shared`)."""

    def __init__(self, config: Eagle3Config, *, shared: SharedWeights):
        super().__init__()
        c = self.config = config
        self.fc = nn.Linear(c.num_context_layers * c.hidden_size, c.hidden_size, bias=False)  # fuses m target layers
        self.layer = Eagle3Layer(c)
        self.final_norm = nn.Parameter(torch.ones(c.hidden_size))
        self.register_buffer("inv_freq", rope_inv_freq(c), persistent=False)  # [head_dim // 2], derived: not saved
        self.attach_shared(shared)

    def attach_shared(self, shared: SharedWeights) -> None:
        """Point the drafter at the target's embedding / LM head (not parameters, not saved)."""
        self.shared = checked_shared(shared, self.config)

    # ---- pieces ----------------------------------------------------------------------------

    def fuse(self, captured: torch.Tensor) -> torch.Tensor:
        # captured: [..., m, hidden] target layer outputs -> g = fc([H(l_1); ...; H(l_m)]) [..., hidden]
        return self.fc(captured.flatten(-2).float())

    @property
    def first_key_entry(self) -> int:
        """The first entry other entries attend to: 0, or 1 when the featureless entry 0 is not a
        key (entry_layout "feature", DeepSpec's drafters have no such entry; it still attends to
        itself, so its own row of the attention is never empty)."""
        return 1 if self.config.entry_layout == "feature" else 0

    def step(
        self,
        *,
        tokens: torch.Tensor,  # [rows, Q] int64 x_p of the new entries
        features: torch.Tensor,  # [rows, Q, hidden] their feature inputs
        positions: torch.Tensor,  # [rows, Q] int64 absolute positions p
        prefix_kv: KV,  # [rows, P, kv_heads, head_dim] x 2
        mask: torch.Tensor,  # [rows, 1, Q, P + Q] bool
    ) -> tuple[torch.Tensor, KV]:  # o_p [rows, Q, hidden], new keys/values [rows, Q, kv_heads, head_dim] x 2
        embeds = F.embedding(tokens, self.shared.embed).float()
        # entry_layout "feature": RoPE at the feature's position p - 1 (DeepSpec pairs target hidden
        # state i with token i + 1 at position i); attention is relative, but this keeps the bits close
        rope_positions = positions - 1 if self.config.entry_layout == "feature" else positions
        return self.layer(embeds, features, rope_cos_sin(rope_positions, self.inv_freq), prefix_kv, mask)

    def final_hidden(self, out: torch.Tensor) -> torch.Tensor:
        # out: [..., hidden] o_p -> RMSNorm(o_p), the LM head's input
        return rms_norm(out, self.final_norm, self.config.rms_norm_eps)

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        # out: [..., hidden] o_p -> [..., V] fp32 logits of x_{p+1} through the frozen shared LM head
        return self.final_hidden(out).float() @ self.shared.lm_head.float().t()

    def empty_kv(self, rows: int, *, device: torch.device | str = "cpu") -> KV:  # [rows, 0, kv_heads, head_dim] x 2
        c = self.config
        return tuple(torch.zeros(rows, 0, c.num_kv_heads, c.head_dim, device=device) for _ in range(2))

    # ---- training-time test ------------------------------------------------------------------

    def forward(self, batch: BlockBatch, *, context_token_ids: torch.Tensor, target_tokens: torch.Tensor) -> TTTOutput:
        """TTT over γ steps for every block of the batch (padding blocks included; mask them).

        context_token_ids: [rows, L + 1] int64, the tokens at positions 0..L of each row (L =
        batch.context's padded length, every anchor t <= L); target_tokens: [rows, nb, γ] int64
        x*_k = the token at t + k (teacher forcing of step k+1's token input)."""
        c = self.config
        self._check_batch(batch, context_token_ids)
        rows, ctx_len = batch.context.shape[:2]
        nb, gamma, device = batch.blocks_per_row, c.block_size, batch.context.device
        if tuple(target_tokens.shape) != (rows, nb, gamma):
            raise ValueError(f"target_tokens must be [rows, blocks_per_row, γ] = {[rows, nb, gamma]}, got {list(target_tokens.shape)}")
        n_entries = ctx_len + 1  # entries 0..L
        fused = self.fuse(batch.context)  # [rows, L, hidden] g_0..g_{L-1}
        features = torch.cat([fused.new_zeros(rows, 1, c.hidden_size), fused], dim=1)  # [rows, L+1, hidden]: g_{p-1}
        positions = torch.arange(n_entries, device=device)
        causal = torch.ones(n_entries, n_entries, dtype=torch.bool, device=device).tril()  # [L+1, L+1]
        causal[1:, : self.first_key_entry] = False  # entry_layout "feature": entry 0 is no other entry's key
        out, step1_kv = self.step(tokens=context_token_ids, features=features, positions=positions.expand(rows, -1),
                                  prefix_kv=self.empty_kv(rows, device=device), mask=causal.expand(rows, 1, -1, -1))
        anchors = batch.anchor_positions  # [rows, nb]
        own = out.gather(1, anchors.unsqueeze(-1).expand(-1, -1, c.hidden_size))  # [rows, nb, hidden] o_t
        outs = [own]
        # [rows, nb, L+1]: entries 0..t (1..t with entry_layout "feature")
        context_ok = (positions.view(1, 1, -1) <= anchors.unsqueeze(-1)) & (positions >= self.first_key_entry)
        same_block = torch.eye(nb, dtype=torch.bool, device=device)  # [nb, nb]
        chain_k: list[torch.Tensor] = []
        chain_v: list[torch.Tensor] = []
        for j in range(2, gamma + 1):
            # keys: step-1 entries, then the chain entries of steps 2..j in (step, block) order
            prefix = (torch.cat([step1_kv[0], *chain_k], dim=1), torch.cat([step1_kv[1], *chain_v], dim=1))
            chain_ok = same_block.repeat(1, j - 1).expand(rows, -1, -1)  # [rows, nb, (j-1) * nb]
            mask = torch.cat([context_ok, chain_ok], dim=-1).unsqueeze(1)  # [rows, 1, nb, L+1 + (j-1) nb]
            own, (k, v) = self.step(tokens=target_tokens[..., j - 2], features=own, positions=anchors + (j - 1),
                                    prefix_kv=prefix, mask=mask)
            chain_k.append(k)
            chain_v.append(v)
            outs.append(own)
        hidden = torch.stack(outs, dim=2)  # [rows, nb, γ, hidden]
        return TTTOutput(logits=self.logits(hidden), hidden=hidden)

    def _check_batch(self, batch: BlockBatch, context_token_ids: torch.Tensor) -> None:
        c = self.config
        m, d = c.num_context_layers, c.hidden_size
        if batch.context.dim() != 4 or tuple(batch.context.shape[2:]) != (m, d):
            raise ValueError(f"batch.context must be [rows, ctx_len, m={m}, hidden={d}], got {list(batch.context.shape)}")
        rows, ctx_len = batch.context.shape[:2]
        if tuple(context_token_ids.shape) != (rows, ctx_len + 1):
            raise ValueError(f"context_token_ids must be [rows, ctx_len + 1] = {[rows, ctx_len + 1]}, got {list(context_token_ids.shape)}")
        pos, lens, valid = batch.anchor_positions, batch.context_lens.unsqueeze(1), batch.block_valid
        if bool((valid & ((pos < 0) | (pos > lens))).any()):
            raise ValueError(f"valid anchors need 0 <= t <= context length of their row; got anchors {pos[valid].tolist()}")
        if context_token_ids.numel() and (int(context_token_ids.min()) < 0 or int(context_token_ids.max()) >= c.vocab_size):
            raise ValueError(f"token ids must be in [0, {c.vocab_size})")
        at_anchor = context_token_ids.gather(1, pos.clamp(0, ctx_len))  # [rows, nb]
        if bool((valid & (at_anchor != batch.anchor_tokens)).any()):
            raise ValueError("context_token_ids disagree with the blocks' anchor tokens at the anchor positions")


__all__ = ["Eagle3Drafter", "Eagle3Layer", "TTTOutput", "rope_cos_sin"]
