"""The int8-activation GEMM on column panels: AVX-512 VNNI for a few rows, AMX tiles for more.

The `compact-int8` numerics (int8_activations.py) reduce a verify step to exact integer block
sums I = Σ_j q_j xq_j and a short fp32 epilogue per (row, column, block). The first kernel
(format q4_1_x8 / q8_0_x8) puts the 8 blocks of a group in the 8 lanes of a register, so every
extra row repeats every instruction: a step of 8 tokens cost ~1.95x a step of one on a 2-core
Xeon with AMX (docs/results/compact_weights.md), and speculation had little room. This kernel
puts 16 *columns* in the lanes instead, so that a block's weights are unpacked once for all rows
and, from a few rows on, one AMX tile product (`tdpbsud` / `tdpbssd`: 16 rows x 16 columns x 32
bytes) replaces 16 x 16 dot-product instructions.

The result is the first kernel's, bit for bit, at every number of rows and on both paths:
- the integers I are exact whatever the instruction (VNNI `vpdpbusd`, AMX tiles);
- the epilogue of one (row, column) is the same fp32 sequence: blocks b = 8g + l in order,
      t = fma(X_b, m_b, float(I_b) · d_b)   (Q8_0: t = float(I_b) · d_b)
      acc_l = fma(t, s_b, acc_l)
  then +0 into the lanes a partial last group lacks (what the first kernel's masked lanes add),
  then ((acc_0 + acc_4) + (acc_2 + acc_6)) + ((acc_1 + acc_5) + (acc_3 + acc_7));
- the quantisation of a row is the first kernel's (the same scalar code), in natural order.
So batch invariance holds across paths and row counts (tests/model/test_int8_panels.py checks
both paths against the first kernel, bit for bit).

Layouts (P = 16 columns a panel; N is padded to a multiple of 16 with zero columns):
- Q4_1 (format q4_1_p16): per panel p and block b, 256 bytes: for t in 0..3, 16 columns x 4
  bytes; byte i of column c in row-pair t holds value 8t + i in its low nibble and 8t + 4 + i in
  its high one. Masking and shifting a 64-byte row-pair gives two rows of the AMX B tile (K/4 =
  8 rows of 16 columns x 4 bytes): tile row w holds values 4w .. 4w + 3 of each column.
- Q8_0 (format q8_0_p16): per panel and block, 512 bytes, already the B tile (row w: values
  4w .. 4w + 3 of each column), plus 128 · Σ_j q_j per (panel, block, column) as int32 for the
  VNNI path's unsigned operand (xq + 128; the same trick as the first kernel's).
- d, m (Q4_1) [P, K / 32, 16] fp32: a block's 16 scales one load.
"""

from __future__ import annotations

import torch

BLOCK = 32
PANEL = 16  # columns per panel


def _padded_columns(t: torch.Tensor) -> torch.Tensor:
    """[N, ...] -> [ceil(N / 16) * 16, ...] with zero rows appended."""
    n = t.shape[0]
    pad = -n % PANEL
    if pad == 0:
        return t
    return torch.cat([t, torch.zeros(pad, *t.shape[1:], dtype=t.dtype)])


def pack_q4_1(q: torch.Tensor) -> torch.Tensor:
    """Q4_1 values q [N, K / 32, 32] (0..15) -> the q4_1_p16 bytes [P, K / 32, 4, 16, 4] uint8."""
    qp = _padded_columns(q.to(torch.uint8))
    p16, nb = qp.shape[0] // PANEL, qp.shape[1]
    v = qp.view(p16, PANEL, nb, 4, 2, 4)  # [P, c, b, t, h, i]: value 8t + 4h + i
    byte = v[:, :, :, :, 0, :] | (v[:, :, :, :, 1, :] << 4)  # [P, c, b, t, i]
    return byte.permute(0, 2, 3, 1, 4).contiguous()  # [P, b, t, c, i]


def unpack_q4_1(packed: torch.Tensor, n: int) -> torch.Tensor:
    """pack_q4_1's inverse: -> q [N, K / 32, 32] int64."""
    p16, nb = packed.shape[0], packed.shape[1]
    byte = packed.long().permute(0, 3, 1, 2, 4)  # [P, c, b, t, i]
    v = torch.stack([byte & 0xF, byte >> 4], dim=4)  # [P, c, b, t, h, i]
    return v.reshape(p16 * PANEL, nb, BLOCK)[:n]


