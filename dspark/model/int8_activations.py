"""Int8 activations for Q4_1 and Q8_0 weights: the opt-in `weights = "compact-int8"` numerics.

The exact compact kernel (compact_weights.py) decodes every Q4_1 block to 32 fp32 weights and
does one fp32 FMA per weight and row: at one row the decode bounds it, from ~4 rows the FMAs do
(docs/results/compact_weights.md), so a verify step of 8 tokens costs 2-3x a decode step and
speculation has little room. llama.cpp's Q4_1 path (its Q4_1 x Q8_1 dot product) instead rounds
the activations to 8 bits per block of 32 and multiplies integers, 32-64 products an instruction.
This module is that design, in our own layout, as an explicit mode (on CPUs with AVX-512 VNNI
the same numerics run on column panels, int8_panels.py, with the same bits):

    s_b  = amax_b / 127,  xq_j = round_half_even(x_j · (127 / amax_b))     per row, per block b of 32
    y    = Σ_b s_b · (d_b · Σ_j q_j xq_j  +  m_b · Σ_j xq_j)                 (w_j = d_b q_j + m_b, Q4_1)
    y    = Σ_b s_b · (d_b · Σ_j q_j xq_j)                                    (w_j = d_b q_j, Q8_0: the LM head)

What changes and what does not:
- the model: each row of activations entering a Q4_1 or Q8_0 weight (every decoder GEMM and,
  in the default model, the tied Q8_0 LM head) is replaced by its block-rounded copy x̂ = s · xq
  (relative error ≤ 1/254 of the block's largest value), as llama.cpp's Q8_0 x Q8_0 head does.
  The weights, attention, norms, logits and probabilities are as before, all fp32 (logits are
  fp32 sums of exact integer block products, never rounded to fewer bits). Greedy output can
  differ from the exact model's; `bench_weights.py --agreement` measures by how much. A Q8_0
  weight that uses the value -128 stays on the exact fp32 kernel (the sign trick below cannot
  negate it; llama.cpp's quantiser never writes it).
- batch invariance, which greedy speculative decoding rests on: the integer sums Σ q xq are exact
  whatever the instruction (AVX-512 VNNI `vpdpbusd`, AVX-VNNI, or AVX2's `vpmaddubsw` +
  `vpmaddwd`: no intermediate can saturate, see block_dots), and the fp32 epilogue of one (row,
  column) is a fixed sequence over groups g of 8 blocks, one block per lane:
        t = I · d + X · m;   acc = fma(t, s, acc)          (I = Σ q xq, X = Σ xq, 8 lanes; Q8_0: t = I · d)
  then one fixed lane-sum tree. The quantisation of a row depends on that row only. So a row's
  result has the same bits whatever M, the tile, the threads or the instruction set.
- exactness of speculation: the verifier's probabilities are this model's, and rejection sampling
  is exact with respect to them (docs/method.md §1); plain and speculative decoding in this mode
  give the same greedy tokens (tests/model/test_int8_activations.py).

Layouts, per group g of 8 blocks (256 weights of a column, 256 activations of a row); block
8g + l is lane l, and of its 32 values, j = 8t + 4h + k (t, k in 0..3, h in 0..1) goes to byte
4l + k of register t, as a low nibble (h = 0) or a high one (h = 1):
- weights (pack_weights): 4 registers of 32 bytes, each byte two nibbles; the last group of a
  K that is not a multiple of 256 has `lanes` < 8 blocks, and its registers 4 · lanes bytes
  (masked loads), so a column is K / 2 bytes, like the exact kernel's packing. d and m stay
  [N, K / 32] fp32: a group's 8 scales are 8 consecutive floats, one load.
- a quantised row (built in the kernel): 4 registers of int8 xq for the low nibbles, 4 for the
  high ones, then 8 fp32 X and 8 fp32 s, 320 bytes a group. Masking the weight bytes with 0x0F
  and shifting them by 4 gives the u8 operands of 8 `vpdpbusd` whose int32 lane l sums the 32
  products of block l: no shuffle, and the epilogue costs 4 fp32 ops per 256 weights and row.
- Q8_0 weights (pack_q8_weights): 8 registers of 32 signed bytes a group, register 4h + t
  holding what register t's low (h = 0) or high (h = 1) nibbles hold for Q4_1, so they meet
  the same 8 activation registers; a column is K bytes, d stays [N, K / 32] fp32. With VNNI
  the row's bytes go in with their sign bit flipped (xq + 128, unsigned) and the column's
  128 · Σ w per block, one more `vpdpbusd` pass per column and group, is subtracted: 8
  `vpdpbusd` per 256 weights and row, as for Q4_1 (block_dots_q8).
"""

