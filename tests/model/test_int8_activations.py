"""The `compact-int8` numerics (dspark/model/int8_activations.py): Q4_1 and Q8_0 weights times
activations rounded to int8 per block of 32. Not the exact model; what must hold is that the kernel computes
exactly that rounded product, that it is batch-invariant (the same bits for a row whatever else
is in the batch, the threads or the instruction set), and so that greedy speculative decoding
in this mode is plain decoding in this mode, token for token."""

from __future__ import annotations

import pytest
import torch

from dspark.model import compact_weights as cw
from dspark.model import int8_activations as i8
from dspark.model.attention import LazyLibrary
from tests.conftest import make_tiny_runtime, q4_1_exact, q8_0_exact
from tests.engine.test_speculative_engine import PROMPTS, RandomTokenDrafter, _generate, _plain_alone
from dspark.drafters.ngram import NgramDrafter

pytestmark = pytest.mark.skipif(not cw.int8_activations_available(), reason="the int8 kernel needs AVX2 + FMA and a compiler")

# K = 64 and 96: one partial group (2 and 3 blocks); 256: one full group; 576 and 1536: the
# default model's (2 full groups + 2 blocks, 6 full groups)
SHAPES = [64, 96, 256, 576, 1536]
WEIGHT_FORMATS = ["q4_1", "q8_0"]  # the decoder layers' and the default model's LM head
ON_THE_GRID = {"q4_1": q4_1_exact, "q8_0": q8_0_exact}


def _int8_weight(fmt: str, n: int, k: int, seed: int = 0) -> cw.CompactWeight:
    w = ON_THE_GRID[fmt](torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) / k**0.5)
    c = cw.with_int8_activations(cw.compact(w, formats=(fmt,)), panels=False)  # the first kernel's layout
    assert c.format == f"{fmt}_x8"
    return c


def _rows(m: int, k: int, seed: int) -> torch.Tensor:  # [m, k]: activations of varied scale
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(seed)) * torch.logspace(-2, 1, k)
    x[0, :32] = 0.0  # an all-zero block (amax 0, scale 0)
    return x


