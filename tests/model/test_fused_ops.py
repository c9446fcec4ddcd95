"""The fused layer kernels (dspark/model/fused_ops.py) against torch, and their batch invariance."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from dspark.model import fused_ops
from dspark.model.transformer import apply_rope

pytestmark = pytest.mark.skipif(not fused_ops.available(), reason="no C++ compiler for the fused kernels")


def test_add_rms_norm_adds_exactly_as_torch_and_normalises_to_fp32_rounding():
    g = torch.Generator().manual_seed(0)
    n, d = 37, 100  # d not a multiple of 16: a zero-padded tail vector
    x, w = torch.randn(n, d, generator=g), torch.randn(d, generator=g)
    a0, a1 = (torch.randn(n, d, generator=g).bfloat16() for _ in range(2))
    expected_x = x + (a0.float() + a1.float())  # SplitKLinear's fp32 partial sum, then the residual add
    out = torch.empty(n, d)
    fused_ops.add_rms_norm(x, [a0, a1], w, 1e-5, out)
    assert torch.equal(x, expected_x)
    torch.testing.assert_close(out, F.rms_norm(expected_x, (d,), w, 1e-5), rtol=1e-6, atol=1e-6)
    out_bf16 = torch.empty(n, d, dtype=torch.bfloat16)
    fused_ops.add_rms_norm(expected_x.clone(), [], w, 1e-5, out_bf16)
    assert torch.equal(out_bf16, out.bfloat16())  # the same round-to-nearest-even as torch


def test_rope_split_is_bit_identical_to_the_torch_rope():
    g = torch.Generator().manual_seed(1)
    n, heads, kv_heads, hd = 13, 5, 2, 40
    qkv = torch.randn(n, (heads + 2 * kv_heads) * hd, generator=g).bfloat16()
    freqs = torch.arange(n).float().unsqueeze(1) / (10000 ** (torch.arange(0, hd, 2).float() / hd))
    emb = torch.cat((freqs, freqs), dim=-1).unsqueeze(1)
    expected = apply_rope(qkv[:, : (heads + kv_heads) * hd].view(n, heads + kv_heads, hd), emb.cos(), emb.sin())
    q, k, v = torch.empty(n, heads, hd), torch.empty(n, kv_heads, hd), torch.empty(n, kv_heads, hd)
    fused_ops.rope_split(qkv, freqs.cos(), freqs.sin(), q, k, v)
    assert torch.equal(q, expected[:, :heads]) and torch.equal(k, expected[:, heads:])
    assert torch.equal(v, qkv[:, (heads + kv_heads) * hd :].view(n, kv_heads, hd).float())


def test_silu_mul_rounds_once_to_bf16_and_lays_out_the_down_projection_chunks():
    g = torch.Generator().manual_seed(2)
    n, inter, bounds = 9, 77, [0, 30, 77]
    gate_up = (3 * torch.randn(n, 2 * inter, generator=g)).bfloat16()
    out = torch.empty(n * inter, dtype=torch.bfloat16)
    fused_ops.silu_mul(gate_up, bounds, out)
    gate, up = gate_up.float().chunk(2, dim=-1)
    got = torch.cat([out[n * lo : n * hi].view(n, hi - lo) for lo, hi in zip(bounds, bounds[1:])], dim=1)
    torch.testing.assert_close(got.float(), (F.silu(gate) * up).bfloat16().float(), rtol=8e-3, atol=1e-6)


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_every_row_gets_the_bits_it_gets_alone_whatever_the_rows_and_threads(threads):
    """1200 rows cross the size above which the kernels use several threads."""
    g = torch.Generator().manual_seed(3)
    n, d, inter = 1200, 64, 96
    x, w = torch.randn(n, d, generator=g), torch.randn(d, generator=g)
    a = torch.randn(n, d, generator=g).bfloat16()
    gate_up = torch.randn(n, 2 * inter, generator=g).bfloat16()
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        xb, hb, act = x.clone(), torch.empty(n, d, dtype=torch.bfloat16), torch.empty(n * inter, dtype=torch.bfloat16)
        fused_ops.add_rms_norm(xb, [a], w, 1e-5, hb)
        fused_ops.silu_mul(gate_up, [0, inter], act)
        for i in (0, 1, 599, n - 1):
            xi, hi, ai = x[i : i + 1].clone(), torch.empty(1, d, dtype=torch.bfloat16), torch.empty(inter, dtype=torch.bfloat16)
            fused_ops.add_rms_norm(xi, [a[i : i + 1]], w, 1e-5, hi)
            fused_ops.silu_mul(gate_up[i : i + 1], [0, inter], ai)
            assert torch.equal(xi[0], xb[i]) and torch.equal(hi[0], hb[i])
            assert torch.equal(ai, act.view(n, inter)[i])
    finally:
        torch.set_num_threads(saved)


@pytest.mark.parametrize("shape", [(1, 49152), (7, 49152), (3, 1000), (64, 4099), (2, 5)])
def test_row_argmax_is_torch_argmax(shape):
    g = torch.Generator().manual_seed(sum(shape))
    x = torch.randn(*shape, generator=g)
    x[0, shape[1] // 3] = x[0].max() + 1  # a clear winner
    if shape[0] > 1:
        x[1, :] = 0.5  # every entry ties: the first index
        x[1, shape[1] - 1] = 0.5
    if shape[0] > 2:
        x[2, :] = -math.inf  # no finite entry: index 0, as torch
    if shape[0] > 3:
        x[3, shape[1] // 2] = math.nan  # NaN is the maximum for torch
        x[3, shape[1] - 1] = math.inf
    if shape[0] > 4:
        x[4, shape[1] - 1] = math.inf  # the winner in the scalar tail
        x[4, shape[1] - 2] = math.inf  # ... tied with its left neighbour
    assert torch.equal(fused_ops.row_argmax(x), x.argmax(-1))
    strided = torch.randn(shape[0], shape[1] + 16, generator=g)[:, 3 : shape[1] + 3]  # rows not packed
    assert torch.equal(fused_ops.row_argmax(strided), strided.argmax(-1))


def test_row_argmax_falls_back_to_torch_where_the_kernel_does_not_apply():
    x = torch.randn(4, 33, dtype=torch.float64)
    assert torch.equal(fused_ops.row_argmax(x), x.argmax(-1))
    t = torch.randn(33, 4).t()  # columns contiguous
    assert torch.equal(fused_ops.row_argmax(t), t.argmax(-1))


def _race_reference(p: torch.Tensor, d: torch.Tensor | None, e: torch.Tensor) -> int:
    """The race as the batched torch path writes it, on one row."""
    w = p if d is None else (p - d).clamp_min(0.0)
    if not bool((w > 0).any()):
        w = p  # an all-zero residual: draw from p_t
    return int(torch.where(w > 0, w / e, -1.0).argmax())


@pytest.mark.parametrize("vocab", [49152, 4099, 5])
def test_race_argmax_is_the_torch_race(vocab):
    """Residual and bonus races, rows picked by index; the edge cases of the reference: a residual
    without mass (falls back to p_t), zero noise (an infinite score: the first one wins), ties,
    no mass at all (index 0), a NaN weight (never positive), a winner in the scalar tail."""
    g = torch.Generator().manual_seed(vocab)
    p = torch.softmax(torch.randn(6, vocab, generator=g) * 3, -1)  # [6, vocab]
    d = torch.softmax(torch.randn(4, vocab, generator=g) * 3, -1)  # [4, vocab]
    e = torch.empty(5, vocab).exponential_(generator=g)  # [5, vocab]
    d[1] = p[1]  # residual p_t - p_d without mass
    e[2, [vocab // 2, vocab - 1]] = 0.0  # two infinite scores
    p[3] = 0.0
    p[3, [0, vocab - 1]] = 0.25  # a tie between the first and the last id: same noise below
    e[3] = 1.0
    p[4] = 0.0  # no mass anywhere
    p[5, vocab // 3] = math.nan
    p[5, vocab - 1] = 5.0  # the winner, in the scalar tail where vocab % 16 != 0
    races = [(0, -1, 0), (1, 1, 1), (2, 0, 2), (3, -1, 3), (4, 2, 4), (5, -1, 0), (0, 3, 4), (5, 2, 1)]  # (p, d, e) rows
    p_rows, d_rows, e_rows = (torch.tensor(c) for c in zip(*races))
    got = fused_ops.race_argmax(p, p_rows, d, d_rows, e, e_rows)
    expected = [_race_reference(p[i], None if j < 0 else d[j], e[k]) for i, j, k in races]
    assert got.tolist() == expected
    no_drafts = fused_ops.race_argmax(p, p_rows, None, None, e, e_rows)
    assert no_drafts.tolist() == [_race_reference(p[i], None, e[k]) for i, _, k in races]


def test_race_argmax_declines_what_the_kernel_does_not_take():
    p = torch.rand(2, 40, dtype=torch.float64)
    rows = torch.arange(2)
    assert fused_ops.race_argmax(p, rows, None, None, p, rows) is None  # fp64: the caller's torch ops
    p32 = torch.rand(2, 40)
    assert fused_ops.race_argmax(p32, rows, None, None, torch.rand(2, 41), rows) is None  # widths differ
    assert fused_ops.race_argmax(torch.rand(40, 2).t(), rows, None, None, p32, rows) is None  # columns contiguous