from __future__ import annotations

import torch

BLOCK = 32


def quantize_blocks(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] fp32 -> (xq [M, K] fp32 holding integers in -127..127, s [M, K / 32] fp32), as
    the kernel rounds them: the reference of its quantisation."""
    m, k = x.shape
    blocks = x.float().reshape(m, k // BLOCK, BLOCK)  # [M, K / 32, 32]
    amax = blocks.abs().amax(dim=2)  # [M, K / 32]
    # tensor / tensor: an IEEE division, as the kernel's (torch's `127.0 / t` is 127 · (1 / t),
    # which rounds twice and differs in the last bit)
    safe = torch.where(amax > 0, amax, torch.ones_like(amax))
    inverse = torch.where(amax > 0, torch.full_like(amax, 127.0) / safe, torch.zeros_like(amax))
    xq = torch.round(blocks * inverse.unsqueeze(2))  # round half to even, as the kernel's cvtps
    return xq.reshape(m, k), amax / torch.full_like(amax, 127.0)


def dequantized(x: torch.Tensor) -> torch.Tensor:
    """x̂ = s · xq [M, K] in fp64: the activations the int8 mode multiplies by (exactly)."""
    xq, s = quantize_blocks(x)
    m, k = x.shape
    return (xq.double().view(m, k // BLOCK, BLOCK) * s.double().unsqueeze(2)).view(m, k)


def _byte_of(num_blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
    """For each block b and value j of a column: the byte it lives in and its shift (0 / 4)."""
    b = torch.arange(num_blocks).unsqueeze(1)  # [nb, 1]
    j = torch.arange(BLOCK).unsqueeze(0)  # [1, 32]
    g, lane = b // 8, b % 8
    lanes = torch.clamp(num_blocks - 8 * g, max=8)  # blocks in b's group
    t, h, k = j // 8, (j // 4) % 2, j % 4
    return g * 128 + t * 4 * lanes + 4 * lane + k, 4 * h  # [nb, 32] each


def _q8_byte_of(num_blocks: int) -> torch.Tensor:
    """For each block b and value j of a Q8_0 column: its byte in the q8_0_x8 layout (value j =
    8t + 4h + k of lane l's block is byte 4l + k of register 4h + t: the activation register it
    meets, so one `vpdpbusd` per register needs no shuffle)."""
    b = torch.arange(num_blocks).unsqueeze(1)  # [nb, 1]
    j = torch.arange(BLOCK).unsqueeze(0)  # [1, 32]
    g, lane = b // 8, b % 8
    lanes = torch.clamp(num_blocks - 8 * g, max=8)
    t, h, k = j // 8, (j // 4) % 2, j % 4
    return g * 256 + (4 * h + t) * 4 * lanes + 4 * lane + k  # [nb, 32]


def pack_q8_weights(q: torch.Tensor) -> torch.Tensor:
    """Q8_0 values q [N, K / 32, 32] (-127..127) -> the kernel's q8_0_x8 bytes [N, K] int8."""
    n, nb, _ = q.shape
    if (q < -127).any() or (q > 127).any():
        raise ValueError("q8_0_x8 takes values in -127..127 (the sign trick cannot negate -128)")
    out = torch.empty(n, nb * BLOCK, dtype=torch.int8)
    out[:, _q8_byte_of(nb).reshape(-1)] = q.reshape(n, -1).to(torch.int8)
    return out