@pytest.mark.parametrize("k", SHAPES)
def test_the_repacked_weights_are_the_same_weights(k):
    exact = cw.compact(q4_1_exact(torch.randn(9, k, generator=torch.Generator().manual_seed(k))), formats=("q4_1",))
    x8 = cw.with_int8_activations(exact, panels=False)
    assert x8.format == "q4_1_x8" and x8.q.shape == (9, k // 2) and x8.nbytes == exact.nbytes
    assert torch.equal(cw.decode(x8), cw.decode(exact))
    values = torch.randint(0, 16, (9, k // 32, 32), generator=torch.Generator().manual_seed(1))
    assert torch.equal(i8.unpack_weights(i8.pack_weights(values)), values)


@pytest.mark.parametrize("k", SHAPES)
def test_the_repacked_q8_0_weights_are_the_same_weights(k):
    exact = cw.compact(q8_0_exact(torch.randn(9, k, generator=torch.Generator().manual_seed(k))), formats=("q8_0",))
    x8 = cw.with_int8_activations(exact, panels=False)
    assert x8.format == "q8_0_x8" and x8.q.shape == (9, k) and x8.nbytes == exact.nbytes
    assert torch.equal(cw.decode(x8), cw.decode(exact))
    values = torch.randint(-127, 128, (9, k // 32, 32), generator=torch.Generator().manual_seed(1))
    assert torch.equal(i8.unpack_q8_weights(i8.pack_q8_weights(values)), values)


def test_only_q4_1_and_q8_0_weights_take_int8_activations():
    w = torch.randn(8, 64, generator=torch.Generator().manual_seed(0)).bfloat16().float()
    bf16 = cw.compact(w, formats=("bf16",))
    assert cw.with_int8_activations(bf16) is bf16


def test_a_q8_0_weight_that_uses_minus_128_stays_exact():
    """The kernel's sign trick cannot negate -128, so such a weight keeps the exact fp32 kernel."""
    w = q8_0_exact(torch.randn(4, 64, generator=torch.Generator().manual_seed(0)))
    blocks = w.view(-1, 32)
    d = blocks[0].abs().max() / 127
    blocks[0, 1] = -128 * d  # q = -128 in the first block (127 · d stays its largest positive)
    exact = cw.compact(w, formats=("q8_0",))
    assert exact is not None and int(exact.q.min()) == -128
    assert cw.with_int8_activations(exact) is exact
    with pytest.raises(ValueError, match="-127..127"):
        i8.pack_q8_weights(torch.full((1, 1, 32), -128))


def test_activations_are_rounded_per_block_of_32_to_127_steps_of_its_largest_value():
    x = _rows(3, 96, seed=0)
    xq, s = i8.quantize_blocks(x)
    blocks = x.view(3, 3, 32)
    assert xq.abs().max() <= 127 and torch.equal(xq, xq.round())
    assert torch.equal(s, blocks.abs().amax(dim=2) / 127)
    assert torch.equal(xq.view(3, 3, 32).abs().amax(dim=2)[:, 1:], torch.full((3, 2), 127.0))  # the largest is ±127
    assert torch.equal(xq.view(3, 3, 32).abs().amax(dim=2)[1:, 0], torch.full((2,), 127.0))
    assert (xq.view(3, 3, 32)[0, 0] == 0).all() and s[0, 0] == 0  # the zero block
    error = (i8.dequantized(x) - x.double()).view(3, 3, 32).abs().amax(dim=2)
    assert (error <= s.double() / 2 * (1 + 1e-6)).all()  # half a step at most


@pytest.mark.parametrize("k", SHAPES)
def test_the_kernel_quantises_a_row_into_its_layout_with_the_references_bits(k):
    x = _rows(4, k, seed=k)
    groups = -(-k // 256)
    lib = cw.load()
    for r in range(4):
        row = x[r].contiguous()
        out = torch.zeros(groups * 320, dtype=torch.uint8)
        lib.dspark_x8_quantize_row(row.data_ptr(), k, out.data_ptr())
        xq, s = i8.quantize_blocks(x[r : r + 1])  # [1, k], [1, k / 32]
        got_q, got_x, got_s = [], [], []
        for g in range(groups):  # the module docstring's layout: value j = 8t + 4h + k of lane l's block
            group = out[g * 320 : (g + 1) * 320]
            lanes = min(8, k // 32 - 8 * g)
            lo, hi = (group[o : o + 128].view(torch.int8).view(4, 8, 4)[:, :lanes] for o in (0, 128))  # [t, lane, k]
            got_q.append(torch.stack([lo, hi], dim=2).permute(1, 0, 2, 3).reshape(lanes, 32))  # [lane, j]
            got_x.append(group[256:288].view(torch.float32)[:lanes])
            got_s.append(group[288:320].view(torch.float32)[:lanes])
            assert (group[256:320].view(torch.float32).view(2, 8)[:, lanes:] == 0).all()  # a partial group's lanes stay zero
        assert torch.equal(torch.cat(got_q).float(), xq.view(-1, 32))
        assert torch.equal(torch.cat(got_x), xq.view(-1, 32).sum(dim=1))
        assert torch.equal(torch.cat(got_s), s[0])


@pytest.mark.parametrize("fmt", WEIGHT_FORMATS)
@pytest.mark.parametrize("k", SHAPES)
@pytest.mark.parametrize("m", [1, 2, 5, 8, 13])
def test_the_kernel_computes_the_rounded_activations_times_the_weights(fmt, k, m):
    c = _int8_weight(fmt, 37, k, seed=k)
    x = _rows(m, k, seed=m)
    got = cw.matmul(x, c)  # [m, 37]
    reference = cw.reference_matmul(x, c)  # fp64 product of the rounded activations and the exact weights
    scale = (i8.dequantized(x).abs() @ cw.decode(c).double().abs().t()).float()  # Σ |x̂| |w|: the rounding's yardstick
    assert ((got - reference).abs() <= 1e-6 * scale + 1e-30).all()
    exact = cw.matmul(x, cw.compact(cw.decode(c), formats=(fmt,)))  # the exact model: close, not equal
    # by no more than the rounding allows: half a step s_b per activation, times |w|
    _, steps = i8.quantize_blocks(x)  # [m, k / 32]
    half_step = (steps.double() / 2).repeat_interleave(32, dim=1)  # [m, k]
    rounding = (half_step @ cw.decode(c).double().abs().t()).float()  # [m, 37]
    assert ((got - exact).abs() <= rounding * (1 + 1e-4) + 2e-6 * scale + 1e-30).all()


@pytest.mark.parametrize("fmt", WEIGHT_FORMATS)
@pytest.mark.parametrize("k", [96, 1536])  # 1536: the rows go through the kernel in blocks of 32
def test_every_row_gets_the_bits_it_gets_alone_whatever_the_rows_and_threads(fmt, k):
    c = _int8_weight(fmt, 67, k, seed=3)  # an odd column count: the tail column of two-column tiles
    x = _rows(70, k, seed=4)
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


def test_avx2s_byte_products_give_the_bits_of_vnni():
    """The integer sums are exact on every instruction set, and the fp32 epilogue is one fixed
    sequence, so a CPU without VNNI (vpmaddubsw + vpmaddwd) computes the same bits as one with it."""
    source = "#define DSPARK_X8_NO_VNNI 1\n" + cw._SOURCE
    no_vnni = LazyLibrary(source, "compact_gemm_no_vnni", cw._SIGNATURES, fallback="no reference").get()
    assert no_vnni is not None
    for fmt in WEIGHT_FORMATS:
        for k in SHAPES:
            c = _int8_weight(fmt, 21, k, seed=k)
            for m in (1, 4, 7):
                x = _rows(m, k, seed=10 + m)
                assert torch.equal(cw.matmul(x, c), cw._run(no_vnni, x, c, None)), f"{fmt}, K = {k}, M = {m}"


def test_a_model_in_int8_mode_is_close_to_the_exact_model():
    exact = make_tiny_runtime(compact=True)
    int8 = make_tiny_runtime(compact=True, int8_activations=True)
    assert int8.linear_numerics == "compact-int8" and exact.linear_numerics == "compact"
    assert int8.model.__dict__["lm_head_packed"].weight.format in ("q8_0_x8", "q8_0_p16")  # the tied Q8_0 head takes int8 too
    prompt = torch.tensor(PROMPTS[4])
    logits = []
    for runtime in (exact, int8):
        runtime.add_request("r", len(prompt) + 1)
        logits.append(runtime.forward(["r"], prompt, [len(prompt)], logits_indices=torch.arange(len(prompt))).logits)
        runtime.free_request("r")
    p_exact, p_int8 = (torch.softmax(z.double(), dim=-1) for z in logits)  # [40, vocab]
    assert not torch.equal(logits[0], logits[1])  # a different model...
    assert (p_exact - p_int8).abs().sum(dim=-1).max() < 0.05  # ...close in total variation at every position


@pytest.mark.parametrize("drafter", ["ngram", "random"])
def test_greedy_speculative_decoding_in_int8_mode_equals_plain_decoding_in_int8_mode(drafter):
    runtime = make_tiny_runtime(compact=True, int8_activations=True)
    expected = _plain_alone(runtime, PROMPTS, max_new_tokens=30)
    proposer = NgramDrafter() if drafter == "ngram" else RandomTokenDrafter(256, seed=0)
    states = _generate(runtime, proposer, PROMPTS, max_new_tokens=30, gamma=5)
    assert [s.output_ids for s in states] == expected
    assert sum(s.draft_tokens for s in states) > 0
