"""Fused per-token ops of a decoder layer: fewer, larger calls instead of ~150 small torch ops.

At B = 1 a SmolLM2-135M forward issued ~4500 torch ops (rms_norm alone decomposes into ~10 on
the CPU: pow, mean, add, rsqrt, mul, mul and dtype copies); at a few microseconds each that is
most of the step, far above the time to stream the weights once. Everything between the GEMMs
is elementwise or a per-row reduction over one token, so three small C++ kernels cover it:

  add_rms_norm  x += a_0 + a_1 + ... (bf16 GEMM outputs, the K-chunk partials of a split
                reduction summed in order), then out = rms_norm(x) * w in bf16 (the next GEMM's
                input) or fp32 (the final norm). The residual x stays fp32, updated in place.
  rope_split    the fused qkv GEMM output (bf16) -> q, k rotated (RoPE, rotate-half layout)
                and v, all fp32, in the layouts the attention kernel reads.
  silu_mul      gate/up GEMM output (bf16) -> bf16(silu(gate) * up), written chunk by chunk in
                the K-chunks of the down projection (each a contiguous [num_tokens, chunk]).

The GEMM inputs and outputs these kernels read and write are in the linear layers' dtype: bf16
for dense bf16 weights, fp32 for compact ones (compact_weights.py; their silu * up is never
rounded). A flag per call says which; the arithmetic in between is fp32 either way.

Batch invariance (greedy speculative == plain decoding): each token's row is computed by the
same fixed sequence of 16-lane vector operations (the attention kernel's style: a row's tail is
a zero-padded vector, never a scalar epilogue; sums of squares in 16 lanes + a fixed tree), so
a row's bits depend only on that row, never on the number of rows or on threading (threads
split whole rows). Built with -ffp-contract=off so no multiply-add is fused differently in one
place than another.

Numerics vs the eager torch path: RoPE and the residual adds are the same operations in the same
order (bit-identical); the RMSNorm reduction order differs (fp32 rounding, ~1e-7 relative), and
silu(gate) * up is rounded to bf16 once instead of twice (more accurate). Both paths are
batch-invariant, but they round differently: a process uses one throughout (Transformer.set_fused).
"""

from __future__ import annotations

import ctypes

import torch

from dspark.model.attention import VECTOR_PRELUDE, LazyLibrary

