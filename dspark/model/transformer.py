"""A Llama/Qwen-family decoder with a flattened, variable-length forward over many requests.

One call runs the tokens of many requests at once (vLLM v1 style): the token-wise parts
(embeddings, projections, MLP, norms) see one `[num_tokens, hidden]` matrix, so a verifier
batch of R requests with 1..γ+1 query tokens each costs one matmul per weight with no padding.
Attention is one kernel call per layer too (dspark/model/attention.py): every token attends to
its own request's KV cache (the prefix already cached + its new tokens, causally), with a
result that does not depend on the rest of the batch.

Precision: linear layers run in `compute_dtype` (bf16 is ~2-3x faster than fp32 on this CPU
from B≈8 up); the residual stream, norms, RoPE, softmax and the LM head stay fp32 so the
probabilities the rejection sampler sees are not rounded to bf16's 8 bits of mantissa.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from dspark.model import attention, compact_weights, fused_ops, layer_loop
from dspark.model.config import ModelConfig
from dspark.model.kv_cache import RequestKV


@dataclass
class AttentionMetadata:
    """Where each request's tokens sit in the flattened batch and in its KV cache."""

    caches: list[RequestKV]  # one per request, in batch order
    query_lens: list[int]  # tokens of each request in this forward
    context_lens: list[int]  # tokens already cached before this forward
    masks: list[torch.Tensor | None]  # [query_len, context_len + query_len] bool, None when query_len == 1

    @classmethod
    def build(cls, caches: list[RequestKV], query_lens: list[int]) -> "AttentionMetadata":
        context_lens = [c.length for c in caches]
        device = caches[0].keys.device if caches else torch.device("cpu")
        masks = []
        for q_len, ctx_len in zip(query_lens, context_lens):
            if q_len == 1 or ctx_len > 0:  # single queries see their whole prefix: no mask needed
                masks.append(None)
                continue
            # query i sits at absolute position ctx_len + i and sees keys at positions <= it
            rows = torch.arange(q_len, device=device).unsqueeze(1) + ctx_len
            masks.append(torch.arange(ctx_len + q_len, device=device).unsqueeze(0) <= rows)
        return cls(caches=caches, query_lens=query_lens, context_lens=context_lens, masks=masks)

    @property
    def num_tokens(self) -> int:
        return sum(self.query_lens)

    @property
    def device(self) -> torch.device:  # where the caches, hence the forward, live
        return self.caches[0].keys.device

    def positions(self) -> torch.Tensor:  # [num_tokens] int64
        host = torch.cat([torch.arange(c, c + q) for c, q in zip(self.context_lens, self.query_lens)])
        return host.to(self.device, non_blocking=True)

    def varlen_plan(self) -> "VarlenPlan":
        """The padded-batch index arrays of the "varlen" attention, built once per forward."""
        if "_varlen_plan" not in self.__dict__:
            self.__dict__["_varlen_plan"] = VarlenPlan.build(self)
        return self.__dict__["_varlen_plan"]

    def kernel_plan(self) -> "KernelPlan | None":
        """The batched kernel's index arrays, built once per forward and shared by all layers;
        None where the kernel cannot serve this batch (K/V not contiguous fp32 on the CPU)."""
        if "_kernel_plan" not in self.__dict__:
            ok = all(t.dtype == torch.float32 and t.device.type == "cpu" and t.is_contiguous()
                     for c in self.caches for t in (c.keys, c.values))
            self.__dict__["_kernel_plan"] = KernelPlan.build(self) if ok else None
        return self.__dict__["_kernel_plan"]


@dataclass
class KernelPlan:
    table: attention.CacheTable
    tok_req: torch.Tensor  # [num_tokens] int64 request of each token
    tok_pos: torch.Tensor  # [num_tokens] int64 its position in that request's cache
    row_prefix: torch.Tensor  # [num_tokens] int64 keys each token attends to: its own causal prefix
    rows: torch.Tensor  # [num_tokens] int64 0..num_tokens-1: every token is a query row

    @classmethod
    def build(cls, meta: AttentionMetadata) -> "KernelPlan":
        table = attention.CacheTable([c.keys for c in meta.caches], [c.values for c in meta.caches])
        req = torch.repeat_interleave(torch.arange(len(meta.caches)), torch.tensor(meta.query_lens))  # [num_tokens]
        pos = meta.positions()  # [num_tokens]
        return cls(table=table, tok_req=req, tok_pos=pos, row_prefix=pos + 1, rows=torch.arange(pos.shape[0]))


