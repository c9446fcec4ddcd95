"""Compact exact weights (dspark/model/compact_weights.py): a layer's fp32 weights held in the
block format they came in, decoded bit for bit, and a GEMM on them that is batch-invariant."""

from __future__ import annotations

import pytest
import torch

from dspark.model import compact_weights as cw
from tests.conftest import avx2_without_avx512, q4_1_exact, q8_0_exact

pytestmark = pytest.mark.skipif(not cw.available(), reason="no C++ compiler: compact weights stay dense")


def _weights(fmt: str, n: int, k: int, seed: int = 0) -> torch.Tensor:  # [n, k] fp32, exact in `fmt`
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) / k**0.5
    if fmt == "q4_1":
        return q4_1_exact(w)
    if fmt == "q8_0":
        return q8_0_exact(w)
    return w.bfloat16().float()


@pytest.mark.parametrize("fmt", cw.FORMATS)
def test_weights_that_came_from_a_block_format_are_recovered_bit_for_bit(fmt):
    w = _weights(fmt, 40, 96)
    found = cw.compact(w, formats=(fmt,))
    assert found is not None and found.format == fmt
    assert torch.equal(cw.decode(found), w)


def test_the_smallest_exact_format_is_chosen_and_it_is_smaller_than_fp32():
    w = _weights("q4_1", 64, 128)
    found = cw.compact(w)
    assert found.format == "q4_1"
    assert found.nbytes * 5 < w.numel() * 4  # 0.75 bytes a weight (nibbles + fp32 scale and offset)


def test_weights_no_format_reproduces_stay_dense():
    w = torch.randn(32, 64, generator=torch.Generator().manual_seed(1))  # arbitrary fp32
    assert cw.compact(w) is None
    assert cw.compact(w[:, :48].contiguous()) is None  # K not a multiple of 32: no blocks at all
    w[0, 0] = float("nan")
    assert cw.compact(w) is None


@pytest.mark.parametrize("fmt", cw.FORMATS)
@pytest.mark.parametrize("n", [1, 7, 64])
def test_the_kernel_computes_x_times_w_transposed_in_fp32(fmt, n):
    w = _weights(fmt, n, 96, seed=n)
    c = cw.compact(w, formats=(fmt,))
    x = torch.randn(13, 96, generator=torch.Generator().manual_seed(2))
    got = cw.matmul(x, c)  # [13, n]
    torch.testing.assert_close(got, cw.reference_matmul(x, c), atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("fmt", cw.FORMATS)
@pytest.mark.parametrize("k", [160, 1536])  # 1536: rows go through the kernel in blocks of 16-20 (x kept in L2)
def test_every_row_gets_the_bits_it_gets_alone_whatever_the_rows_and_threads(fmt, k):
    """The property greedy speculative decoding rests on: a verify batch of M rows gives each row
    exactly what plain decoding (one row) gives it, at any M and thread count."""
    w = _weights(fmt, 67, k, seed=3)  # an odd column count: tail columns of every tile width
    c = cw.compact(w, formats=(fmt,))
    x = torch.randn(70, k, generator=torch.Generator().manual_seed(4))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = torch.cat([cw.matmul(x[i : i + 1], c) for i in range(70)])
        for t in sorted({1, 2, threads}):
            torch.set_num_threads(t)
            for m in (2, 3, 4, 5, 8, 9, 12, 16, 33, 70):
                assert torch.equal(cw.matmul(x[:m], c), alone[:m]), f"M = {m}, {t} threads"
    finally:
        torch.set_num_threads(threads)



@pytest.mark.skipif(not avx2_without_avx512(),
                    reason="the AVX2 spelling of the kernel is built only on AVX2 CPUs without AVX-512")
@pytest.mark.parametrize("fmt", cw.FORMATS)
def test_the_avx2_kernel_gives_the_bits_of_the_16_lane_code(fmt):
    """On AVX2 the kernel is spelled on 8-lane register pairs (compact_weights.py); it must be the
    16-lane code's arithmetic exactly, so an AVX2 and an AVX-512 machine compute the same logits."""
    for k, rows in ((160, (1, 2, 3, 4, 5, 8, 13)), (1536, (21, 70))):  # 1536: several row blocks
        w = _weights(fmt, 67, k, seed=5)
        c = cw.compact(w, formats=(fmt,))
        for m in rows:
            x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
            assert torch.equal(cw.matmul(x, c), cw.v16_matmul(x, c)), f"K = {k}, M = {m}"


def test_the_table_decode_of_q4_1_gives_the_bits_of_the_conversion_decode():
    """On AVX-512 a Q4_1 block is decoded by looking its nibbles up in the 16 values fma(j, d, m);
    it must give exactly the weights (and the products) of converting each nibble and applying
    the same fma (the library built with DSPARK_NO_TABLE_DECODE; one code path elsewhere)."""
    for k, rows in ((160, (1, 2, 3, 4, 5, 8, 13)), (1536, (21, 70))):
        c = cw.compact(_weights("q4_1", 67, k, seed=6), formats=("q4_1",))
        for m in rows:
            x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
            assert torch.equal(cw.matmul(x, c), cw.no_table_matmul(x, c)), f"K = {k}, M = {m}"


def test_a_strided_input_and_output_are_read_and_written_in_place():
    c = cw.compact(_weights("q4_1", 48, 64))
    big = torch.randn(5, 100)
    x = big[:, 10:74]  # row stride 100
    out = torch.full((5, 60), -1.0)
    cw.matmul(x, c, out=out[:, 6:54])
    assert torch.equal(out[:, 6:54], cw.matmul(x.contiguous(), c))
    assert (out[:, :6] == -1).all() and (out[:, 54:] == -1).all()


def test_wrong_inputs_are_refused_with_the_shape_they_need():
    c = cw.compact(_weights("q4_1", 8, 64))
    with pytest.raises(ValueError, match=r"fp32 \[M, 64\]"):
        cw.matmul(torch.randn(2, 32), c)
    with pytest.raises(ValueError, match="fp32"):
        cw.matmul(torch.randn(2, 64).bfloat16(), c)


def test_a_compact_linear_is_the_dense_linear_it_replaces():
    w = _weights("q4_1", 24, 64)
    layer = cw.CompactLinear(cw.compact(w))
    x = torch.randn(3, 64)
    assert layer.bounds == [0, 64] and layer.dtype == torch.float32
    assert torch.equal(layer(x), layer.partial(x, 0))
    torch.testing.assert_close(layer(x), x @ w.t(), atol=1e-5, rtol=1e-5)