_SOURCE = VECTOR_PRELUDE + r"""
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

namespace {

// bf16 -> fp32 is exact: the 16 bits are the top half of the float
inline v16 load_bf16(const uint16_t* p, int64_t n = W) {
  v16h h = {0};
  if (n == W) std::memcpy(&h, p, sizeof h);
  else std::memcpy(&h, p, n * sizeof(uint16_t));
  return bits<v16>(widen(h) << 16);
}

// fp32 -> bf16 round to nearest even, NaN -> quiet NaN: what c10::BFloat16 (torch's .to) does
inline void store_bf16(uint16_t* p, v16 x, int64_t n = W) {
  const v16u u = bits<v16u>(x);
  const v16u rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  const v16u nan = bits<v16u>(x != x);  // all ones in NaN lanes
  const v16u out = (rounded & ~nan) | (0x7FC0u & nan);
  v16h h = narrow(out);
  if (n == W) std::memcpy(p, &h, sizeof h);
  else std::memcpy(p, &h, n * sizeof(uint16_t));
}



// an activation tensor that is bf16 or fp32 (the GEMM outputs/inputs of the compute dtype):
// element `offset` on; the branch is the same for a whole call, so it costs nothing measurable
inline v16 load_act(const void* p, int64_t offset, int bf16, int64_t n = W) {
  return bf16 ? load_bf16(static_cast<const uint16_t*>(p) + offset, n) : load(static_cast<const float*>(p) + offset, n);
}
inline void store_act(void* p, int64_t offset, v16 x, int bf16, int64_t n = W) {
  if (bf16) store_bf16(static_cast<uint16_t*>(p) + offset, x, n);
  else store(static_cast<float*>(p) + offset, x, n);
}

// below ~64K elements waking the second thread costs more than the work
inline int threads_for(int64_t elements, int threads) { return elements < (1 << 16) ? 1 : threads; }

}  // namespace

extern "C" {

// x: [n, d] fp32 residual rows (stride x_stride), updated in place: x += ((a_0 + a_1) + ...)
// with the addends [n, d] bf16 or fp32 (addends_bf16; row stride a_strides[j]); then
// out = x * rsqrt(mean(x^2) + eps) * w, bf16 or fp32 [n, d] contiguous.
void dspark_add_rms_norm(float* x, int64_t x_stride, int64_t n, int64_t d,
                         int64_t num_addends, const int64_t* addends, const int64_t* a_strides, int addends_bf16,
                         const float* w, float eps, void* out, int out_bf16, int threads) {
  const int64_t chunks = (d + W - 1) / W;
#pragma omp parallel for num_threads(threads_for(n * d, threads)) schedule(static)
  for (int64_t t = 0; t < n; ++t) {
    float* xr = x + t * x_stride;
    v16 acc = {};
    for (int64_t c = 0; c < chunks; ++c) {
      const int64_t m = c + 1 < chunks ? W : d - c * W;
      v16 v = load(xr + c * W, m);
      if (num_addends > 0) {
        v16 s = load_act(reinterpret_cast<const void*>(addends[0]), t * a_strides[0] + c * W, addends_bf16, m);
        for (int64_t j = 1; j < num_addends; ++j)
          s = s + load_act(reinterpret_cast<const void*>(addends[j]), t * a_strides[j] + c * W, addends_bf16, m);
        v = v + s;
        store(xr + c * W, v, m);
      }
      acc = acc + v * v;
    }
    const float r = 1.0f / std::sqrt(hsum(acc) / static_cast<float>(d) + eps);
    for (int64_t c = 0; c < chunks; ++c) {
      const int64_t m = c + 1 < chunks ? W : d - c * W;
      const v16 y = (load(xr + c * W, m) * r) * load(w + c * W, m);
      store_act(out, t * d + c * W, y, out_bf16, m);
    }
  }
}

// qkv: [n, (heads + 2 kv_heads) * hd] bf16 or fp32 (qkv_bf16; row stride qkv_stride), q heads then k then v;
// cos, sin: [n, hd / 2] fp32. Writes q [n, heads, hd], k [n, kv_heads, hd] (both rotated,
// rotate-half layout: out_j = x_j cos_j - x_{j+h} sin_j, out_{j+h} = x_{j+h} cos_j + x_j sin_j)
// and v [n, kv_heads, hd], all fp32 contiguous.
void dspark_rope_split(const void* qkv, int qkv_bf16, int64_t qkv_stride, int64_t n, int64_t heads, int64_t kv_heads,
                       int64_t hd, const float* cos, const float* sin, float* q, float* k, float* v, int threads) {
  const int64_t half = hd / 2, chunks = (half + W - 1) / W;
#pragma omp parallel for num_threads(threads_for(n * (heads + 2 * kv_heads) * hd, threads)) schedule(static)
  for (int64_t t = 0; t < n; ++t) {
    const int64_t row = t * qkv_stride;
    for (int64_t h = 0; h < heads + kv_heads; ++h) {
      const int64_t src = row + h * hd;
      float* dst = h < heads ? q + (t * heads + h) * hd : k + (t * kv_heads + h - heads) * hd;
      for (int64_t c = 0; c < chunks; ++c) {
        const int64_t m = c + 1 < chunks ? W : half - c * W;
        const v16 x1 = load_act(qkv, src + c * W, qkv_bf16, m), x2 = load_act(qkv, src + half + c * W, qkv_bf16, m);
        const v16 cs = load(cos + t * half + c * W, m), sn = load(sin + t * half + c * W, m);
        store(dst + c * W, x1 * cs - x2 * sn, m);
        store(dst + half + c * W, x2 * cs + x1 * sn, m);
      }
    }
    const int64_t src = row + (heads + kv_heads) * hd;
    float* dst = v + t * kv_heads * hd;
    const int64_t vd = kv_heads * hd, vchunks = (vd + W - 1) / W;
    for (int64_t c = 0; c < vchunks; ++c) {
      const int64_t m = c + 1 < vchunks ? W : vd - c * W;
      store(dst + c * W, load_act(qkv, src + c * W, qkv_bf16, m), m);
    }
  }
}

// gu: [n, 2 * inter] bf16 or fp32 (bf16; row stride gu_stride), gate then up. out: silu(gate) * up
// in the same dtype (bf16: rounded once), laid
// out chunk-major for a split down projection: the columns [bounds[c], bounds[c+1]) of all n
// rows form a contiguous [n, bounds[c+1] - bounds[c]] block starting at out + n * bounds[c].
void dspark_silu_mul(const void* gu, int bf16, int64_t gu_stride, int64_t n, int64_t inter,
                     int64_t num_chunks, const int64_t* bounds, void* out, int threads) {
#pragma omp parallel for num_threads(threads_for(n * inter, threads)) schedule(static)
  for (int64_t t = 0; t < n; ++t) {
    const int64_t g = t * gu_stride, u = g + inter;
    for (int64_t b = 0; b < num_chunks; ++b) {
      const int64_t lo = bounds[b], len = bounds[b + 1] - lo, chunks = (len + W - 1) / W;
      const int64_t dst = n * lo + t * len;
      for (int64_t c = 0; c < chunks; ++c) {
        const int64_t m = c + 1 < chunks ? W : len - c * W;
        const v16 x = load_act(gu, g + lo + c * W, bf16, m), up = load_act(gu, u + lo + c * W, bf16, m);
        // sigmoid without overflow: e = exp(-|x|) <= 1; 1 / (1 + e) for x >= 0, e / (1 + e) below
        const v16 ax = select(x < 0.0f, -x, x);
        const v16 e = exp_nonpos(-ax);
        const v16 sig = select(x >= 0.0f, splat(1.0f), e) / (1.0f + e);
        store_act(out, dst + c * W, (x * sig) * up, bf16, m);
      }
    }
  }
}

// out[r] = torch.argmax(x[r, :n]): the first index of the row's maximum, or of its first NaN
// (torch counts NaN as the maximum). Pass 1 finds the maximum in 16 lanes (a max is exact in
// any order), pass 2 the first index holding it: two reads of the row, vectorised, against
// ATen's scalar index-tracking reduction (~4x slower at 49,152 columns).
void dspark_row_argmax(const float* x, int64_t stride, int64_t rows, int64_t n, int64_t* out, int threads) {
#pragma omp parallel for num_threads(threads_for(rows * n, threads)) schedule(static)
  for (int64_t r = 0; r < rows; ++r) {
    const float* p = x + r * stride;
    const int64_t body = n / W * W;
    v16 mv = splat(-std::numeric_limits<float>::infinity());
    v16i nan = {};
    for (int64_t j = 0; j < body; j += W) {
      const v16 v = load(p + j);
      mv = select(v > mv, v, mv);
      nan = nan | (v != v);
    }
    float m = mv[0];
    bool has_nan = false;
    for (int l = 0; l < W; ++l) {
      m = mv[l] > m ? mv[l] : m;
      has_nan = has_nan || nan[l] != 0;
    }
    for (int64_t j = body; j < n; ++j) {
      m = p[j] > m ? p[j] : m;
      has_nan = has_nan || p[j] != p[j];
    }
    int64_t best = 0;
    if (has_nan) {
      while (p[best] == p[best]) ++best;
    } else {
      while (p[best] != m) ++best;  // m is one of the row's values: the scan stops within the row
    }
    out[r] = best;
  }
}

// One pass of the exponential race over a row: the first index of the largest score
// s_j = w_j > 0 ? w_j / e_j : -1, w_j = p_j - d_j (a residual; d == nullptr: w_j = p_j), NaN
// scores counting as the largest as in torch.argmax; -1 when no w_j > 0 (the caller falls back).
int64_t race_pass(const float* p, const float* d, const float* e, int64_t n) {
  const int64_t body = n / W * W;
  v16 mv = splat(-std::numeric_limits<float>::infinity());
  v16i nan = {}, positive = {};
  for (int64_t j = 0; j < body; j += W) {
    const v16 w = d ? load(p + j) - load(d + j) : load(p + j);
    const auto live = w > 0.0f;
    const v16 score = select(live, w / load(e + j), splat(-1.0f));
    mv = select(score > mv, score, mv);
    nan = nan | (score != score);
    positive = positive | live;
  }
  float m = mv[0];
  bool has_nan = false, any = false;
  for (int l = 0; l < W; ++l) {
    m = mv[l] > m ? mv[l] : m;
    has_nan = has_nan || nan[l] != 0;
    any = any || positive[l] != 0;
  }
  auto score_at = [&](int64_t j) {
    const float w = d ? p[j] - d[j] : p[j];
    return w > 0.0f ? w / e[j] : -1.0f;
  };
  for (int64_t j = body; j < n; ++j) {
    const float w = d ? p[j] - d[j] : p[j];
    const float score = score_at(j);
    m = score > m ? score : m;
    has_nan = has_nan || score != score;
    any = any || w > 0.0f;
  }
  if (!any) return -1;
  int64_t best = 0;
  if (has_nan) {
    while (score_at(best) == score_at(best)) ++best;
  } else {
    while (score_at(best) != m) ++best;  // the same IEEE operations as the vector pass: m is found
  }
  return best;
}

void dspark_race_argmax(const float* p, int64_t p_stride, const int64_t* p_rows, const float* d, int64_t d_stride,
                        const int64_t* d_rows, const float* e, int64_t e_stride, const int64_t* e_rows, int64_t rows,
                        int64_t n, int64_t* out, int threads) {
#pragma omp parallel for num_threads(threads_for(rows * n, threads)) schedule(static)
  for (int64_t r = 0; r < rows; ++r) {
    const float* pr = p + p_rows[r] * p_stride;
    const float* er = e + e_rows[r] * e_stride;
    int64_t best = race_pass(pr, d_rows[r] >= 0 ? d + d_rows[r] * d_stride : nullptr, er, n);
    if (best < 0) best = race_pass(pr, nullptr, er, n);  // an all-zero residual: draw from p_t
    out[r] = best < 0 ? 0 : best;  // no mass at all: every score -1, argmax's first index
  }
}

}  // extern "C"
"""