@dataclass
class VarlenPlan:
    """Where each token sits in a padded [num_requests, max_query_len] layout, and which keys
    each padded query row sees: what one SDPA call over the whole batch needs (any device)."""

    token_rows: torch.Tensor  # [num_tokens] int64 flat index r * max_query_len + i of each token
    mask: torch.Tensor  # [num_requests, 1, max_query_len, max_total_len] bool: query i of request r sees key j
    max_query_len: int
    max_total_len: int

    @classmethod
    def build(cls, meta: AttentionMetadata) -> "VarlenPlan":
        q_lens = torch.tensor(meta.query_lens)  # [R]
        ctx = torch.tensor(meta.context_lens)  # [R]
        max_q, max_total = int(q_lens.max()), int((q_lens + ctx).max())
        req = torch.repeat_interleave(torch.arange(len(meta.query_lens)), q_lens)  # [num_tokens]
        first = torch.cumsum(q_lens, 0) - q_lens  # [R] first token of each request
        within = torch.arange(req.shape[0]) - first[req]  # [num_tokens] i of each token in its request
        i = torch.arange(max_q).view(1, max_q, 1)  # query row
        j = torch.arange(max_total).view(1, 1, max_total)  # key position
        total = (ctx + q_lens).view(-1, 1, 1)
        # query i sits at position ctx_r + i and sees keys j <= it; a padding row (i >= q_r) sees
        # the request's whole prefix, so no row of the softmax is empty (its output is dropped)
        mask = (j <= ctx.view(-1, 1, 1) + i) & (j < total)  # [R, max_q, max_total]
        device = meta.device
        return cls(token_rows=(req * max_q + within).to(device), mask=mask.unsqueeze(1).to(device),
                   max_query_len=max_q, max_total_len=max_total)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # x: [..., dim] fp32; x / sqrt(mean(x²) + eps) * weight, one fused op
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:  # [head_dim // 2]
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    rs = config.rope_scaling
    if rs is not None:  # Llama 3.1 frequency-dependent scaling
        factor, low, high = rs["factor"], rs["low_freq_factor"], rs["high_freq_factor"]
        old_ctx = rs["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        smooth = (old_ctx / wavelen - low) / (high - low)
        scaled = torch.where(wavelen > old_ctx / low, inv_freq / factor, inv_freq)
        mid = (wavelen <= old_ctx / low) & (wavelen >= old_ctx / high)
        inv_freq = torch.where(mid, (1 - smooth) * inv_freq / factor + smooth * inv_freq, scaled)
    return inv_freq.float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: [num_tokens, heads, head_dim]; cos, sin: [num_tokens, 1, head_dim] (rotate-half layout, as HF)
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


MAX_REDUCTION = 1024  # longest K a bf16 GEMM here reduces in one piece, whatever the batch size
PACK_HINT_BF16 = int(os.environ.get("DSPARK_PACK_HINT_BF16", "1"))  # oneDNN batch-size hint of bf16 weights (SplitKLinear.prepack)


class SplitKLinear(nn.Module):
    """y = x Wᵀ, batch-invariant: row i of the result does not depend on how many rows are in x.

    oneDNN's bf16 GEMM on this CPU gives bit-identical rows for any M as long as the reduction
    length K is at most 1024 (checked for M = 1..300, 1 and 2 threads); above that its K-blocking
    changes with M. Plain decoding (M = 1) and batched verification (M = Σ(1+ℓ_r)) must produce
    the same bits, or bf16 rounding flips propagate into different greedy tokens. So a long
    reduction is split into equal K-chunks of at most 1024 whose fp32 partials are summed in a
    fixed order.
    """

    def __init__(self, in_features: int, out_features: int, *, bias: bool, dtype: torch.dtype):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        num_chunks = -(-in_features // MAX_REDUCTION)
        self.bounds = [round(i * in_features / num_chunks) for i in range(num_chunks + 1)]
        self.weight_chunks = nn.ParameterList(
            nn.Parameter(torch.empty(out_features, hi - lo, dtype=dtype)) for lo, hi in zip(self.bounds, self.bounds[1:])
        )
        self.bias = nn.Parameter(torch.zeros(out_features, dtype=torch.float32)) if bias else None

    @property
    def dtype(self) -> torch.dtype:
        return self.weight_chunks[0].dtype

    @torch.no_grad()
    def load(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        # weight: [out_features, in_features]
        if tuple(weight.shape) != (self.out_features, self.in_features):
            raise ValueError(f"weight shape {tuple(weight.shape)} != {(self.out_features, self.in_features)}")
        for chunk, lo, hi in zip(self.weight_chunks, self.bounds, self.bounds[1:]):
            chunk.copy_(weight[:, lo:hi])
        if self.bias is not None:
            self.bias.copy_(bias)

    def prepack(self) -> None:
        """Pre-reorder the weights into oneDNN's blocked layout once (what inductor does when
        freezing): bf16 GEMMs 25-40% faster here at B = 1..8 with bit-identical results, fp32
        ones much faster than MKL from B = 2 up.

        The batch-size hint picks the layout, and the layout decides batch invariance. On an AMX
        Xeon (torch 2.13), bf16 weights packed for batch 8 (or 64) give rows for M >= 33 that
        differ from M <= 32 in the last bit (oneDNN switches kernels there); packed for batch 1
        every M = 1..512 gives the M = 1 bits, at 1 and 2 threads, and M = 1..8 is as fast or
        faster. fp32 weights are the other way round (hint 1 varies from M = 2, hint 8 does not).
        tests/model/test_transformer.py checks both at the shapes of the models here."""
        self.packed = None
        if self.weight_chunks[0].device.type != "cpu" or not torch.backends.mkldnn.is_available():
            return
        hint = PACK_HINT_BF16 if self.dtype == torch.bfloat16 else 8
        try:
            self.packed = [torch.ops.mkldnn._reorder_linear_weight(w.detach(), hint) for w in self.weight_chunks]
        except (AttributeError, RuntimeError):  # a torch build without oneDNN: plain F.linear
            self.packed = None

    def partial(self, x: torch.Tensor, i: int) -> torch.Tensor:
        """The product of K-chunk i: x [num_tokens, bounds[i+1] - bounds[i]] contiguous, in
        `dtype` -> [num_tokens, out_features] in `dtype` (no bias)."""
        packed = getattr(self, "packed", None)
        if packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, packed[i], None, "none", [], "")
        return F.linear(x, self.weight_chunks[i])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [num_tokens, in_features] -> [num_tokens, out_features] in the compute dtype, or fp32
        # when the reduction was split (its partials are summed in fp32) or there is a bias.
        # Callers add the result into the fp32 residual stream, where type promotion upcasts it
        # inside the add: no separate conversion pass over large activations.
        x = x.to(self.dtype)
        if len(self.weight_chunks) == 1:
            y = self.partial(x, 0)
        else:
            y = sum(
                self.partial(x[:, lo:hi].contiguous(), i).float()
                for i, (lo, hi) in enumerate(zip(self.bounds, self.bounds[1:]))
            )
        return y if self.bias is None else y + self.bias


ATTENTION_MODES = ("batched", "per-row", "varlen")


class DecoderLayer(nn.Module):
    attention = "per-row"  # set by Transformer.set_attention

    def __init__(self, config: ModelConfig, compute_dtype: torch.dtype):
        super().__init__()
        c = config
        self.config = c
        self.input_norm = nn.Parameter(torch.ones(c.hidden_size))
        self.post_attn_norm = nn.Parameter(torch.ones(c.hidden_size))
        # q, k and v fused into one matmul; gate and up fused into another (fewer, larger GEMMs).
        self.qkv_proj = SplitKLinear(c.hidden_size, c.q_size + 2 * c.kv_size, bias=c.attention_bias, dtype=compute_dtype)
        self.o_proj = SplitKLinear(c.q_size, c.hidden_size, bias=False, dtype=compute_dtype)
        self.gate_up_proj = SplitKLinear(c.hidden_size, 2 * c.intermediate_size, bias=False, dtype=compute_dtype)
        self.down_proj = SplitKLinear(c.intermediate_size, c.hidden_size, bias=False, dtype=compute_dtype)
        if c.qk_norm:
            self.q_norm = nn.Parameter(torch.ones(c.head_dim))
            self.k_norm = nn.Parameter(torch.ones(c.head_dim))

    def forward(
        self,
        x: torch.Tensor,  # [num_tokens, hidden] fp32 residual stream
        cos: torch.Tensor,  # [num_tokens, 1, head_dim]
        sin: torch.Tensor,  # [num_tokens, 1, head_dim]
        layer_idx: int,
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [num_tokens, hidden] fp32
        c = self.config
        n = x.shape[0]
        h = rms_norm(x, self.input_norm, c.rms_norm_eps)
        qkv = self.qkv_proj(h)  # [num_tokens, q_size + 2 * kv_size], compute dtype
        qk = qkv[:, : c.q_size + c.kv_size].view(n, c.num_heads + c.num_kv_heads, c.head_dim)
        v = qkv[:, c.q_size + c.kv_size :].view(n, c.num_kv_heads, c.head_dim)  # upcast when cached
        if c.qk_norm:
            qk = qk.float()
            qk = torch.cat([rms_norm(qk[:, : c.num_heads], self.q_norm, c.rms_norm_eps),
                            rms_norm(qk[:, c.num_heads :], self.k_norm, c.rms_norm_eps)], dim=1)
        qk = apply_rope(qk, cos, sin)  # q and k heads rotated in one pass; fp32 out (cos, sin are fp32)
        q, k = qk[:, : c.num_heads], qk[:, c.num_heads :]
        attn = self._attend(q, k, v, layer_idx, meta)  # [num_tokens, q_size]
        x = x + self.o_proj(attn)
        h = rms_norm(x, self.post_attn_norm, c.rms_norm_eps)
        gate, up = self.gate_up_proj(h).chunk(2, dim=-1)  # [num_tokens, intermediate] each, compute dtype
        return x + self.down_proj(F.silu(gate) * up)

    def _attend(self, q, k, v, layer_idx: int, meta: AttentionMetadata) -> torch.Tensor:
        # q, k: [num_tokens, heads or kv_heads, head_dim] fp32; v: [num_tokens, kv_heads, head_dim] (cached as fp32)
        if self.attention == "batched" and meta.kernel_plan() is not None:
            return self._attend_batched(q, k, v, layer_idx, meta)
        if self.attention == "varlen":
            return self._attend_varlen(q, k, v, layer_idx, meta)
        # The per-row path: a Python loop over requests, and over the rows of continuing ones.
        c = self.config
        out = torch.empty(q.shape[0], c.num_heads, c.head_dim, dtype=q.dtype, device=q.device)
        start = 0
        for cache, q_len, ctx_len, mask in zip(meta.caches, meta.query_lens, meta.context_lens, meta.masks):
            end = start + q_len
            total = ctx_len + q_len
            k_cache = cache.keys[layer_idx]  # [kv_heads, capacity, head_dim]
            v_cache = cache.values[layer_idx]
            k_cache[:, ctx_len:total] = k[start:end].transpose(0, 1)
            v_cache[:, ctx_len:total] = v[start:end].transpose(0, 1)
            if ctx_len == 0:  # prefill: one causal SDPA over the prompt
                out[start:end] = attention.grouped_attention(q[start:end], k_cache[:, :total], v_cache[:, :total], mask)
            else:
                # Continuing requests attend row by row, each query exactly as plain decoding
                # computes it (one query over its causal prefix). A multi-row SDPA rounds
                # differently (different kernel blocking), and in bf16 that 1-ulp difference
                # flips later roundings and, at near-ties, greedy tokens: verification would
                # no longer reproduce plain decoding bit for bit.
                out[start:end] = attention.per_row_attention(q[start:end], k_cache, v_cache, ctx_len)
            start = end
        return out.view(q.shape[0], c.q_size)

    def _attend_varlen(self, q, k, v, layer_idx: int, meta: AttentionMetadata) -> torch.Tensor:
        # q, k: [num_tokens, heads or kv_heads, head_dim] fp32; v: [num_tokens, kv_heads, head_dim]
        # One SDPA call for the whole batch over a padded [R, heads, max_q, max_total] layout,
        # the GPU path (flash / memory-efficient kernels take the boolean mask). NOT
        # batch-invariant: a row's rounding depends on the padded shape, so speculative greedy
        # output can differ from plain decoding at near-ties (bit-exact rejection sampling still
        # holds with respect to the logits this forward computed). The per-request K/V copies
        # are R small copies per layer: a paged pool with one gather is the next step.
        c = self.config
        plan = meta.varlen_plan()
        r = len(meta.caches)
        keys = q.new_zeros(r, c.num_kv_heads, plan.max_total_len, c.head_dim)  # [R, kv_heads, max_total, head_dim]
        values = torch.zeros_like(keys)
        start = 0
        for i, (cache, q_len, ctx_len) in enumerate(zip(meta.caches, meta.query_lens, meta.context_lens)):
            end, total = start + q_len, ctx_len + q_len
            cache.keys[layer_idx][:, ctx_len:total] = k[start:end].transpose(0, 1)
            cache.values[layer_idx][:, ctx_len:total] = v[start:end].transpose(0, 1)
            keys[i, :, :total] = cache.keys[layer_idx][:, :total]
            values[i, :, :total] = cache.values[layer_idx][:, :total]
            start = end
        padded = q.new_zeros(r * plan.max_query_len, c.num_heads, c.head_dim)  # [R * max_q, heads, head_dim]
        padded[plan.token_rows] = q
        padded = padded.view(r, plan.max_query_len, c.num_heads, c.head_dim).transpose(1, 2)  # [R, heads, max_q, head_dim]
        out = F.scaled_dot_product_attention(padded, keys, values, attn_mask=plan.mask,
                                             enable_gqa=c.num_heads != c.num_kv_heads)  # [R, heads, max_q, head_dim]
        out = out.transpose(1, 2).reshape(r * plan.max_query_len, c.q_size)
        return out[plan.token_rows]  # [num_tokens, q_size]

    def _attend_batched(self, q, k, v, layer_idx: int, meta: AttentionMetadata) -> torch.Tensor:
        # q, k: [num_tokens, heads or kv_heads, head_dim] fp32; v: [num_tokens, kv_heads, head_dim]
        # One kernel call writes every token's K/V into its cache and one attends every token of
        # every request (prefill, decode and verification rows together), each over its own
        # causal prefix with arithmetic that no other row affects: batch-invariant by
        # construction. Prefill too: a padded multi-request SDPA would round by the batch's
        # shape, and the kernel is ~2x faster than the masked SDPA here (200- and 1000-token
        # prompts; SDPA's causal flash path, unusable with the grouped-rows layout, about ties).
        c = self.config
        plan = meta.kernel_plan()
        out = torch.empty(q.shape[0], c.num_heads, c.head_dim, dtype=torch.float32)  # [num_tokens, heads, head_dim]
        attention.write_kv(plan.table, layer_idx, k, v.float(), plan.tok_req, plan.tok_pos)
        attention.attend_rows(plan.table, layer_idx, q, out, plan.rows, plan.tok_req, plan.row_prefix, c.num_kv_heads)
        return out.view(q.shape[0], c.q_size)


class Transformer(nn.Module):
    def __init__(self, config: ModelConfig, *, compute_dtype: torch.dtype = torch.bfloat16):
        super().__init__()
        # built on the CPU; `from_dir(device=...)` / `.to(device)` then `set_attention` move it
        self.config = config
        self.compute_dtype = compute_dtype
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size)  # fp32: also the LM head when tied
        self.layers = nn.ModuleList(DecoderLayer(config, compute_dtype) for _ in range(config.num_layers))
        self.final_norm = nn.Parameter(torch.ones(config.hidden_size))
        self.lm_head = None if config.tie_word_embeddings else nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.register_buffer("inv_freq", rope_inv_freq(config), persistent=False)
        self.compact = False  # linear layers (and the LM head) on compact exact weights: use_compact_weights
        self.int8_activations = False  # with compact: the Q4_1 / Q8_0 weights take int8 activations (compact-int8)
        self.set_attention(os.environ.get("DSPARK_ATTENTION", "batched"))
        self.set_fused(os.environ.get("DSPARK_FUSED", "1") != "0")

    def set_attention(self, mode: str) -> str:
        """How continuing rows attend: "batched" (one kernel call per layer for all of them,
        dspark/model/attention.py) or "per-row" (one 1-row SDPA per row, the old path). Both are
        batch-invariant but round differently: switch only between generations, never within
        one. "batched" falls back to "per-row" where the kernel cannot be built. "varlen" (one
        SDPA per layer over the padded batch, any device, not batch-invariant) is the mode off
        the CPU, where the kernel does not run: "batched" there means "varlen". Returns the mode
        in use."""
        if mode not in ATTENTION_MODES:
            raise ValueError(f"attention mode must be one of {list(ATTENTION_MODES)}, got {mode!r}")
        self.attention_requested = mode
        if mode == "batched" and self.embed.weight.device.type != "cpu":
            mode = "varlen"
        if mode == "batched" and not attention.kernel_available(self.config.head_dim):
            mode = "per-row"
        self.attention = mode
        for layer in self.layers:
            layer.attention = mode
        return mode

    def fused_supported(self) -> bool:
        """Whether the fused layer kernels (dspark/model/fused_ops.py) serve this model: bf16 or
        compact linear layers without biases or q/k norms, hidden size <= MAX_REDUCTION (the qkv
        and gate/up GEMMs in one K-chunk, so their outputs are in the layers' dtype); the eager
        path handles the rest (dense fp32 included: oneDNN's fp32 GEMM output is fp32 too, but
        that path has not been needed since compact weights)."""
        c = self.config
        dtype_ok = self.compact or self.compute_dtype == torch.bfloat16
        on_cpu = self.embed.weight.device.type == "cpu"  # the fused kernels are C++ on host memory
        return (dtype_ok and on_cpu and not c.attention_bias and not c.qk_norm
                and c.hidden_size <= MAX_REDUCTION and c.head_dim % 2 == 0 and fused_ops.available())

    def set_fused(self, on: bool) -> bool:
        """Run the per-token ops between the GEMMs as three fused C++ kernels per step
        (add + RMSNorm, RoPE + q/k/v split, SiLU * up) instead of ~150 torch ops per layer.
        Both paths are batch-invariant but round differently (RMSNorm's reduction order, one
        bf16 rounding of silu * up instead of two): switch only between generations. Falls back
        to the torch ops where unsupported; returns whether the fused path is in use."""
        self.fused_requested = bool(on)
        self.fused = bool(on) and self.fused_supported()
        return self.fused

    @property
    def lm_head_weight(self) -> torch.Tensor:  # [vocab, hidden] fp32
        return self.embed.weight if self.lm_head is None else self.lm_head.weight

    @torch.no_grad()
    def use_compact_weights(self, *, int8_activations: bool = False) -> bool:
        """Hold every linear layer and the LM head in an exact compact block format
        (dspark/model/compact_weights.py), all or nothing: True when every one of them has a
        format that reproduces its fp32 weights bit for bit (a model whose weights came from a
        GGUF file, as the default one), False (nothing changed) otherwise. Needs fp32 linear
        layers (their weights are the exact values). The dense weights are dropped: the default
        model then holds ~110 MB of GEMM weights instead of 537 MB (fp32) or 325 MB (bf16
        layers, fp32 head) and streams 3-5x fewer bytes per step.

        int8_activations: the Q4_1 and Q8_0 weights, the LM head's included, take int8
        activations (dspark/model/int8_activations.py: the `compact-int8` numerics, not exact);
        logits are still fp32 sums (of exact integer block products), never rounded."""
        if self.compute_dtype != torch.float32 or self.config.attention_bias or not compact_weights.available():
            return False
        formats = ("q4_1", "q8_0")  # bf16 blocks: oneDNN's bf16 GEMM reads the same bytes, faster from M = 8
        found: dict[tuple[int, str], compact_weights.CompactWeight] = {}
        for i, layer in enumerate(self.layers):
            for name in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"):
                linear = getattr(layer, name)
                cw = compact_weights.compact(torch.cat(list(linear.weight_chunks), dim=1), formats)
                if cw is None:
                    return False
                found[i, name] = cw
        head = compact_weights.compact(self.lm_head_weight, formats)
        if head is None:
            return False
        for (i, name), cw in found.items():
            if int8_activations:
                cw = compact_weights.with_int8_activations(cw)
            setattr(self.layers[i], name, compact_weights.CompactLinear(cw))
        if int8_activations:
            head = compact_weights.with_int8_activations(head)
        self.__dict__["lm_head_packed"] = compact_weights.CompactLinear(head)
        self.compact = True
        self.int8_activations = int8_activations
        self.set_fused(self.fused_requested)
        return True

    def prepare_for_inference(self) -> None:
        """Pre-reorder every GEMM weight into oneDNN's blocked layout, the LM head included
        (kept fp32). On this CPU the packed fp32 LM head is also batch-invariant, which MKL's
        sgemm is not, and 4x faster at 8 rows (20.6 -> 4.6 ms)."""
        c = self.config
        if self.embed.weight.device.type != "cpu":  # oneDNN packing is CPU-only: cuBLAS reads the weights as they are
            self.__dict__.pop("lm_head_packed", None)
            return
        if self.compact:  # the compact head of use_compact_weights stays
            head = self.__dict__["lm_head_packed"]
        else:
            head = SplitKLinear(c.hidden_size, c.vocab_size, bias=False, dtype=torch.float32)
            head.load(self.lm_head_weight.detach())
            self.__dict__["lm_head_packed"] = head  # not a registered submodule: not saved, not a parameter
        for module in [*self.modules(), head]:
            if isinstance(module, SplitKLinear):
                module.prepack()

    def forward(
        self,
        token_ids: torch.Tensor,  # [num_tokens] int64
        positions: torch.Tensor,  # [num_tokens] int64
        meta: AttentionMetadata,
        capture_layers: tuple[int, ...] = (),
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Returns the final normed hidden states [num_tokens, hidden] (the LM head's input) and,
        if `capture_layers` is set, the outputs of those decoder layers [num_tokens, len(capture_layers), hidden]."""
        if self.fused:
            return self._forward_fused(token_ids, positions, meta, capture_layers)
        x = self.embed(token_ids)  # [num_tokens, hidden]
        freqs = positions.float().unsqueeze(1) * self.inv_freq  # [num_tokens, head_dim // 2]
        emb = torch.cat((freqs, freqs), dim=-1).unsqueeze(1)  # [num_tokens, 1, head_dim]
        cos, sin = emb.cos(), emb.sin()
        captured = []
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, i, meta)
            if i in capture_layers:
                captured.append(x)
        hidden = rms_norm(x, self.final_norm, self.config.rms_norm_eps)
        if capture_layers:
            order = sorted(capture_layers)
            stacked = torch.stack([captured[order.index(l)] for l in capture_layers], dim=1)
            return hidden, stacked
        return hidden, None

    def native_layer_loop(self) -> "layer_loop.LayerLoop | None":
        """The C++ layer loop (dspark/model/layer_loop.py) where it serves this model (compact,
        fused, batched attention; DSPARK_LAYER_LOOP unset or 1): the same kernel calls as
        _forward_fused's Python loop, bit for bit, without ~4 ms a step of Python. Rebuilt when
        the mode it depends on changes."""
        key = (self.compact, self.fused, self.attention, layer_loop.enabled())
        cached = self.__dict__.get("_layer_loop")
        if cached is None or cached[0] != key:
            loop = layer_loop.LayerLoop.for_model(self) if layer_loop.enabled() else None
            self.__dict__["_layer_loop"] = cached = (key, loop)
        return cached[1]

    def _forward_fused(self, token_ids, positions, meta, capture_layers):
        # The same computation as forward() with the ops between GEMMs fused (fused_ops.py).
        loop, plan = self.native_layer_loop(), meta.kernel_plan()
        if loop is not None and plan is not None:
            x = self.embed(token_ids)  # [num_tokens, hidden] fp32, a fresh tensor
            freqs = positions.float().unsqueeze(1) * self.inv_freq  # [num_tokens, head_dim // 2]
            return loop.run(x, freqs.cos(), freqs.sin(), self.final_norm, plan, tuple(capture_layers))
        # The residual x is updated in place; h, q, k, v and act are reused by every layer
        # (each is consumed before the next layer overwrites it). GEMM inputs and outputs are in
        # the linear layers' dtype: bf16 for dense bf16 weights, fp32 for compact ones.
        c = self.config
        n = token_ids.shape[0]
        act_dtype = self.layers[0].qkv_proj.dtype
        x = self.embed(token_ids)  # [num_tokens, hidden] fp32, a fresh tensor
        freqs = positions.float().unsqueeze(1) * self.inv_freq  # [num_tokens, head_dim // 2]
        cos, sin = freqs.cos(), freqs.sin()  # once per forward, shared by all layers
        h = torch.empty(n, c.hidden_size, dtype=act_dtype)  # [num_tokens, hidden] normed GEMM input
        q = torch.empty(n, c.num_heads, c.head_dim)  # [num_tokens, heads, head_dim] fp32
        k = torch.empty(n, c.num_kv_heads, c.head_dim)  # [num_tokens, kv_heads, head_dim] fp32
        v = torch.empty(n, c.num_kv_heads, c.head_dim)
        act = torch.empty(n * c.intermediate_size, dtype=act_dtype)  # silu(gate) * up, chunk-major
        eps = c.rms_norm_eps
        layers = self.layers
        fused_ops.add_rms_norm(x, [], layers[0].input_norm, eps, h)
        captured = {}
        for i, layer in enumerate(layers):
            qkv = layer.qkv_proj.partial(h, 0)  # [num_tokens, q_size + 2 kv_size] (K = hidden: one chunk)
            fused_ops.rope_split(qkv, cos, sin, q, k, v)
            attn = layer._attend(q, k, v, i, meta)  # [num_tokens, q_size] fp32
            o_proj = layer.o_proj
            attn = attn.to(act_dtype)
            o = [o_proj.partial(attn[:, lo:hi].contiguous() if len(o_proj.bounds) > 2 else attn, j)
                 for j, (lo, hi) in enumerate(zip(o_proj.bounds, o_proj.bounds[1:]))]  # K-chunk partials
            fused_ops.add_rms_norm(x, o, layer.post_attn_norm, eps, h)  # x += o; h = norm(x)
            gate_up = layer.gate_up_proj.partial(h, 0)  # [num_tokens, 2 intermediate]
            down = layer.down_proj
            fused_ops.silu_mul(gate_up, down.bounds, act)
            parts = [down.partial(act[n * lo : n * hi].view(n, hi - lo), j)  # [num_tokens, hidden] each
                     for j, (lo, hi) in enumerate(zip(down.bounds, down.bounds[1:]))]
            last = i + 1 == len(layers)
            out = torch.empty(n, c.hidden_size) if last else h  # the final norm's output stays fp32
            fused_ops.add_rms_norm(x, parts, self.final_norm if last else layers[i + 1].input_norm, eps, out)
            if i in capture_layers:
                captured[i] = x.clone()  # x changes in place from here on
        hidden = out  # [num_tokens, hidden] fp32
        if capture_layers:
            return hidden, torch.stack([captured[l] for l in capture_layers], dim=1)
        return hidden, None

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # hidden: [n, hidden] -> [n, vocab] fp32 (never bf16: rounding logits to 8 mantissa bits
        # would move probabilities by several percent and create false ties at temperature 0)
        head = self.__dict__.get("lm_head_packed")
        if head is not None:
            return head(hidden)
        return hidden.float() @ self.lm_head_weight.t()

    # ---- weights -------------------------------------------------------------------------

    @torch.no_grad()
    def load_hf_state_dict(self, sd: dict[str, torch.Tensor]) -> None:
        """Load weights named as in Hugging Face Llama/Qwen checkpoints (fusing qkv and gate/up)."""

        def take(name: str) -> torch.Tensor:
            if name not in sd:
                raise KeyError(f"checkpoint has no tensor {name!r}")
            return sd[name]

        self.embed.weight.copy_(take("model.embed_tokens.weight"))
        self.final_norm.copy_(take("model.norm.weight"))
        if self.lm_head is not None:
            self.lm_head.weight.copy_(take("lm_head.weight"))
        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}."
            layer.input_norm.copy_(take(p + "input_layernorm.weight"))
            layer.post_attn_norm.copy_(take(p + "post_attention_layernorm.weight"))
            qkv = torch.cat([take(p + f"self_attn.{n}_proj.weight") for n in "qkv"], dim=0)
            qkv_bias = torch.cat([take(p + f"self_attn.{n}_proj.bias") for n in "qkv"]) if self.config.attention_bias else None
            layer.qkv_proj.load(qkv, qkv_bias)
            layer.o_proj.load(take(p + "self_attn.o_proj.weight"))
            layer.gate_up_proj.load(torch.cat([take(p + "mlp.gate_proj.weight"), take(p + "mlp.up_proj.weight")], dim=0))
            layer.down_proj.load(take(p + "mlp.down_proj.weight"))
            if self.config.qk_norm:
                layer.q_norm.copy_(take(p + "self_attn.q_norm.weight"))
                layer.k_norm.copy_(take(p + "self_attn.k_norm.weight"))

    @classmethod
    def from_dir(cls, model_dir: str | Path, *, compute_dtype: torch.dtype = torch.bfloat16,
                 compact: bool = False, int8_activations: bool = False,
                 device: torch.device | str = "cpu") -> "Transformer":
        """compact: with fp32 compute, hold the weights compact where every layer has an exact
        format (use_compact_weights; `model.compact` says whether it happened; CPU only);
        int8_activations: with compact, the Q4_1 layers take int8 activations (use_compact_weights).
        device: where the weights live; off the CPU, attention is "varlen" and the fused CPU
        kernels are off."""
        from safetensors.torch import load_file

        model_dir = Path(model_dir)
        files = sorted(model_dir.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"no *.safetensors weights in {model_dir}")
        sd: dict[str, torch.Tensor] = {}
        for f in files:
            sd.update(load_file(f))
        model = cls(ModelConfig.from_dir(model_dir), compute_dtype=compute_dtype)
        model.load_hf_state_dict(sd)
        del sd
        model.eval().requires_grad_(False)
        device = torch.device(device)
        if device.type != "cpu":
            if compact:
                raise ValueError(f"compact weights run on the CPU only, not on {device}")
            return model.place_on(device)
        if compact:
            model.use_compact_weights(int8_activations=int8_activations)
        model.prepare_for_inference()
        return model

    def place_on(self, device: torch.device | str) -> "Transformer":
        """Move the weights to `device` and set the modes that run there: off the CPU, "varlen"
        attention (for a requested "batched") and no fused CPU kernels; then prepare for
        inference. Dense weights only (compact ones are CPU kernels)."""
        if self.compact and torch.device(device).type != "cpu":
            raise ValueError(f"compact weights run on the CPU only, not on {device}")
        self.to(device)
        self.set_attention(self.attention_requested)
        self.set_fused(self.fused_requested)
        self.prepare_for_inference()
        return self