def pack_q8_0(q: torch.Tensor) -> torch.Tensor:
    """Q8_0 values q [N, K / 32, 32] (-127..127) -> the q8_0_p16 bytes [P, K / 32, 8, 16, 4] int8."""
    if (q < -127).any() or (q > 127).any():
        raise ValueError("q8_0_p16 takes values in -127..127 (the VNNI path's sign trick cannot negate -128)")
    qp = _padded_columns(q.to(torch.int8))
    p16, nb = qp.shape[0] // PANEL, qp.shape[1]
    return qp.view(p16, PANEL, nb, 8, 4).permute(0, 2, 3, 1, 4).contiguous()  # [P, b, w, c, i]


def unpack_q8_0(packed: torch.Tensor, n: int) -> torch.Tensor:
    """pack_q8_0's inverse: -> q [N, K / 32, 32] int64."""
    p16, nb = packed.shape[0], packed.shape[1]
    return packed.long().permute(0, 3, 1, 2, 4).reshape(p16 * PANEL, nb, BLOCK)[:n]


def q8_column_sums(q: torch.Tensor) -> torch.Tensor:
    """128 · Σ_j q_j per block of each column, [P, K / 32, 16] int32 (the VNNI path's correction)."""
    sums = _padded_columns(q.long().sum(-1) * 128).to(torch.int32)  # [N', K / 32]
    p16 = sums.shape[0] // PANEL
    return sums.view(p16, PANEL, -1).permute(0, 2, 1).contiguous()


def pack_scales(d: torch.Tensor) -> torch.Tensor:
    """Per-block scales [N, K / 32] fp32 -> [P, K / 32, 16] fp32 (zero for padding columns)."""
    dp = _padded_columns(d.float())
    p16 = dp.shape[0] // PANEL
    return dp.view(p16, PANEL, -1).permute(0, 2, 1).contiguous()


def unpack_scales(packed: torch.Tensor, n: int) -> torch.Tensor:
    """pack_scales' inverse: -> [N, K / 32] fp32."""
    return packed.permute(0, 2, 1).reshape(-1, packed.shape[1])[:n]