ACTIVATION_DTYPES = (torch.bfloat16, torch.float32)  # GEMM inputs/outputs: bf16 dense weights, fp32 compact ones

_i64, _ptr, _i32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
_LIBRARY = LazyLibrary(_SOURCE, "fused_ops", {
    "dspark_add_rms_norm": [_ptr, _i64, _i64, _i64, _i64, _ptr, _ptr, _i32, _ptr, ctypes.c_float, _ptr, _i32, _i32],
    "dspark_rope_split": [_ptr, _i32, _i64, _i64, _i64, _i64, _i64, _ptr, _ptr, _ptr, _ptr, _ptr, _i32],
    "dspark_silu_mul": [_ptr, _i32, _i64, _i64, _i64, _i64, _ptr, _ptr, _i32],
    "dspark_row_argmax": [_ptr, _i64, _i64, _i64, _ptr, _i32],
    "dspark_race_argmax": [_ptr, _i64, _ptr, _ptr, _i64, _ptr, _ptr, _i64, _ptr, _i64, _i64, _ptr, _i32],
}, fallback="using the torch ops")


def load() -> ctypes.CDLL | None:
    """The compiled kernels (built on first use, about a second), or None where that fails."""
    return _LIBRARY.get()


def available() -> bool:
    return load() is not None


