"""The fused Triton rejection-sampling kernel and its thin wrapper.

One program per request does the whole round for that request: the left-to-right acceptance
test, then ONE vocab scan (in tiles of BLOCK_V) for the residual or the bonus draw, or, for a
greedy request, one argmax scan per verified position. It evaluates the same fp32 expressions
as `rejection_sampler.rejection_sample_reference` on the same random numbers, so the two agree
token for token; the tests check that. Validation lives in `rejection_sampler.prepare_batch`;
the wrapper only asserts the layout it was handed.

Exactness notes: the race divides with `tl.math.div_rn` (IEEE round-to-nearest, as torch does;
plain `/` on fp32 may lower to an approximate division on GPUs); tile maxima break ties to the
lowest index and a later tile must be strictly larger to win, which is torch.argmax's rule.

CPU tensors run under the Triton interpreter: set TRITON_INTERPRET=1 before triton is first
imported in the process (triton.language's own helpers are bound at that import).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _row_argmax(row_ptr, V, BLOCK_V: tl.constexpr):
    """Index of the largest of row_ptr[0:V], the lowest index among ties (torch.argmax's rule)."""
    best_val = tl.full((), float("-inf"), tl.float32)
    best_idx = tl.full((), 0, tl.int64)
    for v0 in range(0, V, BLOCK_V):
        offs = v0 + tl.arange(0, BLOCK_V)
        x = tl.load(row_ptr + offs, mask=offs < V, other=float("-inf"))
        tile_max = tl.max(x, axis=0)
        tile_arg = tl.argmax(x, axis=0, tie_break_left=True)
        better = tile_max > best_val  # strict: an earlier tile keeps a tie
        best_idx = tl.where(better, (v0 + tile_arg).to(tl.int64), best_idx)
        best_val = tl.where(better, tile_max, best_val)
    return best_idx


@triton.jit
def _exponential_race(t_row_ptr, d_row_ptr, use_draft, e_row_ptr, V, BLOCK_V: tl.constexpr):
    """argmax_v w(v)/E(v) with w = max(0, p_t - p_d) (use_draft) or p_t; w = p_t if w is all zero.

    Both races (residual and its p_t fallback) run in the same pass so p_t is read once.
    Zero-weight tokens score -1 and never win; lanes past V score -2.
    """
    best_w = tl.full((), -2.0, tl.float32)
    best_w_idx = tl.full((), 0, tl.int64)
    best_t = tl.full((), -2.0, tl.float32)
    best_t_idx = tl.full((), 0, tl.int64)
    d_len = tl.where(use_draft, V, 0)  # p_d lanes to read: none on the bonus path
    for v0 in range(0, V, BLOCK_V):
        offs = v0 + tl.arange(0, BLOCK_V)
        in_vocab = offs < V
        p_t = tl.load(t_row_ptr + offs, mask=in_vocab, other=0.0)
        p_d = tl.load(d_row_ptr + offs, mask=offs < d_len, other=0.0)
        e = tl.load(e_row_ptr + offs, mask=in_vocab, other=1.0)
        w = tl.maximum(p_t - p_d, 0.0)
        s_w = tl.where(in_vocab, tl.where(w > 0.0, tl.math.div_rn(w, e), -1.0), -2.0)
        s_t = tl.where(in_vocab, tl.where(p_t > 0.0, tl.math.div_rn(p_t, e), -1.0), -2.0)
        m_w = tl.max(s_w, axis=0)
        a_w = tl.argmax(s_w, axis=0, tie_break_left=True)
        m_t = tl.max(s_t, axis=0)
        a_t = tl.argmax(s_t, axis=0, tie_break_left=True)
        better_w = m_w > best_w
        better_t = m_t > best_t
        best_w_idx = tl.where(better_w, (v0 + a_w).to(tl.int64), best_w_idx)
        best_w = tl.where(better_w, m_w, best_w)
        best_t_idx = tl.where(better_t, (v0 + a_t).to(tl.int64), best_t_idx)
        best_t = tl.where(better_t, m_t, best_t)
    # best_w >= 0 iff some w > 0 (positive weights score >= 0, even when the quotient underflows).
    return tl.where(best_w >= 0.0, best_w_idx, best_t_idx)


@triton.jit
def _rejection_kernel(
    out_ptr,  # [num_requests, out_stride] int64, prefilled with -1
    num_accepted_ptr,  # [num_requests] int64
    draft_ids_ptr,  # [num_draft_tokens] int64
    cu_ptr,  # [num_requests + 1] int64, cu[r] = first draft token of request r
    target_ptr,  # [num_draft_tokens + num_requests, V] fp32: p_t, or logits for greedy requests
    draft_ptr,  # [num_draft_tokens, V] fp32 p_d (a 1-element dummy if no sampled request drafts)
    greedy_ptr,  # [num_requests] int32, 1 = greedy
    uniforms_ptr,  # [num_draft_tokens] fp32
    exp_ptr,  # [num_requests, V] fp32
    V,
    out_stride,
    BLOCK_V: tl.constexpr,
):
    r = tl.program_id(0).to(tl.int64)
    start = tl.load(cu_ptr + r)
    n = tl.load(cu_ptr + r + 1) - start
    row0 = start + r  # target row of the anchor's query position
    out_row = out_ptr + r * out_stride
    greedy = tl.load(greedy_ptr + r) != 0
    # Loop invariant (both branches): drafts [0, k) are accepted and written; `stop` is set at
    # the first rejection or once all n drafts are accepted; exactly one more token is emitted.
    k = n * 0
    stop = (n < 0).to(tl.int32)
    if greedy:
        while stop == 0:
            best = _row_argmax(target_ptr + (row0 + k) * V, V, BLOCK_V)
            x = tl.load(draft_ids_ptr + start + k, mask=k < n, other=-1)
            # An accepted draft equals the argmax; otherwise the argmax is the correction/bonus.
            tl.store(out_row + k, best)
            accepted = (k < n) & (x == best)
            k += accepted.to(tl.int64)
            stop = 1 - accepted.to(tl.int32)
        tl.store(num_accepted_ptr + r, k)
    else:
        while stop == 0:
            valid = k < n
            tok = start + k
            x = tl.load(draft_ids_ptr + tok, mask=valid, other=0)
            p_t = tl.load(target_ptr + (row0 + k) * V + x, mask=valid, other=0.0)
            p_d = tl.load(draft_ptr + tok * V + x, mask=valid, other=1.0)
            u = tl.load(uniforms_ptr + tok, mask=valid, other=1.0)
            accepted = valid & (u * p_d < p_t)  # u < p_t / p_d without dividing
            tl.store(out_row + k, x, mask=accepted)
            k += accepted.to(tl.int64)
            stop = 1 - accepted.to(tl.int32)
        rejected = k < n  # else all accepted: the bonus, a race on p_t of the next position
        token = _exponential_race(
            target_ptr + (row0 + k) * V, draft_ptr + (start + k) * V, rejected, exp_ptr + r * V, V, BLOCK_V
        )
        tl.store(out_row + k, token)
        tl.store(num_accepted_ptr + r, k)


def default_block_v(vocab: int) -> int:
    # 1024 fp32 lanes = 4 KiB per operand per tile; 48 tiles for a 49,152 vocab.
    return min(triton.next_power_of_2(vocab), 1024)


def rejection_sample_triton(
    *,
    draft_token_ids: torch.Tensor,  # [num_draft_tokens] int64
    cu_num_draft: torch.Tensor,  # [num_requests + 1] int64
    target: torch.Tensor,  # [num_draft_tokens + num_requests, vocab] fp32: p_t; logits for greedy requests
    is_greedy: torch.Tensor,  # [num_requests] bool
    draft_probs: torch.Tensor | None,  # [num_draft_tokens, vocab] fp32, None if no sampled request drafts
    uniforms: torch.Tensor,  # [num_draft_tokens] fp32
    exp_noise: torch.Tensor,  # [num_requests, vocab] fp32
    max_num_draft: int,
    block_v: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch one program per request over an already validated, prepared batch.

    Returns output_token_ids [num_requests, max_num_draft + 1] int64 (-1 pads) and
    num_accepted [num_requests] int64, as `RejectionResult` holds them.
    """
    num_requests = is_greedy.shape[0]
    num_tokens, vocab = draft_token_ids.shape[0], target.shape[1]
    assert cu_num_draft.shape == (num_requests + 1,) and cu_num_draft.dtype == torch.int64
    assert target.shape == (num_tokens + num_requests, vocab) and target.dtype == torch.float32
    assert draft_token_ids.dtype == torch.int64 and uniforms.shape == (num_tokens,)
    assert uniforms.dtype == torch.float32
    assert exp_noise.shape == (num_requests, vocab) and exp_noise.dtype == torch.float32
    if draft_probs is None:
        draft_probs = torch.zeros(1, dtype=torch.float32, device=target.device)  # never read
    else:
        assert draft_probs.shape == (num_tokens, vocab) and draft_probs.dtype == torch.float32
    for t in (draft_token_ids, cu_num_draft, target, draft_probs, uniforms, exp_noise):
        assert t.is_contiguous() and t.device == target.device
    if target.device.type != "cuda" and isinstance(_rejection_kernel, triton.runtime.jit.JITFunction):
        raise RuntimeError(
            f"the Triton rejection kernel got {target.device.type} tensors but runs compiled; set "
            "TRITON_INTERPRET=1 before triton is first imported to run it on the CPU"
        )
    block_v = block_v or default_block_v(vocab)
    assert block_v & (block_v - 1) == 0, f"block_v must be a power of two, got {block_v}"

    out = torch.full((num_requests, max_num_draft + 1), -1, dtype=torch.int64, device=target.device)
    num_accepted = torch.empty(num_requests, dtype=torch.int64, device=target.device)
    if num_requests == 0:
        return out, num_accepted
    _rejection_kernel[(num_requests,)](
        out,
        num_accepted,
        draft_token_ids,
        cu_num_draft,
        target,
        draft_probs,
        is_greedy.to(torch.int32),
        uniforms,
        exp_noise,
        vocab,
        out.stride(0),
        BLOCK_V=block_v,
        enable_fp_fusion=False,  # no contraction may change a rounding the reference does not do
    )
    return out, num_accepted