# C++ of the panel GEMM, compiled into compact_weights' library (format codes 5 and 6) after
# int8_activations.GEMM_SOURCE, whose quantize_row it mirrors. Needs AVX-512 (F, BW, VNNI); the
# AMX path also AMX-TILE and AMX-INT8 (and the kernel's permission to use tile data).
GEMM_SOURCE = r"""
#include <sys/syscall.h>
#include <unistd.h>

namespace p16 {

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
constexpr bool kSupported = true;
constexpr int64_t PC = 16;  // columns per panel

// below this many rows the VNNI path, from it on AMX tiles (where the CPU has them); both give
// the same bits, so this is only a speed choice (dspark_p16_set_amx_min_rows)
static int64_t amx_min_rows = 16;

// One row x [K] quantised exactly as x8::quantize_row (the same scalar operations), in natural
// order: xq [K] int8, X [K / 32] (Σ xq of each block, exact) and s [K / 32] (amax / 127).
inline void quantize_row(const float* x, int64_t K, int8_t* xq, float* X, float* S) {
  for (int64_t b = 0; b < K / 32; ++b) {
    const float* xb = x + b * 32;
    float amax = 0.f;
    for (int j = 0; j < 32; ++j) amax = std::fmax(amax, std::fabs(xb[j]));
    const float inverse = amax > 0.f ? 127.f / amax : 0.f;
    int sum = 0;
    for (int j = 0; j < 32; ++j) {
      const int q = static_cast<int>(std::nearbyint(xb[j] * inverse));  // half to even (the default rounding mode)
      xq[b * 32 + j] = static_cast<int8_t>(q);
      sum += q;
    }
    X[b] = static_cast<float>(sum);
    S[b] = amax / 127.f;
  }
}

// the B-tile rows of one (panel, block): 8 registers, row w = values 4w .. 4w + 3 of 16 columns
template <int WF>
inline void weight_rows(const uint8_t* qb, __m512i w[8]) {
  if (WF == 0) {
    const __m512i nibble = _mm512_set1_epi8(0x0F);
#pragma GCC unroll 4
    for (int t = 0; t < 4; ++t) {
      const __m512i bytes = _mm512_loadu_si512(qb + 64 * t);
      w[2 * t] = _mm512_and_si512(bytes, nibble);
      w[2 * t + 1] = _mm512_and_si512(_mm512_srli_epi16(bytes, 4), nibble);
    }
  } else {
#pragma GCC unroll 8
    for (int i = 0; i < 8; ++i) w[i] = _mm512_loadu_si512(qb + 64 * i);
  }
}

// t = fma(X, m, float(I) · d) (Q4_1) or float(I) · d (Q8_0); acc = fma(t, s, acc): the module docstring's epilogue
template <int WF>
inline __m512 block_term(__m512i I, __m512 dv, __m512 mv, float X) {
  const __m512 id = _mm512_mul_ps(_mm512_cvtepi32_ps(I), dv);
  return WF == 0 ? _mm512_fmadd_ps(_mm512_set1_ps(X), mv, id) : id;
}

// the lanes a partial last group lacks get +0 (the first kernel's masked lanes), then the fixed tree
inline __m512 finish(__m512 acc[8], int64_t nb) {
  if (nb % 8)
    for (int l = static_cast<int>(nb % 8); l < 8; ++l) acc[l] = _mm512_add_ps(acc[l], _mm512_setzero_ps());
  return _mm512_add_ps(_mm512_add_ps(_mm512_add_ps(acc[0], acc[4]), _mm512_add_ps(acc[2], acc[6])),
                       _mm512_add_ps(_mm512_add_ps(acc[1], acc[5]), _mm512_add_ps(acc[3], acc[7])));
}

inline void store_columns(float* y, __m512 v, int64_t n0, int64_t N) {
  const int64_t left = N - n0;
  if (left >= PC) _mm512_storeu_ps(y + n0, v);
  else _mm512_mask_storeu_ps(y + n0, static_cast<__mmask16>((1u << left) - 1), v);
}

// R rows against one panel with VNNI: 8 accumulators a row, registers only
template <int WF, int R>
inline void vnni_panel(const int8_t* xq, const float* X, const float* S, int64_t K, const uint8_t* q, const float* d,
                       const float* mn, const int32_t* cs, int64_t n0, int64_t N, float* y, int64_t ldy) {
  const int64_t nb = K / 32;
  constexpr int64_t QB = WF == 0 ? 256 : 512;  // weight bytes of a (panel, block)
  __m512 acc[R][8];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
    for (int l = 0; l < 8; ++l) acc[r][l] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    __m512i w[8];
    weight_rows<WF>(q + b * QB, w);
    const __m512 dv = _mm512_loadu_ps(d + b * PC);
    const __m512 mv = WF == 0 ? _mm512_loadu_ps(mn + b * PC) : _mm512_setzero_ps();
    const __m512i csv = WF == 1 ? _mm512_loadu_si512(cs + b * PC) : _mm512_setzero_si512();
#pragma GCC unroll 2
    for (int r = 0; r < R; ++r) {
      const int32_t* xw = reinterpret_cast<const int32_t*>(xq + r * K + b * 32);
      __m512i a0 = _mm512_setzero_si512(), a1 = _mm512_setzero_si512();  // two chains: half the latency
#pragma GCC unroll 4
      for (int i = 0; i < 8; i += 2) {
        if (WF == 0) {  // unsigned weights x signed activations
          a0 = _mm512_dpbusd_epi32(a0, w[i], _mm512_set1_epi32(xw[i]));
          a1 = _mm512_dpbusd_epi32(a1, w[i + 1], _mm512_set1_epi32(xw[i + 1]));
        } else {  // unsigned (xq + 128) x signed weights, less 128 · Σ w
          a0 = _mm512_dpbusd_epi32(a0, _mm512_set1_epi32(xw[i] ^ static_cast<int32_t>(0x80808080u)), w[i]);
          a1 = _mm512_dpbusd_epi32(a1, _mm512_set1_epi32(xw[i + 1] ^ static_cast<int32_t>(0x80808080u)), w[i + 1]);
        }
      }
      __m512i I = _mm512_add_epi32(a0, a1);
      if (WF == 1) I = _mm512_sub_epi32(I, csv);
      const __m512 t = block_term<WF>(I, dv, mv, X[r * nb + b]);
      acc[r][b % 8] = _mm512_fmadd_ps(t, _mm512_set1_ps(S[r * nb + b]), acc[r][b % 8]);
    }
  }
  for (int r = 0; r < R; ++r) store_columns(y + r * ldy, finish(acc[r], nb), n0, N);
}

#if defined(__AMX_TILE__) && defined(__AMX_INT8__)
constexpr bool kAmx = true;

struct TileConfig {
  uint8_t palette_id;
  uint8_t start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

// Linux hands out AMX tile state only to a process that asks (ARCH_REQ_XCOMP_PERM for
// XFEATURE_XTILEDATA); oneDNN asks too, asking twice is harmless
inline bool amx_permitted() {
  static const bool ok = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  return ok;
}

// two sets of tiles, so that block b + 1's product runs while block b's epilogue does:
// A (rows x 32 bytes: one block of the quantised rows) 0 and 5, B (8 x 64 bytes) 1 and 4,
// C (rows x 16 int32) 2 and 3; rows = min(M, 16) (M > 16 runs in chunks of 16 padded rows)
inline void configure_tiles(int rows) {
  TileConfig c;
  std::memset(&c, 0, sizeof(c));
  c.palette_id = 1;
  const uint8_t r = static_cast<uint8_t>(rows);
  c.rows[0] = c.rows[5] = r; c.colsb[0] = c.colsb[5] = 32;
  c.rows[1] = c.rows[4] = 8; c.colsb[1] = c.colsb[4] = 64;
  c.rows[2] = c.rows[3] = r; c.colsb[2] = c.colsb[3] = 64;
  _tile_loadconfig(&c);
}

// block b's tile product into C tile TC (A tile TA, B tile TB) from the rows of xq at stride K.
// A macro: GCC's tile intrinsics paste their tile numbers into register names, so they must be
// literal numbers, not template parameters.
#define DSPARK_P16_ISSUE(WF, TA, TB, TC, xq, K, qb, b, brows)               \
  do {                                                                      \
    if ((WF) == 0) {                                                        \
      __m512i w_[8];                                                        \
      weight_rows<0>((qb), w_);                                             \
      for (int i_ = 0; i_ < 8; ++i_) _mm512_store_si512((brows) + 64 * i_, w_[i_]); \
      _tile_loadd(TB, (brows), 64);                                         \
    } else {                                                                \
      _tile_loadd(TB, (qb), 64);                                            \
    }                                                                       \
    _tile_loadd(TA, (xq) + (b) * 32, (K));                                  \
    _tile_zero(TC);                                                         \
    if ((WF) == 0) _tile_dpbsud(TC, TA, TB); /* signed activations x unsigned weights */ \
    else _tile_dpbssd(TC, TA, TB);                                          \
  } while (0)

// block b's epilogue for `rows` rows from its stored C tile
template <int WF>
inline void block_epilogue(const int32_t* cbuf, int64_t rows, int64_t row0, int64_t b, int64_t nb, const float* X,
                           const float* S, __m512 dv, __m512 mv, float* acc) {
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t row = row0 + r;
    const __m512 t = block_term<WF>(_mm512_load_si512(cbuf + 16 * r), dv, mv, X[row * nb + b]);
    float* a = acc + (row * 8 + b % 8) * PC;
    _mm512_storeu_ps(a, _mm512_fmadd_ps(t, _mm512_set1_ps(S[row * nb + b]), _mm512_loadu_ps(a)));
  }
}

// all rows (xq padded with zero rows to a multiple of 16) against one panel with AMX tiles;
// acc [M, 8, 16] in memory (a row's 8 accumulators do not fit beside 16 rows' in registers)
template <int WF>
inline void amx_panel(const int8_t* xq, const float* X, const float* S, int64_t M, int64_t K, const uint8_t* q,
                      const float* d, const float* mn, int64_t n0, int64_t N, float* y, int64_t ldy, float* acc) {
  const int64_t nb = K / 32;
  constexpr int64_t QB = WF == 0 ? 256 : 512;
  alignas(64) uint8_t brows[512];
  alignas(64) int32_t cbuf[16 * 16];
  std::memset(acc, 0, static_cast<size_t>(M * 8 * PC) * sizeof(float));
  alignas(64) uint8_t brows1[512];
  alignas(64) int32_t cbuf1[16 * 16];
  auto scales = [&](int64_t b, __m512& dv, __m512& mv) {
    dv = _mm512_loadu_ps(d + b * PC);
    mv = WF == 0 ? _mm512_loadu_ps(mn + b * PC) : _mm512_setzero_ps();
  };
  __m512 dv, mv;
  if (M <= 16) {  // one chunk: blocks in pairs, the next product issued before this epilogue
    DSPARK_P16_ISSUE(WF, 0, 1, 2, xq, K, q, 0, brows);
    for (int64_t b = 0; b < nb; b += 2) {
      if (b + 1 < nb) DSPARK_P16_ISSUE(WF, 5, 4, 3, xq, K, q + (b + 1) * QB, b + 1, brows1);
      _tile_stored(2, cbuf, 64);
      scales(b, dv, mv);
      block_epilogue<WF>(cbuf, M, 0, b, nb, X, S, dv, mv, acc);
      if (b + 2 < nb) DSPARK_P16_ISSUE(WF, 0, 1, 2, xq, K, q + (b + 2) * QB, b + 2, brows);
      if (b + 1 < nb) {
        _tile_stored(3, cbuf1, 64);
        scales(b + 1, dv, mv);
        block_epilogue<WF>(cbuf1, M, 0, b + 1, nb, X, S, dv, mv, acc);
      }
    }
  } else {
    for (int64_t b = 0; b < nb; ++b) {
      scales(b, dv, mv);
      for (int64_t m0 = 0; m0 < M; m0 += 16) {
        DSPARK_P16_ISSUE(WF, 0, 1, 2, xq + m0 * K, K, q + b * QB, b, brows);
        _tile_stored(2, cbuf, 64);
        block_epilogue<WF>(cbuf, M - m0 < 16 ? M - m0 : 16, m0, b, nb, X, S, dv, mv, acc);
      }
    }
  }
  for (int64_t r = 0; r < M; ++r) {
    __m512 lanes[8];
    for (int l = 0; l < 8; ++l) lanes[l] = _mm512_loadu_ps(acc + (r * 8 + l) * PC);
    store_columns(y + r * ldy, finish(lanes, nb), n0, N);
  }
}
#else
constexpr bool kAmx = false;
#endif

// y [M, N] = x̂ [M, K] · Wᵀ for W in a panel layout (WF 0 = q4_1_p16, 1 = q8_0_p16; int8_panels.py);
// `mn` is m [P, K / 32, 16] for Q4_1 and the int32 column sums for Q8_0. K % 32 == 0.
template <int WF>
void gemm(const float* x, int64_t ldx, int64_t M, int64_t K, const void* qv, const float* d, const float* mn,
          int64_t N, float* y, int64_t ldy, int threads) {
  const uint8_t* q = static_cast<const uint8_t*>(qv);
  const int64_t nb = K / 32, panels = (N + PC - 1) / PC;
  constexpr int64_t QB = WF == 0 ? 256 : 512;
#if defined(__AMX_TILE__) && defined(__AMX_INT8__)
  const bool amx = M >= amx_min_rows && amx_permitted();
#else
  const bool amx = false;
#endif
  const int64_t mpad = amx ? (M + 15) / 16 * 16 : M;
  int8_t* xq = static_cast<int8_t*>(std::calloc(static_cast<size_t>(mpad * K), 1));
  float* X = static_cast<float*>(std::malloc(static_cast<size_t>(M * nb) * sizeof(float)));
  float* S = static_cast<float*>(std::malloc(static_cast<size_t>(M * nb) * sizeof(float)));
  const int use = (M * N * K < (1 << 18)) ? 1 : threads;
  const int32_t* cs = reinterpret_cast<const int32_t*>(mn);
#pragma omp parallel num_threads(use)
  {
#pragma omp for schedule(static)
    for (int64_t r = 0; r < M; ++r) quantize_row(x + r * ldx, K, xq + r * K, X + r * nb, S + r * nb);
    if (amx) {
#if defined(__AMX_TILE__) && defined(__AMX_INT8__)
      configure_tiles(M < 16 ? static_cast<int>(M) : 16);
      float* acc = static_cast<float*>(std::malloc(static_cast<size_t>(M * 8 * PC) * sizeof(float)));
#pragma omp for schedule(static)
      for (int64_t p = 0; p < panels; ++p)
        amx_panel<WF>(xq, X, S, M, K, q + p * nb * QB, d + p * nb * PC, mn + p * nb * PC, p * PC, N, y, ldy, acc);
      std::free(acc);
      _tile_release();
#endif
    } else {
#pragma omp for schedule(static)
      for (int64_t p = 0; p < panels; ++p) {
        const uint8_t* qp = q + p * nb * QB;
        const float* dp = d + p * nb * PC;
        const float* mp = WF == 0 ? mn + p * nb * PC : nullptr;
        const int32_t* cp = WF == 1 ? cs + p * nb * PC : nullptr;
        int64_t r = 0;
        for (; r + 2 <= M; r += 2)
          vnni_panel<WF, 2>(xq + r * K, X + r * nb, S + r * nb, K, qp, dp, mp, cp, p * PC, N, y + r * ldy, ldy);
        if (r < M) vnni_panel<WF, 1>(xq + r * K, X + r * nb, S + r * nb, K, qp, dp, mp, cp, p * PC, N, y + r * ldy, ldy);
      }
    }
  }
  std::free(xq);
  std::free(X);
  std::free(S);
}
#else
constexpr bool kSupported = false;
constexpr bool kAmx = false;
static int64_t amx_min_rows = 16;
template <int WF>
inline void gemm(const float*, int64_t, int64_t, int64_t, const void*, const float*, const float*, int64_t, float*,
                 int64_t, int) {}
#endif

}  // namespace p16
"""