def add_rms_norm(
    x: torch.Tensor,  # [n, d] fp32, last dim contiguous; updated in place when there are addends
    addends: list[torch.Tensor],  # each [n, d] bf16 or fp32 (all one dtype), last dim contiguous (GEMM outputs, summed in order)
    weight: torch.Tensor,  # [d] fp32
    eps: float,
    out: torch.Tensor,  # [n, d] bf16 or fp32, contiguous
) -> torch.Tensor:
    n, d = x.shape
    assert x.dtype == torch.float32 and x.stride(1) == 1 and out.is_contiguous() and out.shape == x.shape
    addend_dtype = addends[0].dtype if addends else torch.bfloat16
    assert addend_dtype in ACTIVATION_DTYPES and out.dtype in ACTIVATION_DTYPES
    assert all(a.dtype == addend_dtype and a.shape == x.shape and a.stride(1) == 1 for a in addends)
    ptrs = (ctypes.c_int64 * max(1, len(addends)))(*[a.data_ptr() for a in addends])
    strides = (ctypes.c_int64 * max(1, len(addends)))(*[a.stride(0) for a in addends])
    load().dspark_add_rms_norm(x.data_ptr(), x.stride(0), n, d, len(addends), ptrs, strides,
                               int(addend_dtype == torch.bfloat16), weight.data_ptr(), eps,
                               out.data_ptr(), int(out.dtype == torch.bfloat16), torch.get_num_threads())
    return out


