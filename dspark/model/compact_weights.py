"""Exact compact weights: a linear layer's weights held in the smallest block format that
reproduces them bit for bit, and the GEMM that reads them (fp32 activations, fp32 sums).

At one token per step a CPU forward is the time to stream the weights once (docs/architecture.md
§8): the default model's 135 M weights are 537 MB in fp32 and 270 MB in bf16, but they came out
of a GGUF file (Q4_1 layers, a Q8_0 embedding, dspark/model/model_store.py), so every block of 32
consecutive weights of a row is exactly
    Q4_1:  w_j = d·q_j + m   (q_j in 0..15, d and m fp16)      0.75 bytes a weight here
    Q8_0:  w_j = d·q_j       (q_j in -128..127, d fp16)         1.125 bytes a weight here
    bf16:  w_j = bf16 bits   (any checkpoint stored in bf16)    2 bytes a weight
`compact()` finds such a representation and keeps it only if decoding it gives back every
weight exactly (`decode()`), so nothing about the model changes: the same fp32 weights, read
from 3-5x fewer bytes. A tensor no format reproduces stays dense (None).

The product y = x Wᵀ (fp32 x, fp32 sums) decodes each block of a column in registers into its
32 exact fp32 weights (the products d·q are exact, q4_1's one addition rounds as compact()
checked) and accumulates
    acc = fma(x[m, 32b : 32b+16], w_lo, acc);  acc = fma(x[m, 32b+16 : 32b+32], w_hi, acc)
block by block in one 16-lane accumulator per output element, then sums the lanes by a fixed
tree: a dense fp32 dot product of the exact weights in a fixed order (a different order from
oneDNN's, as any two GEMM kernels differ: logits agree to fp32 rounding). Batch invariance, the
property greedy speculative decoding rests on: every (m, n) goes through that same sequence
whatever the number of rows M, the tile it falls in, or the threads (which split whole columns),
and the compiler may not contract anything else (-ffp-contract=off). Activations stay fp32:
unlike llama.cpp's quantized dot products, x is never rounded to 8 bits.

Cost: at one row the kernel is bound by decoding (~8 cycles a block of 32 on a Zen 4 core) and
the stream of 0.75 bytes a weight; from ~8 rows by fp32 FMAs (16 per cycle per core), where
oneDNN's bf16 GEMM does twice the work per instruction on rounded weights. On AVX2-only CPUs a
16-lane GCC vector has no register to live in (every operation goes through the stack), so the
kernel has a second spelling there on pairs of 8-lane registers: the same FMAs in the same order,
the same bits (tests/model/test_compact_weights.py checks it against the 16-lane code). Measured in
docs/results/compact_weights.md.
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass

import torch

from dspark.model import int8_activations, int8_panels
from dspark.model.attention import VECTOR_PRELUDE, LazyLibrary

BLOCK = 32  # weights per block along K, as GGUF's Q4_1 / Q8_0
FORMATS = ("bf16", "q8_0", "q4_1")  # the exact formats compact() finds
# the kernel's format codes are their indices: the exact formats, then Q4_1 weights with int8
# activations (dspark/model/int8_activations.py: the opt-in `compact-int8` numerics, not exact)
# and the same int8 numerics on column panels (dspark/model/int8_panels.py: VNNI / AMX tiles)
KERNEL_FORMATS = (*FORMATS, "q4_1_x8", "q8_0_x8", "q4_1_p16", "q8_0_p16")
INT8_FORMATS = ("q4_1_x8", "q8_0_x8", "q4_1_p16", "q8_0_p16")  # weights that take int8 activations


@dataclass
class CompactWeight:
    """W [out_features, in_features] in one block format (module docstring)."""

    format: str  # one of KERNEL_FORMATS
    out_features: int
    in_features: int
    # bf16: [N, K] int16 (the bits); q8_0: [N, K] int8; q4_1: [N, K / 8] int32 (_pack_q4_1);
    # q4_1_x8: [N, K / 2] uint8 (int8_activations.pack_weights); q8_0_x8: [N, K] int8 (pack_q8_weights);
    # q4_1_p16: [P, K / 32, 4, 16, 4] uint8, q8_0_p16: [P, K / 32, 8, 16, 4] int8 (int8_panels.py, P = ceil(N / 16))
    q: torch.Tensor
    # [N, K / 32] fp32 d (the fp16 value, exactly), None for bf16; [P, K / 32, 16] for the p16 formats
    scale: torch.Tensor | None
    # [N, K / 32] fp32 m for q4_1(_x8), [P, K / 32, 16] for q4_1_p16; for q8_0_p16 the int32
    # column sums 128 · Σ q [P, K / 32, 16] (int8_panels.q8_column_sums); else None
    offset: torch.Tensor | None

    @functools.cached_property
    def kernel_args(self) -> tuple[int, int, int, int]:
        """(format code, address of q, of scale, of offset) for the kernel: computed once, the
        tensors are never replaced (a per-call rebuild was a tenth of a token's time)."""
        address = lambda t: 0 if t is None else t.data_ptr()  # noqa: E731
        return KERNEL_FORMATS.index(self.format), address(self.q), address(self.scale), address(self.offset)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.q, self.scale, self.offset) if t is not None)