def unpack_q8_weights(packed: torch.Tensor) -> torch.Tensor:
    """pack_q8_weights' inverse: [N, K] int8 -> q [N, K / 32, 32] int64."""
    n, k = packed.shape
    return packed.long()[:, _q8_byte_of(k // BLOCK).reshape(-1)].view(n, -1, BLOCK)


def pack_weights(q: torch.Tensor) -> torch.Tensor:
    """Q4_1 values q [N, K / 32, 32] (0..15) -> the kernel's int8-mode bytes [N, K / 2] uint8."""
    n, nb, _ = q.shape
    byte, shift = _byte_of(nb)
    out = torch.zeros(n, nb * BLOCK // 2, dtype=torch.int32)
    out.index_add_(1, byte.reshape(-1), (q.int() << shift.int()).reshape(n, -1))  # two disjoint nibbles a byte: sum = or
    return out.to(torch.uint8)


def unpack_weights(packed: torch.Tensor) -> torch.Tensor:
    """pack_weights' inverse: [N, K / 2] uint8 -> q [N, K / 32, 32] int64."""
    n, half = packed.shape
    byte, shift = _byte_of(half * 2 // BLOCK)
    return (packed.long()[:, byte.reshape(-1)].view(n, -1, BLOCK) >> shift) & 0xF


# C++ of the int8-activation GEMM, compiled into compact_weights' library (format code 3). Needs
# AVX2 + FMA; uses AVX-512 VNNI or AVX-VNNI where the CPU has them (the same integers either way).
GEMM_SOURCE = r"""
#include <cmath>
#include <cstdlib>

namespace x8 {

#if defined(__AVX2__) && defined(__FMA__)
constexpr bool kSupported = true;
constexpr int64_t GROUP = 256;       // weights of a column (activations of a row) per group of 8 blocks
constexpr int64_t GROUP_BYTES = 320;  // a quantised row's bytes per group (int8_activations.py)

inline int64_t num_groups(int64_t K) { return (K + GROUP - 1) / GROUP; }

// One row x [K] -> its quantised groups (layout: int8_activations.py); lanes past the last
// block of a partial group stay zero.
inline void quantize_row(const float* x, int64_t K, uint8_t* out) {
  std::memset(out, 0, static_cast<size_t>(num_groups(K) * GROUP_BYTES));
  for (int64_t b = 0; b < K / 32; ++b) {
    uint8_t* group = out + (b / 8) * GROUP_BYTES;
    const int lane = static_cast<int>(b % 8);
    const float* xb = x + b * 32;
    float amax = 0.f;
    for (int j = 0; j < 32; ++j) amax = std::fmax(amax, std::fabs(xb[j]));
    const float inverse = amax > 0.f ? 127.f / amax : 0.f;
    int q[32];
    int sum = 0;
    for (int j = 0; j < 32; ++j) {
      q[j] = static_cast<int>(std::nearbyint(xb[j] * inverse));  // half to even (the default rounding mode)
      sum += q[j];
    }
    for (int t = 0; t < 4; ++t)
      for (int k = 0; k < 4; ++k) {
        group[32 * t + 4 * lane + k] = static_cast<uint8_t>(static_cast<int8_t>(q[8 * t + k]));
        group[128 + 32 * t + 4 * lane + k] = static_cast<uint8_t>(static_cast<int8_t>(q[8 * t + 4 + k]));
      }
    reinterpret_cast<float*>(group + 256)[lane] = static_cast<float>(sum);
    reinterpret_cast<float*>(group + 288)[lane] = amax / 127.f;
  }
}

inline __m256i load_or_mask(const uint8_t* p, int lanes, __m256i mask) {
  return lanes == 8 ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))
                    : _mm256_maskload_epi32(reinterpret_cast<const int*>(p), mask);
}

// Σ_j q_j xq_j of each lane's block (8 blocks, one per int32 lane): exact on every path. w: the
// 4 registers of low nibbles then the 4 of high ones; x: the row's 8 matching int8 registers.
inline __m256i block_dots(const __m256i w[8], const uint8_t* x) {
  const __m256i* xv = reinterpret_cast<const __m256i*>(x);
#if (defined(__AVX512VNNI__) && defined(__AVX512VL__) || defined(__AVXVNNI__)) && !defined(DSPARK_X8_NO_VNNI)
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define DSPARK_DPBUSD _mm256_dpbusd_epi32
#else
#define DSPARK_DPBUSD _mm256_dpbusd_avx_epi32
#endif
  __m256i a = _mm256_setzero_si256(), b = _mm256_setzero_si256();  // two chains: half the latency
#pragma GCC unroll 4
  for (int t = 0; t < 4; ++t) {
    a = DSPARK_DPBUSD(a, w[t], _mm256_loadu_si256(xv + t));
    b = DSPARK_DPBUSD(b, w[4 + t], _mm256_loadu_si256(xv + 4 + t));
  }
#undef DSPARK_DPBUSD
  return _mm256_add_epi32(a, b);
#else
  // u8 x s8 pairs into int16: a lane of one register is at most 2 · 15 · 127 = 3810, the 8
  // registers' sum at most 30480 < 2^15 (xq is never -128), so nothing saturates
  __m256i s[8];
#pragma GCC unroll 8
  for (int i = 0; i < 8; ++i) s[i] = _mm256_maddubs_epi16(w[i], _mm256_loadu_si256(xv + i));
  const __m256i sum16 = _mm256_add_epi16(_mm256_add_epi16(_mm256_add_epi16(s[0], s[1]), _mm256_add_epi16(s[2], s[3])),
                                         _mm256_add_epi16(_mm256_add_epi16(s[4], s[5]), _mm256_add_epi16(s[6], s[7])));
  return _mm256_madd_epi16(sum16, _mm256_set1_epi16(1));
#endif
}

// The same for Q8_0 weights (signed bytes in -127..127, pack_q8_weights), in two steps so that
// what depends only on a row or only on a column is done once per tile:
//   q8_row_operands: a row's 8 registers as the dot products take them;
//   q8_column_sums:  with VNNI, 128 · Σ_j w_j of each lane's block (a column's, once per group);
//   block_dots_q8:   Σ_j w_j xq_j of each lane's block, exact:
//     VNNI  `vpdpbusd` takes an unsigned operand: xq + 128 (0..255: the row's bytes with the sign
//           bit flipped), and Σ (xq + 128) w − 128 Σ w = Σ xq w (|each| < 2^21: no overflow);
//     AVX2  |xq| times w with xq's sign (vpsignb), pairs summed in int16 (at most 2 · 127 · 127 =
//           32258 < 2^15: no saturation), widened per register.
#if (defined(__AVX512VNNI__) && defined(__AVX512VL__) || defined(__AVXVNNI__)) && !defined(DSPARK_X8_NO_VNNI)
#define DSPARK_X8_Q8_VNNI 1
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define DSPARK_DPBUSD _mm256_dpbusd_epi32
#else
#define DSPARK_DPBUSD _mm256_dpbusd_avx_epi32
#endif
#endif

inline void q8_row_operands(const uint8_t* x, __m256i out[8]) {
  const __m256i* xv = reinterpret_cast<const __m256i*>(x);
#pragma GCC unroll 8
  for (int i = 0; i < 8; ++i) {
#if defined(DSPARK_X8_Q8_VNNI)
    out[i] = _mm256_xor_si256(_mm256_loadu_si256(xv + i), _mm256_set1_epi8(static_cast<char>(0x80)));
#else
    out[i] = _mm256_loadu_si256(xv + i);
#endif
  }
}

inline __m256i q8_column_sums(const __m256i w[8]) {
#if defined(DSPARK_X8_Q8_VNNI)
  const __m256i ones = _mm256_set1_epi8(1);
  __m256i a = _mm256_setzero_si256(), b = _mm256_setzero_si256();
#pragma GCC unroll 4
  for (int t = 0; t < 4; ++t) {
    a = DSPARK_DPBUSD(a, ones, w[t]);
    b = DSPARK_DPBUSD(b, ones, w[4 + t]);
  }
  return _mm256_slli_epi32(_mm256_add_epi32(a, b), 7);
#else
  (void)w;
  return _mm256_setzero_si256();
#endif
}

inline __m256i block_dots_q8(const __m256i w[8], const __m256i x[8], __m256i column_sums) {
#if defined(DSPARK_X8_Q8_VNNI)
  __m256i a = _mm256_setzero_si256(), b = _mm256_setzero_si256();  // two chains: half the latency
#pragma GCC unroll 4
  for (int t = 0; t < 4; ++t) {
    a = DSPARK_DPBUSD(a, x[t], w[t]);
    b = DSPARK_DPBUSD(b, x[4 + t], w[4 + t]);
  }
  return _mm256_sub_epi32(_mm256_add_epi32(a, b), column_sums);
#else
  (void)column_sums;
  const __m256i ones = _mm256_set1_epi16(1);
  __m256i acc = _mm256_setzero_si256();
#pragma GCC unroll 8
  for (int i = 0; i < 8; ++i)
    acc = _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_abs_epi8(x[i]), _mm256_sign_epi8(w[i], x[i])), ones));
  return acc;
#endif
}
#if defined(DSPARK_X8_Q8_VNNI)
#undef DSPARK_DPBUSD
#endif

// 8 lanes -> 1 by a fixed tree: (lanes 0..3 + 4..7), then 4 -> 2 -> 1
inline float lane_sum8(__m256 a) {
  const __m128 b = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  const __m128 c = _mm_add_ps(b, _mm_movehl_ps(b, b));
  return _mm_cvtss_f32(_mm_add_ss(c, _mm_shuffle_ps(c, c, 1)));
}

// weight formats of the int8 GEMM: WF 0 = Q4_1 (format q4_1_x8), 1 = Q8_0 (format q8_0_x8)

// y[r][n0 + c] for R quantised rows and NC consecutive columns; the arithmetic of one (row,
// column) is the module docstring's, whatever R and NC
template <int WF, int R, int NC>
inline void tile(const uint8_t* xq, int64_t ldq, int64_t K, const uint8_t* q, const float* d, const float* mn,
                 int64_t n0, float* y, int64_t ldy) {
  const int64_t nb = K / 32, col_bytes = WF == 0 ? K / 2 : K;
  constexpr int64_t WEIGHT_GROUP = WF == 0 ? 128 : 256;  // a full group's weight bytes
  const __m256i nibble = _mm256_set1_epi8(0x0F);
  __m256 acc[R * NC];
#pragma GCC unroll 16
  for (int i = 0; i < R * NC; ++i) acc[i] = _mm256_setzero_ps();
  for (int64_t g = 0; g < num_groups(K); ++g) {
    const int lanes = nb - 8 * g < 8 ? static_cast<int>(nb - 8 * g) : 8;  // blocks in this group
    const __m256i mask = _mm256_cmpgt_epi32(_mm256_set1_epi32(lanes), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    __m256i w[NC][8], ws[NC];
    __m256 dv[NC], mv[NC];
#pragma GCC unroll 4
    for (int c = 0; c < NC; ++c) {
      const uint8_t* src = q + (n0 + c) * col_bytes + g * WEIGHT_GROUP;  // partial: registers of 4 · lanes bytes
      if (WF == 0) {
#pragma GCC unroll 4
        for (int t = 0; t < 4; ++t) {
          const __m256i bytes = load_or_mask(src + t * 4 * lanes, lanes, mask);
          w[c][t] = _mm256_and_si256(bytes, nibble);
          w[c][4 + t] = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), nibble);
        }
      } else {
#pragma GCC unroll 8
        for (int i = 0; i < 8; ++i) w[c][i] = load_or_mask(src + i * 4 * lanes, lanes, mask);
        ws[c] = q8_column_sums(w[c]);
      }
      const float* dc = d + (n0 + c) * nb + 8 * g;
      dv[c] = lanes == 8 ? _mm256_loadu_ps(dc) : _mm256_maskload_ps(dc, mask);
      if (WF == 0) {
        const float* mc = mn + (n0 + c) * nb + 8 * g;
        mv[c] = lanes == 8 ? _mm256_loadu_ps(mc) : _mm256_maskload_ps(mc, mask);
      }
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const uint8_t* xg = xq + r * ldq + g * GROUP_BYTES;
      const __m256 S = _mm256_loadu_ps(reinterpret_cast<const float*>(xg + 288));
      __m256i xr[8];
      if (WF == 1) q8_row_operands(xg, xr);
#pragma GCC unroll 4
      for (int c = 0; c < NC; ++c) {
        // Q4_1: t = d·I + m·X per block; Q8_0: t = d·I; then acc += t · s (module docstring)
        __m256 t;
        if (WF == 0) {
          const __m256 X = _mm256_loadu_ps(reinterpret_cast<const float*>(xg + 256));
          t = _mm256_fmadd_ps(X, mv[c], _mm256_mul_ps(_mm256_cvtepi32_ps(block_dots(w[c], xg)), dv[c]));
        } else {
          t = _mm256_mul_ps(_mm256_cvtepi32_ps(block_dots_q8(w[c], xr, ws[c])), dv[c]);
        }
        acc[r * NC + c] = _mm256_fmadd_ps(t, S, acc[r * NC + c]);
      }
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int c = 0; c < NC; ++c) y[r * ldy + n0 + c] = lane_sum8(acc[r * NC + c]);
}

// all M rows against columns n .. n + NC - 1, in tiles of TR rows, then the remainder
template <int WF, int TR, int NC>
inline void rows_times_columns(const uint8_t* xq, int64_t ldq, int64_t M, int64_t K, const uint8_t* q, const float* d,
                               const float* mn, int64_t n, float* y, int64_t ldy) {
  int64_t r = 0;
  for (; r + TR <= M; r += TR) tile<WF, TR, NC>(xq + r * ldq, ldq, K, q, d, mn, n, y + r * ldy, ldy);
  if (TR > 4 && r + 4 <= M) { tile<WF, 4, NC>(xq + r * ldq, ldq, K, q, d, mn, n, y + r * ldy, ldy); r += 4; }
  switch (M - r) {
    case 3: tile<WF, 3, NC>(xq + r * ldq, ldq, K, q, d, mn, n, y + r * ldy, ldy); break;
    case 2: tile<WF, 2, NC>(xq + r * ldq, ldq, K, q, d, mn, n, y + r * ldy, ldy); break;
    case 1: tile<WF, 1, NC>(xq + r * ldq, ldq, K, q, d, mn, n, y + r * ldy, ldy); break;
    default: break;
  }
}

// tiles for M > 1: 4 rows; 2 columns where AVX-512 gives 32 registers (the two share each
// row's loads), 1 on AVX2's 16 (measured: 8 x 1 and 2 x 4 were no faster on a Zen 4 core)
#define DSPARK_X8_TR 4
#if defined(__AVX512F__)
#define DSPARK_X8_NC 2
#else
#define DSPARK_X8_NC 1
#endif

// y [M, N] = x̂ [M, K] · Wᵀ for W in the int8 layout of format WF (Q4_1: int8_activations.pack_weights,
// Q8_0: pack_q8_weights); K % 32 == 0
template <int WF>
void gemm(const float* x, int64_t ldx, int64_t M, int64_t K, const void* qv, const float* d, const float* mn,
          int64_t N, float* y, int64_t ldy, int threads) {
  const uint8_t* q = static_cast<const uint8_t*>(qv);
  const int64_t ldq = num_groups(K) * GROUP_BYTES;
  uint8_t* xq = static_cast<uint8_t*>(std::malloc(static_cast<size_t>(M * ldq)));
  const int use = (M * N * K < (1 << 18)) ? 1 : threads;
  int64_t block = (65536 / ldq) / 4 * 4;  // rows whose quantised copy stays in L2 while the columns pass
  if (block < 4) block = 4;
#pragma omp parallel num_threads(use)
  {
#pragma omp for schedule(static)
    for (int64_t r = 0; r < M; ++r) quantize_row(x + r * ldx, K, xq + r * ldq);
    if (M == 1) {  // one row: two columns a pass (independent chains)
#pragma omp for schedule(static)
      for (int64_t t = 0; t < (N + 1) / 2; ++t) {
        if (2 * t + 1 < N) tile<WF, 1, 2>(xq, ldq, K, q, d, mn, 2 * t, y, ldy);
        else tile<WF, 1, 1>(xq, ldq, K, q, d, mn, 2 * t, y, ldy);
      }
    } else {
      for (int64_t r0 = 0; r0 < M; r0 += block) {
        const int64_t m = M - r0 < block ? M - r0 : block;
        constexpr int64_t NC = DSPARK_X8_NC;
        const int64_t tiles = N / NC;
#pragma omp for schedule(static)
        for (int64_t t = 0; t < tiles + (N - tiles * NC); ++t) {
          if (t < tiles) rows_times_columns<WF, DSPARK_X8_TR, NC>(xq + r0 * ldq, ldq, m, K, q, d, mn, t * NC, y + r0 * ldy, ldy);
          else rows_times_columns<WF, DSPARK_X8_TR, 1>(xq + r0 * ldq, ldq, m, K, q, d, mn, tiles * NC + (t - tiles), y + r0 * ldy, ldy);
        }
      }
    }
  }
  std::free(xq);
}
#else
constexpr bool kSupported = false;
template <int WF>
inline void gemm(const float*, int64_t, int64_t, int64_t, const void*, const float*, const float*, int64_t, float*,
                 int64_t, int) {}
#endif

}  // namespace x8
"""