def rope_split(
    qkv: torch.Tensor,  # [n, (heads + 2 kv_heads) * head_dim] bf16 or fp32, last dim contiguous
    cos: torch.Tensor,  # [n, head_dim // 2] fp32 contiguous
    sin: torch.Tensor,  # [n, head_dim // 2] fp32 contiguous
    q: torch.Tensor,  # [n, heads, head_dim] fp32 contiguous (written)
    k: torch.Tensor,  # [n, kv_heads, head_dim] fp32 contiguous (written)
    v: torch.Tensor,  # [n, kv_heads, head_dim] fp32 contiguous (written)
) -> None:
    n, heads, hd = q.shape
    kv_heads = k.shape[1]
    assert qkv.dtype in ACTIVATION_DTYPES and qkv.stride(1) == 1 and qkv.shape[1] == (heads + 2 * kv_heads) * hd
    assert cos.is_contiguous() and sin.is_contiguous() and cos.shape == (n, hd // 2) and hd % 2 == 0
    assert all(t.is_contiguous() and t.dtype == torch.float32 for t in (q, k, v))
    load().dspark_rope_split(qkv.data_ptr(), int(qkv.dtype == torch.bfloat16), qkv.stride(0), n, heads, kv_heads, hd,
                             cos.data_ptr(), sin.data_ptr(),
                           q.data_ptr(), k.data_ptr(), v.data_ptr(), torch.get_num_threads())


def silu_mul(
    gate_up: torch.Tensor,  # [n, 2 * inter] bf16 or fp32, last dim contiguous: gate then up
    bounds: list[int],  # the down projection's K-chunk bounds, 0 .. inter
    out: torch.Tensor,  # [n * inter] gate_up's dtype: chunk c is a contiguous [n, bounds[c+1] - bounds[c]] at n * bounds[c]
) -> None:
    n, inter = gate_up.shape[0], gate_up.shape[1] // 2
    assert gate_up.dtype == out.dtype and out.dtype in ACTIVATION_DTYPES and gate_up.stride(1) == 1 and out.numel() == n * inter
    assert bounds[0] == 0 and bounds[-1] == inter
    load().dspark_silu_mul(gate_up.data_ptr(), int(out.dtype == torch.bfloat16), gate_up.stride(0), n, inter, len(bounds) - 1,
                         (ctypes.c_int64 * len(bounds))(*bounds), out.data_ptr(), torch.get_num_threads())


def row_argmax(x: torch.Tensor) -> torch.Tensor:  # [rows, n] fp32 CPU -> [rows] int64
    """torch.argmax(x, -1), the same indices (first maximum; NaN counts as the maximum), by the
    kernel where it is built and x is a CPU fp32 matrix with contiguous rows; torch otherwise.
    The greedy token of every verified row goes through it (tests/model/test_fused_ops.py)."""
    lib = load()
    if lib is None or x.device.type != "cpu" or x.dtype != torch.float32 or x.dim() != 2 or x.stride(-1) != 1 or x.shape[1] == 0:
        return x.argmax(-1)
    out = torch.empty(x.shape[0], dtype=torch.int64)
    lib.dspark_row_argmax(x.data_ptr(), x.stride(0), x.shape[0], x.shape[1], out.data_ptr(), torch.get_num_threads())
    return out


def race_argmax(
    p: torch.Tensor,  # [num_p_rows, n] fp32: p_t rows
    p_rows: torch.Tensor,  # [rows] int64: the p_t row of each race
    d: torch.Tensor | None,  # [num_d_rows, n] fp32: p_d rows, or None (no race subtracts one)
    d_rows: torch.Tensor | None,  # [rows] int64: the p_d row of a residual race, -1 for a race on p_t itself
    e: torch.Tensor,  # [num_e_rows, n] fp32: Exp(1) noise
    e_rows: torch.Tensor,  # [rows] int64: the noise row of each race
) -> torch.Tensor | None:  # [rows] int64, or None where the kernel cannot take these tensors
    """The winners of exponential races on whole rows, without materialising a score table:
    per race, w = max(p_t - p_d, 0) (or p_t), falling back to p_t when w has no mass, and the
    first argmax of where(w > 0, w / E, -1) (NaN counted as the maximum): the batched torch
    path's expressions, the same IEEE operations element by element, so the same indices
    (tests/model/test_fused_ops.py; rejection_sampler.rejection_sample_batched calls it).
    None when the kernel is not built or a tensor is not a CPU fp32 matrix with contiguous rows."""
    lib = load()
    mats = [t for t in (p, d, e) if t is not None]
    if lib is None or any(t.device.type != "cpu" or t.dtype != torch.float32 or t.dim() != 2 or t.stride(-1) != 1
                          for t in mats) or len({t.shape[1] for t in mats}) != 1 or p.shape[1] == 0:
        return None
    rows = p_rows.shape[0]
    p_rows, e_rows = p_rows.to(torch.int64).contiguous(), e_rows.to(torch.int64).contiguous()
    d_rows = torch.full((rows,), -1, dtype=torch.int64) if d is None else d_rows.to(torch.int64).contiguous()
    out = torch.empty(rows, dtype=torch.int64)
    lib.dspark_race_argmax(p.data_ptr(), p.stride(0), p_rows.data_ptr(), 0 if d is None else d.data_ptr(),
                           0 if d is None else d.stride(0), d_rows.data_ptr(), e.data_ptr(), e.stride(0),
                           e_rows.data_ptr(), rows, p.shape[1], out.data_ptr(), torch.get_num_threads())
    return out