# Q4_1 nibbles, laid out for the kernel's decode: a block's 32 four-bit values in 4 32-bit words,
# weight j < 16 in word j % 4 at bit 4 (j // 4), weight 16 + j at bit 16 + 4 (j // 4). The kernel
# repeats the 4 words across 16 lanes and shifts lane i by _Q4_1_SHIFT[i] (one variable shift
# and one mask give 16 weights), instead of widening bytes with cross-lane shuffles.
_Q4_1_SHIFT = 4 * (torch.arange(16) // 4)  # [16]: 0,0,0,0, 4,4,4,4, 8,8,8,8, 12,12,12,12


def _pack_q4_1(q: torch.Tensor) -> torch.Tensor:  # q [blocks, 32] in 0..15 -> [blocks * 4] int32
    q = q.long()
    bits = (q[:, :16] << _Q4_1_SHIFT) | (q[:, 16:] << (_Q4_1_SHIFT + 16))  # [blocks, 16], disjoint bits
    words = bits.view(-1, 4, 4).sum(dim=1)  # [blocks, 4]: lane j goes to word j % 4
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32).reshape(-1)


def _fp16_candidates(estimate: torch.Tensor) -> list[torch.Tensor]:
    # the fp16 nearest the estimate and its neighbours: the scale the file stored is one of them
    bits = estimate.half().view(torch.int16)
    return [(bits + delta).view(torch.float16).float() for delta in (0, -1, 1, -2, 2)]


def _try_q4_1(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    # blocks: [num_blocks, 32] fp32 -> q [num_blocks, 32] uint8, d, m [num_blocks] fp32
    m = blocks.min(dim=1).values  # the smallest weight has q = 0: it is m itself
    if not torch.equal(m.half().float(), m):
        return None
    span = blocks.max(dim=1).values - m
    q = torch.zeros(blocks.shape, dtype=torch.uint8)
    d = torch.zeros_like(m)
    todo = torch.ones(blocks.shape[0], dtype=torch.bool)
    for top in (15, 14, 13):  # the largest q of a block is 15 unless rounding kept it lower
        for cand in _fp16_candidates(span / top):
            idx = todo.nonzero().squeeze(1)
            if idx.numel() == 0:
                break
            b, c, mm = blocks[idx], cand[idx].unsqueeze(1), m[idx].unsqueeze(1)
            safe = torch.where(c > 0, c, torch.ones_like(c))
            qi = torch.where(c > 0, torch.round((b - mm) / safe), torch.zeros_like(b)).clamp(0, 15)
            ok = ((c * qi) + mm == b).all(dim=1) & torch.isfinite(c.squeeze(1))
            hit = idx[ok]
            q[hit], d[hit], todo[hit] = qi[ok].to(torch.uint8), c.squeeze(1)[ok], False
    return None if todo.any() else (q, d, m)


def _try_q8_0(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    # blocks: [num_blocks, 32] fp32 -> q [num_blocks, 32] int8, d [num_blocks] fp32
    amax = blocks.abs().max(dim=1).values
    q = torch.zeros(blocks.shape, dtype=torch.int8)
    d = torch.zeros_like(amax)
    todo = torch.ones(blocks.shape[0], dtype=torch.bool)
    for top in (127, 128, 126):
        for cand in _fp16_candidates(amax / top):
            idx = todo.nonzero().squeeze(1)
            if idx.numel() == 0:
                break
            b, c = blocks[idx], cand[idx].unsqueeze(1)
            safe = torch.where(c > 0, c, torch.ones_like(c))
            qi = torch.where(c > 0, torch.round(b / safe), torch.zeros_like(b)).clamp(-128, 127)
            ok = (c * qi == b).all(dim=1) & torch.isfinite(c.squeeze(1))
            hit = idx[ok]
            q[hit], d[hit], todo[hit] = qi[ok].to(torch.int8), c.squeeze(1)[ok], False
    return None if todo.any() else (q, d)


@torch.no_grad()
def compact(weight: torch.Tensor, formats: tuple[str, ...] = ("q4_1", "q8_0", "bf16")) -> CompactWeight | None:
    """The first of `formats` that reproduces `weight` [N, K] (fp32) exactly, or None."""
    w = weight.detach().float().contiguous()
    n, k = w.shape
    if k % BLOCK or not torch.isfinite(w).all():
        return None
    blocks = w.view(-1, BLOCK)  # [N * K / 32, 32]
    for fmt in formats:
        if fmt == "q4_1" and (found := _try_q4_1(blocks)) is not None:
            q, d, m = found
            cw = CompactWeight("q4_1", n, k, _pack_q4_1(q).view(n, k // 8), d.view(n, k // BLOCK), m.view(n, k // BLOCK))
        elif fmt == "q8_0" and (found := _try_q8_0(blocks)) is not None:
            q, d = found
            cw = CompactWeight("q8_0", n, k, q.view(n, k).contiguous(), d.view(n, k // BLOCK), None)
        elif fmt == "bf16" and torch.equal(w.bfloat16().float(), w):
            cw = CompactWeight("bf16", n, k, w.bfloat16().view(torch.int16).contiguous(), None, None)
        else:
            continue
        if torch.equal(decode(cw), w):  # the contract, checked: not one weight moves
            return cw
    return None


def decode(cw: CompactWeight) -> torch.Tensor:  # [N, K] fp32, the weights the kernel multiplies by
    n, k = cw.out_features, cw.in_features
    if cw.format == "bf16":
        return cw.q.view(torch.bfloat16).float()
    if cw.format == "q8_0":
        return (cw.scale.unsqueeze(2) * cw.q.view(n, k // BLOCK, BLOCK).float()).view(n, k)
    if cw.format == "q4_1_x8":
        return (cw.scale.unsqueeze(2) * int8_activations.unpack_weights(cw.q).float() + cw.offset.unsqueeze(2)).view(n, k)
    if cw.format == "q8_0_x8":
        return (cw.scale.unsqueeze(2) * int8_activations.unpack_q8_weights(cw.q).float()).view(n, k)
    if cw.format == "q4_1_p16":
        d, m = int8_panels.unpack_scales(cw.scale, n), int8_panels.unpack_scales(cw.offset, n)
        return (d.unsqueeze(2) * int8_panels.unpack_q4_1(cw.q, n).float() + m.unsqueeze(2)).reshape(n, k)
    if cw.format == "q8_0_p16":
        return (int8_panels.unpack_scales(cw.scale, n).unsqueeze(2) * int8_panels.unpack_q8_0(cw.q, n).float()).reshape(n, k)
    return (cw.scale.unsqueeze(2) * _q4_1_values(cw).float() + cw.offset.unsqueeze(2)).view(n, k)


def _q4_1_values(cw: CompactWeight) -> torch.Tensor:  # [N, K / 32, 32] int64 in 0..15
    n, k = cw.out_features, cw.in_features
    words = cw.q.view(n, k // BLOCK, 4).long() & 0xFFFFFFFF  # [N, K / 32, 4] the 4 words of each block
    lane = torch.arange(BLOCK // 2)
    shift = _Q4_1_SHIFT  # [16]
    return torch.cat([(words[..., lane % 4] >> shift) & 0xF, (words[..., lane % 4] >> (shift + 16)) & 0xF], dim=2)


def reference_matmul(x: torch.Tensor, cw: CompactWeight) -> torch.Tensor:
    """The plain reference of `matmul`: the decoded weights in a dense fp64 product (close to
    the kernel, not its bits): x [M, K] fp32 -> [M, N] fp32. For the int8 formats (q4_1_x8,
    q8_0_x8) the activations are first rounded as that mode rounds them (int8_activations.quantize_blocks)."""
    xd = int8_activations.dequantized(x) if cw.format in INT8_FORMATS else x.double()  # [M, K] fp64
    return (xd @ decode(cw).double().t()).float()


def with_int8_activations(cw: CompactWeight, *, panels: bool | None = None) -> CompactWeight:
    """The same Q4_1 or Q8_0 weights multiplied with int8 activations (int8_activations.py),
    repacked for that kernel: on column panels (int8_panels.py) where the CPU has AVX-512 VNNI
    (`panels` None), else in the first kernel's layout; both give the same bits. A weight of
    another format, or a Q8_0 weight that uses -128 (the kernels' sign trick cannot negate it;
    llama.cpp's quantiser never writes it), is returned as it is (exact fp32)."""
    if not int8_activations_available():
        return cw
    if panels is None:
        panels = panels_available()
    if panels and cw.format == "q4_1":
        return CompactWeight("q4_1_p16", cw.out_features, cw.in_features, int8_panels.pack_q4_1(_q4_1_values(cw)),
                             int8_panels.pack_scales(cw.scale), int8_panels.pack_scales(cw.offset))
    if panels and cw.format == "q8_0" and not bool((cw.q == -128).any()):
        values = cw.q.view(cw.out_features, cw.in_features // BLOCK, BLOCK)  # [N, K / 32, 32]
        return CompactWeight("q8_0_p16", cw.out_features, cw.in_features, int8_panels.pack_q8_0(values),
                             int8_panels.pack_scales(cw.scale), int8_panels.q8_column_sums(values))
    if cw.format == "q4_1":
        return CompactWeight("q4_1_x8", cw.out_features, cw.in_features, int8_activations.pack_weights(_q4_1_values(cw)),
                             cw.scale, cw.offset)
    if cw.format == "q8_0" and not bool((cw.q == -128).any()):
        values = cw.q.view(cw.out_features, cw.in_features // BLOCK, BLOCK)  # [N, K / 32, 32]
        return CompactWeight("q8_0_x8", cw.out_features, cw.in_features, int8_activations.pack_q8_weights(values),
                             cw.scale, None)
    return cw


def int8_activations_available() -> bool:
    """Whether the kernel was built with the int8-activation GEMM (it needs AVX2 + FMA)."""
    lib = load()
    if lib is None:
        return False
    lib.dspark_x8_supported.restype = ctypes.c_int
    return bool(lib.dspark_x8_supported())


def panels_available() -> bool:
    """Whether the kernel was built with the panel GEMM (AVX-512 F, BW and VNNI)."""
    return _panel_support() > 0


def _panel_support() -> int:  # dspark_p16_supported(): 0 none, 1 VNNI, 2 VNNI and AMX
    lib = load()
    if lib is None:
        return 0
    lib.dspark_p16_supported.restype = ctypes.c_int
    return int(lib.dspark_p16_supported())


def panels_use_amx() -> bool:
    """Whether the panel GEMM runs its AMX-tile path (from `amx_min_rows` rows on)."""
    return _panel_support() == 2


def set_panel_amx_min_rows(rows: int) -> int:
    """From how many rows the panel GEMM uses AMX tiles (a speed choice only: both paths give
    the same bits; tests force each). Returns the previous value."""
    lib = load()
    lib.dspark_p16_set_amx_min_rows.restype = ctypes.c_int64
    return int(lib.dspark_p16_set_amx_min_rows(rows))


_SOURCE = VECTOR_PRELUDE + r"""
#include <cstdint>
#include <cstring>
#include <immintrin.h>

namespace {

constexpr int64_t B = 32;  // weights per block

// a*b + c with one rounding where the CPU has FMA; otherwise two, the same two everywhere
inline v16 fmadd(v16 a, v16 b, v16 c) {
#if defined(__AVX512F__)
  return (v16)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c);
#elif defined(DSPARK_V16_PAIRS) && defined(__FMA__)
  return {(v8)_mm256_fmadd_ps((__m256)a.lo, (__m256)b.lo, (__m256)c.lo), (v8)_mm256_fmadd_ps((__m256)a.hi, (__m256)b.hi, (__m256)c.hi)};
#elif defined(__FMA__)
  __m256 a0, a1, b0, b1, c0, c1;
  std::memcpy(&a0, &a, 32); std::memcpy(&a1, reinterpret_cast<char*>(&a) + 32, 32);
  std::memcpy(&b0, &b, 32); std::memcpy(&b1, reinterpret_cast<char*>(&b) + 32, 32);
  std::memcpy(&c0, &c, 32); std::memcpy(&c1, reinterpret_cast<char*>(&c) + 32, 32);
  __m256 r0 = _mm256_fmadd_ps(a0, b0, c0), r1 = _mm256_fmadd_ps(a1, b1, c1);
  v16 r;
  std::memcpy(&r, &r0, 32); std::memcpy(reinterpret_cast<char*>(&r) + 32, &r1, 32);
  return r;
#else
  return a * b + c;
#endif
}

typedef uint8_t v16b __attribute__((vector_size(16)));
typedef int8_t v16sb __attribute__((vector_size(16)));
typedef uint32_t v4u __attribute__((vector_size(16)));

// 16 bytes -> 16 floats (exact: small integers), unsigned or signed. Written with intrinsics:
// GCC scalarises the generic int8 -> int32 vector conversion (~60 instructions instead of 2).
template <bool SIGNED>
inline v16 bytes_to_v16(const void* p) {
#if defined(__AVX512F__)
  const __m128i b = _mm_loadu_si128(static_cast<const __m128i*>(p));
  const __m512i i = SIGNED ? _mm512_cvtepi8_epi32(b) : _mm512_cvtepu8_epi32(b);
  return (v16)_mm512_cvtepi32_ps(i);
#elif defined(__AVX2__)
  const __m128i b = _mm_loadu_si128(static_cast<const __m128i*>(p));
  const __m128i b_hi = _mm_srli_si128(b, 8);
  const __m256 f0 = _mm256_cvtepi32_ps(SIGNED ? _mm256_cvtepi8_epi32(b) : _mm256_cvtepu8_epi32(b));
  const __m256 f1 = _mm256_cvtepi32_ps(SIGNED ? _mm256_cvtepi8_epi32(b_hi) : _mm256_cvtepu8_epi32(b_hi));
#if defined(DSPARK_V16_PAIRS)
  return {(v8)f0, (v8)f1};
#else
  v16 r;
  std::memcpy(&r, &f0, 32);
  std::memcpy(reinterpret_cast<char*>(&r) + 32, &f1, 32);
  return r;
#endif
#else
  if (SIGNED) { v16sb b; std::memcpy(&b, p, sizeof b); return __builtin_convertvector(__builtin_convertvector(b, v16i), v16); }
  v16b b; std::memcpy(&b, p, sizeof b);
  return __builtin_convertvector(__builtin_convertvector(b, v16i), v16);
#endif
}

// the prelude's hsum (the same fixed tree) on registers: its memcpy of halves makes the argument
// addressable, which keeps a kernel's accumulators on the stack for the whole loop
inline float lane_sum(v16 x) {
#if defined(DSPARK_V16_PAIRS)
  return hsum(x);  // the pair's hsum is already on registers
#else
  const v8 a = __builtin_shufflevector(x, x, 0, 1, 2, 3, 4, 5, 6, 7) + __builtin_shufflevector(x, x, 8, 9, 10, 11, 12, 13, 14, 15);
  const v4 b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
  return (b[0] + b[2]) + (b[1] + b[3]);
#endif
}

// x in every lane (one broadcast load; the prelude's splat adds 0.0, an extra scalar op)
#if defined(DSPARK_V16_PAIRS)
inline v16 bcast(float x) { return {v8{x, x, x, x, x, x, x, x}, v8{x, x, x, x, x, x, x, x}}; }
#else
inline v16 bcast(float x) { return v16{x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, x}; }
#endif

// 4 words (16 bytes) repeated over 16 lanes: one broadcast load (a generic shuffle of a 4-lane
// vector compiles to a store and a wider reload here, a stall per block)
inline v16u repeat_words(const uint32_t* p) {
#if defined(__AVX512F__)
  const __m512i r = _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#elif defined(__AVX2__)
  const __m256i h = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#if defined(DSPARK_V16_PAIRS)
  return {(v8u)h, (v8u)h};
#endif
  __m256i r[2] = {h, h};
#else
  uint32_t r[16];
  for (int i = 0; i < 16; ++i) r[i] = p[i % 4];
#endif
  v16u out;
  std::memcpy(&out, &r, sizeof out);
  return out;
}

// Block b of column n as its 32 exact fp32 weights (w0: weights 0..15, w1: 16..31). Every
// product here is exact (an fp16 scale times an integer of at most 8 bits fits fp32's 24-bit
// mantissa) and q4_1's one addition rounds as compact() checked, so these are the weights
// themselves, bit for bit, whichever path decodes them.
template <int FMT>
inline void decode_block(const void* q, const float* d, const float* mn, int64_t n, int64_t b, int64_t K,
                         v16& w0, v16& w1) {
  const int64_t nb = K / B;
  if (FMT == 0) {  // bf16 bits -> fp32
    const uint16_t* src = static_cast<const uint16_t*>(q) + n * K + b * B;
    v16h h0, h1;
    std::memcpy(&h0, src, sizeof h0);
    std::memcpy(&h1, src + W, sizeof h1);
    w0 = bits<v16>(widen(h0) << 16);
    w1 = bits<v16>(widen(h1) << 16);
  } else if (FMT == 1) {  // q8_0: d * int8
    const int8_t* src = static_cast<const int8_t*>(q) + n * K + b * B;
    const v16 s = bcast(d[n * nb + b]);
    w0 = bytes_to_v16<true>(src) * s;
    w1 = bytes_to_v16<true>(src + W) * s;
  } else {  // q4_1: d * q + m, the nibbles in 4 words a block (_pack_q4_1): 4 words repeated
    // over 16 lanes, lane i shifted by 4 (i / 4) for weights 0..15 and 16 more for 16..31
    const v16u all = repeat_words(static_cast<const uint32_t*>(q) + n * (K / 8) + b * 4);
    const v16u shift = bits<v16u>((iota() >> 2) << 2);  // 0,0,0,0, 4,4,4,4, 8,8,8,8, 12,12,12,12
    const v16 s = bcast(d[n * nb + b]), m = bcast(mn[n * nb + b]);
#if defined(__AVX512F__) && !defined(DSPARK_NO_TABLE_DECODE)
    // The block's 16 possible weights fma(j, d, m), j = 0..15, in one register, and each weight
    // looked up by its nibble (vpermps reads an index's low 4 bits only: no mask): the same
    // fma on the same operands as below, so the same bits, in 1 fma a block instead of 2 fma,
    // 2 conversions and 2 masks
    const v16 table = fmadd(to_f32(iota()), s, m);
    w0 = (v16)_mm512_permutexvar_ps((__m512i)(all >> shift), (__m512)table);
    w1 = (v16)_mm512_permutexvar_ps((__m512i)(all >> (shift + 16u)), (__m512)table);
#else
    const v16i lo = bits<v16i>((all >> shift) & 0xFu), hi = bits<v16i>((all >> (shift + 16u)) & 0xFu);
    // d·q is exact, so one fused multiply-add rounds exactly as d·q + m does
    w0 = fmadd(to_f32(lo), s, m);
    w1 = fmadd(to_f32(hi), s, m);
#endif
  }
}

// y[r][n0 + c] for R rows and NC consecutive columns, weights decoded in registers. The
// arithmetic of one (row, column) is fixed: one 16-lane accumulator, acc = fma(x_lo, w_lo, acc),
// acc = fma(x_hi, w_hi, acc) block by block, then the fixed-tree lane sum. R and NC only decide
// which (row, column) pairs share a pass over the weights, never what any of them computes.
template <int FMT, int R, int NC>
inline void tile(const float* x, int64_t ldx, int64_t K, const void* q, const float* d, const float* mn,
                 int64_t n0, float* y, int64_t ldy) {
  v16 acc[R * NC];
#pragma GCC unroll 32
  for (int i = 0; i < R * NC; ++i) acc[i] = v16{};
  for (int64_t b = 0; b < K / B; ++b) {
    v16 w0[NC], w1[NC];
#pragma GCC unroll 8
    for (int c = 0; c < NC; ++c) decode_block<FMT>(q, d, mn, n0 + c, b, K, w0[c], w1[c]);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const v16 x0 = load(x + r * ldx + b * B), x1 = load(x + r * ldx + b * B + W);
#pragma GCC unroll 8
      for (int c = 0; c < NC; ++c) acc[r * NC + c] = fmadd(x1, w1[c], fmadd(x0, w0[c], acc[r * NC + c]));
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < NC; ++c) y[r * ldy + n0 + c] = lane_sum(acc[r * NC + c]);
}

// tile<FMT, 1, 4> with its four accumulators as named variables: GCC keeps an array of vector
// accumulators on the stack through the loop (a store and reload per block); this is the one
// row of plain decoding, where that costs most. The arithmetic is tile's, step for step.
template <int FMT>
inline void row_times_4_columns(const float* x, int64_t K, const void* q, const float* d, const float* mn,
                                int64_t n0, float* y) {
  v16 a0 = {}, a1 = {}, a2 = {}, a3 = {};
  for (int64_t b = 0; b < K / B; ++b) {
    const v16 x0 = load(x + b * B), x1 = load(x + b * B + W);
    v16 w0, w1;
    decode_block<FMT>(q, d, mn, n0, b, K, w0, w1);
    a0 = fmadd(x1, w1, fmadd(x0, w0, a0));
    decode_block<FMT>(q, d, mn, n0 + 1, b, K, w0, w1);
    a1 = fmadd(x1, w1, fmadd(x0, w0, a1));
    decode_block<FMT>(q, d, mn, n0 + 2, b, K, w0, w1);
    a2 = fmadd(x1, w1, fmadd(x0, w0, a2));
    decode_block<FMT>(q, d, mn, n0 + 3, b, K, w0, w1);
    a3 = fmadd(x1, w1, fmadd(x0, w0, a3));
  }
  y[n0] = lane_sum(a0);
  y[n0 + 1] = lane_sum(a1);
  y[n0 + 2] = lane_sum(a2);
  y[n0 + 3] = lane_sum(a3);
}

// all rows against the columns n0 .. n0 + NC - 1: row tiles of 8 (AVX-512: 32 vector registers
// hold the 16 accumulators) or 4, then the remainder
template <int FMT, int NC>
inline void column_tile(const float* x, int64_t ldx, int64_t M, int64_t K, const void* q, const float* d,
                        const float* mn, int64_t n0, float* y, int64_t ldy) {
  int64_t r = 0;
#if defined(__AVX512F__)
  for (; r + 8 <= M; r += 8) tile<FMT, 8, NC>(x + r * ldx, ldx, K, q, d, mn, n0, y + r * ldy, ldy);
#endif
  for (; r + 4 <= M; r += 4) tile<FMT, 4, NC>(x + r * ldx, ldx, K, q, d, mn, n0, y + r * ldy, ldy);
  const float* xr = x + r * ldx;
  float* yr = y + r * ldy;
  switch (M - r) {
    case 3: tile<FMT, 3, NC>(xr, ldx, K, q, d, mn, n0, yr, ldy); break;
    case 2: tile<FMT, 2, NC>(xr, ldx, K, q, d, mn, n0, yr, ldy); break;
    case 1: tile<FMT, 1, NC>(xr, ldx, K, q, d, mn, n0, yr, ldy); break;
    default: break;
  }
}

template <int FMT>
void gemm(const float* x, int64_t ldx, int64_t M, int64_t K, const void* q, const float* d, const float* mn,
          int64_t N, float* y, int64_t ldy, int threads) {
  // one row: four columns share a pass (four independent FMA chains hide the FMA latency);
  // more rows: two columns, so a 4-row tile's 8 accumulators and its weights stay in registers
  const int64_t nc = M == 1 ? 4 : 2;
  const int64_t tiles = N / nc, tail = N - tiles * nc;
  const int use = (M * N * K < (1 << 18)) ? 1 : threads;
  // rows in blocks whose x stays in L2 (~128 KB) while every column passes over them
  int64_t block = (32768 / K) / 8 * 8;
  if (block < 8) block = 8;
#pragma omp parallel num_threads(use)
  for (int64_t r0 = 0; r0 < M; r0 += block) {
    const int64_t m = M - r0 < block ? M - r0 : block;
    const float* xb = x + r0 * ldx;
    float* yb = y + r0 * ldy;
#pragma omp for schedule(static)
    for (int64_t t = 0; t < tiles + tail; ++t) {
      if (t < tiles) {
        if (nc == 4) row_times_4_columns<FMT>(x, K, q, d, mn, t * 4, y);  // M == 1
        else column_tile<FMT, 2>(xb, ldx, m, K, q, d, mn, t * 2, yb, ldy);
      } else {
        column_tile<FMT, 1>(xb, ldx, m, K, q, d, mn, tiles * nc + (t - tiles), yb, ldy);
      }
    }
  }
}


#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__) && !defined(DSPARK_V16_GEMM)
// AVX2 (16 registers of 8 lanes). The v16 code above keeps 16-lane values in memory here (a
// pair of halves behind memcpy: ~80 ms of GEMMs a token instead of ~8), so this path spells the
// same arithmetic on explicit halves: the v16 accumulator's lanes 0..7 and 8..15 are a[0] and
// a[1], its weights 0..15 / 16..31 are w[0..1] / w[2..3]. Every output gets the bits the
// AVX-512 path computes, through the same FMAs in the same order and the same lane-sum tree.
namespace avx2 {

// Block b of column n as 4 x 8 exact fp32 weights: w[j] holds weights 8j .. 8j + 7.
template <int FMT>
inline void decode(const void* q, const float* d, const float* mn, int64_t n, int64_t b, int64_t K, __m256 w[4]) {
  const int64_t nb = K / B;
  if (FMT == 0) {  // bf16 bits -> fp32
    const __m128i* src = reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(q) + n * K + b * B);
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j)
      w[j] = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(src + j)), 16));
  } else if (FMT == 1) {  // q8_0: d * int8
    const int8_t* src = static_cast<const int8_t*>(q) + n * K + b * B;
    const __m256 s = _mm256_broadcast_ss(d + n * nb + b);
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) {
      const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(src + 8 * j));
      w[j] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes)), s);
    }
  } else {  // q4_1: the 4 words in both halves; weights 8j .. 8j + 7 shifted by 8j, 8j + 4
    const __m256i all = _mm256_broadcastsi128_si256(
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint32_t*>(q) + n * (K / 8) + b * 4)));
    const __m256i mask = _mm256_set1_epi32(0xF);
    const __m256 s = _mm256_broadcast_ss(d + n * nb + b), m = _mm256_broadcast_ss(mn + n * nb + b);
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) {
      const __m256i shift = _mm256_setr_epi32(8 * j, 8 * j, 8 * j, 8 * j, 8 * j + 4, 8 * j + 4, 8 * j + 4, 8 * j + 4);
      const __m256 qj = _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srlv_epi32(all, shift), mask));
      w[j] = _mm256_fmadd_ps(qj, s, m);  // d·q exact: one rounding, as compact() checked
    }
  }
}

// lane_sum of the v16 (a0 | a1): halves added, then 4 -> 2 -> 1 as (b0 + b2) + (b1 + b3)
inline float lane_sum(__m256 a0, __m256 a1) {
  const __m256 a = _mm256_add_ps(a0, a1);
  const __m128 b = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  const __m128 c = _mm_add_ps(b, _mm_movehl_ps(b, b));  // c0 = b0 + b2, c1 = b1 + b3
  return _mm_cvtss_f32(_mm_add_ss(c, _mm_shuffle_ps(c, c, 1)));
}

// R rows x NC columns; the (row, column) arithmetic is tile()'s above, whatever R and NC
template <int FMT, int R, int NC>
inline void tile(const float* x, int64_t ldx, int64_t K, const void* q, const float* d, const float* mn,
                 int64_t n0, float* y, int64_t ldy) {
  __m256 a[R * NC][2];
#pragma GCC unroll 32
  for (int i = 0; i < R * NC; ++i) a[i][0] = a[i][1] = _mm256_setzero_ps();
  for (int64_t b = 0; b < K / B; ++b) {
#pragma GCC unroll 8
    for (int c = 0; c < NC; ++c) {
      __m256 w[4];
      decode<FMT>(q, d, mn, n0 + c, b, K, w);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const float* xr = x + r * ldx + b * B;
        __m256* acc = a[r * NC + c];
        acc[0] = _mm256_fmadd_ps(_mm256_loadu_ps(xr + 16), w[2], _mm256_fmadd_ps(_mm256_loadu_ps(xr), w[0], acc[0]));
        acc[1] = _mm256_fmadd_ps(_mm256_loadu_ps(xr + 24), w[3], _mm256_fmadd_ps(_mm256_loadu_ps(xr + 8), w[1], acc[1]));
      }
    }
  }
#pragma GCC unroll 32
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int c = 0; c < NC; ++c) y[r * ldy + n0 + c] = lane_sum(a[r * NC + c][0], a[r * NC + c][1]);
}

// one row: 2 columns a pass for q4_1 and bf16, 1 for q8_0 (more columns spill the decode's
// registers: 4 columns cost q8_0's LM head 3.6 ms a token instead of 1.8 on a Zen 3 core);
// more rows: one column a pass over row tiles of 4 (8 accumulators; a block decoded once for 4 rows)
template <int FMT>
void gemm(const float* x, int64_t ldx, int64_t M, int64_t K, const void* q, const float* d, const float* mn,
          int64_t N, float* y, int64_t ldy, int threads) {
  const int use = (M * N * K < (1 << 18)) ? 1 : threads;
  if (M == 1) {
    constexpr int NC = FMT == 1 ? 1 : 2;
    const int64_t tiles = N / NC;
#pragma omp parallel for num_threads(use) schedule(static)
    for (int64_t t = 0; t < tiles + (N - tiles * NC); ++t) {
      if (t < tiles) tile<FMT, 1, NC>(x, ldx, K, q, d, mn, t * NC, y, ldy);
      else tile<FMT, 1, 1>(x, ldx, K, q, d, mn, tiles * NC + (t - tiles), y, ldy);
    }
    return;
  }
  // rows in blocks whose x stays in L2 (~128 KB) while every column passes over them: with all M
  // rows per column, a prefill's x (MBs) came from memory once per column (2.5x slower at M = 512)
  int64_t block = (32768 / K) / 4 * 4;
  if (block < 4) block = 4;
#pragma omp parallel num_threads(use)
  for (int64_t r0 = 0; r0 < M; r0 += block) {
    const int64_t m = M - r0 < block ? M - r0 : block;
    const float* xb = x + r0 * ldx;
    float* yb = y + r0 * ldy;
#pragma omp for schedule(static)
    for (int64_t n = 0; n < N; ++n) {
      int64_t r = 0;
      for (; r + 4 <= m; r += 4) tile<FMT, 4, 1>(xb + r * ldx, ldx, K, q, d, mn, n, yb + r * ldy, ldy);
      const float* xr = xb + r * ldx;
      float* yr = yb + r * ldy;
      switch (m - r) {
        case 3: tile<FMT, 3, 1>(xr, ldx, K, q, d, mn, n, yr, ldy); break;
        case 2: tile<FMT, 2, 1>(xr, ldx, K, q, d, mn, n, yr, ldy); break;
        case 1: tile<FMT, 1, 1>(xr, ldx, K, q, d, mn, n, yr, ldy); break;
        default: break;
      }
    }
  }
}

}  // namespace avx2
#define DSPARK_GEMM avx2::gemm
#else
#define DSPARK_GEMM gemm
#endif

}  // namespace
""" + int8_activations.GEMM_SOURCE + int8_panels.GEMM_SOURCE + r"""
extern "C" {

int dspark_x8_supported() { return x8::kSupported ? 1 : 0; }

// 0: no panel GEMM; 1: its VNNI path; 2: VNNI and AMX tiles
int dspark_p16_supported() { return p16::kSupported ? (p16::kAmx ? 2 : 1) : 0; }

int64_t dspark_p16_set_amx_min_rows(int64_t rows) {
  const int64_t previous = p16::amx_min_rows;
  p16::amx_min_rows = rows;
  return previous;
}

// one row x [K] quantised as the int8 GEMM quantises it, into out [ceil(K / 256) * 320] bytes
// (the layout of int8_activations.py; for tests)
void dspark_x8_quantize_row(const float* x, int64_t K, uint8_t* out) {
#if defined(__AVX2__) && defined(__FMA__)
  x8::quantize_row(x, K, out);
#endif
}

// y [M, N] (row stride ldy) = x [M, K] (row stride ldx, fp32) · Wᵀ, W in `format`
// (0 bf16, 1 q8_0, 2 q4_1, 3 q4_1 and 4 q8_0 with int8 activations, 5 and 6 the same on column panels; compact_weights.py): q as described there, d and mn [N, K / 32]
// fp32 (mn only for q4_1). K % 32 == 0. Threads split the columns.
void dspark_compact_gemm(const float* x, int64_t ldx, int64_t M, int64_t K, int format, const void* q,
                         const float* d, const float* mn, int64_t N, float* y, int64_t ldy, int threads) {
  if (format == 0) DSPARK_GEMM<0>(x, ldx, M, K, q, d, mn, N, y, ldy, threads);
  else if (format == 1) DSPARK_GEMM<1>(x, ldx, M, K, q, d, mn, N, y, ldy, threads);
  else if (format == 2) DSPARK_GEMM<2>(x, ldx, M, K, q, d, mn, N, y, ldy, threads);
  else if (format == 3) x8::gemm<0>(x, ldx, M, K, q, d, mn, N, y, ldy, threads);
  else if (format == 4) x8::gemm<1>(x, ldx, M, K, q, d, mn, N, y, ldy, threads);
  else if (format == 5) p16::gemm<0>(x, ldx, M, K, q, d, mn, N, y, ldy, threads);
  else p16::gemm<1>(x, ldx, M, K, q, d, mn, N, y, ldy, threads);
}

}  // extern "C"
"""

_i64, _ptr = ctypes.c_int64, ctypes.c_void_p
_SIGNATURES = {
    "dspark_compact_gemm": [_ptr, _i64, _i64, _i64, ctypes.c_int, _ptr, _ptr, _ptr, _i64, _ptr, _i64, ctypes.c_int],
    "dspark_x8_supported": [],
    "dspark_x8_quantize_row": [_ptr, _i64, _ptr],
    "dspark_p16_supported": [],
    "dspark_p16_set_amx_min_rows": [_i64],
}
_LIBRARY = LazyLibrary(_SOURCE, "compact_gemm", _SIGNATURES, fallback="weights stay dense")
# the 16-lane vector code on every CPU: the reference the AVX2 path must equal bit for bit
_V16_LIBRARY = LazyLibrary("#define DSPARK_V16_GEMM 1\n#define DSPARK_NATIVE_V16 1\n" + _SOURCE, "compact_gemm_v16", _SIGNATURES,
                           fallback="no v16 reference")


# the q4_1 decode by conversion and fma on every CPU: the reference the table decode must equal bit for bit
_NO_TABLE_LIBRARY = LazyLibrary("#define DSPARK_NO_TABLE_DECODE 1\n" + _SOURCE, "compact_gemm_no_table", _SIGNATURES,
                                fallback="no conversion-decode reference")


def no_table_matmul(x: torch.Tensor, cw: CompactWeight) -> torch.Tensor:
    """`matmul` with the q4_1 weights decoded by conversion and fma instead of a table lookup."""
    return _run(_NO_TABLE_LIBRARY.get(), x, cw, None)


def load() -> ctypes.CDLL | None:
    """The compiled kernel (built on first use, about a second), or None where that fails."""
    return _LIBRARY.get()


def available() -> bool:
    return load() is not None


def unavailable_reason() -> str | None:
    """Why the kernels are not available (the compiler's error), or None where they are."""
    return None if available() else _LIBRARY.error


def matmul(x: torch.Tensor, cw: CompactWeight, out: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] fp32 (last dim contiguous) -> x Wᵀ [M, N] fp32, through the kernel."""
    return _run(load(), x, cw, out)


def v16_matmul(x: torch.Tensor, cw: CompactWeight) -> torch.Tensor:
    """`matmul` through the generic 16-lane code whatever the CPU (the AVX2 path's reference)."""
    return _run(_V16_LIBRARY.get(), x, cw, None)


def _run(library: ctypes.CDLL, x: torch.Tensor, cw: CompactWeight, out: torch.Tensor | None) -> torch.Tensor:
    m, k = x.shape
    if k != cw.in_features or x.dtype != torch.float32 or x.stride(1) != 1:
        raise ValueError(f"x must be fp32 [M, {cw.in_features}] with a contiguous last dim, got {x.dtype} {tuple(x.shape)}")
    n = cw.out_features
    if out is None:
        out = torch.empty(m, n)
    else:
        assert out.dtype == torch.float32 and out.shape == (m, n) and out.stride(1) == 1
    fmt, q, scale, offset = cw.kernel_args
    library.dspark_compact_gemm(x.data_ptr(), x.stride(0), m, k, fmt, q, scale, offset, n, out.data_ptr(), out.stride(0),
                               torch.get_num_threads())
    return out


class CompactLinear(torch.nn.Module):
    """y = x Wᵀ with W held compact (fp32 in, fp32 out), batch-invariant for any number of rows.

    The same contract as transformer.SplitKLinear, which the transformer's fused path reads:
    `dtype` (of the inputs it takes), `bounds` (its K-chunks: one, the kernel is batch-invariant
    at any K, so nothing is split) and `partial(x, j)` (chunk j's product)."""

    def __init__(self, weight: CompactWeight):
        super().__init__()
        self.weight = weight
        self.in_features, self.out_features = weight.in_features, weight.out_features
        self.bounds = [0, weight.in_features]

    dtype = torch.float32

    def partial(self, x: torch.Tensor, j: int = 0) -> torch.Tensor:
        # x: [num_tokens, in_features] fp32 -> [num_tokens, out_features] fp32
        assert j == 0
        return matmul(x, self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [num_tokens, in_features] -> [num_tokens, out_features] fp32
        return matmul(x.float().contiguous(), self.weight)

    def extra_repr(self) -> str:
        return f"{self.in_features}, {self.out_features}, format={self.weight.format}"
