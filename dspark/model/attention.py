"""Attention over the KV cache: a batch-invariant kernel for every continuing row of a batch.

Greedy speculative decoding must reproduce plain decoding bit for bit, so a query row's
attention output may depend only on that row's query and its own causal prefix, never on which
other rows or requests share the forward or where the row sits in its query block. A multi-row
SDPA does not give that (its blocking, hence its rounding, follows the shapes), which is why the
transformer used to call a 1-row SDPA per row per layer (240 calls for 8 query tokens on the
30-layer SmolLM2-135M, one call per request per layer in high-batch decode).

`attend_rows` runs every query row of a batch (prefill, decode and verification rows alike) in
one call per layer: a small C++ kernel, compiled with the system C++ compiler at first use and
loaded through ctypes, that reads each request's K/V in place from its own cache buffer (no
gather: each request owns a separate buffer, and copying every row's prefix into one padded
tensor would move ~20 MB per layer at 64 requests x 200 tokens). Each (row, KV head) task is the
same fixed sequence of floating-point operations over the row's own prefix:

  scores  s_j = (q . k_j) * scale, the dot product in 16 fixed lanes summed by a fixed tree
  softmax m = max_j s_j (exact), p_j = exp(s_j - m) by one fixed polynomial (a libm or SIMD
          exp differs from its scalar twin by an ulp, and which one an element gets would
          depend on its place in the loop), l = sum_j p_j in 16 lanes + fixed tree
  output  o = (sum_j p_j v_j, sequential in j) / l

Every floating-point operation is written on explicit 16-lane vectors, so no loop has a scalar
twin (an epilogue, an alignment peel) that could round differently from its vector body. Up to
8 rows of one request share a task, which only shares memory reads. Tasks are independent, so
threading splits them without touching their arithmetic. Pure torch cannot do this without the
gather, and its reductions and exp depend on shapes, offsets and thread splits.

Measured (SmolLM2-135M shapes, 200 cached tokens, one layer, 1 thread): 64 verification rows of
one request 0.64 ms vs 2.4-3.8 ms per-row SDPA, 64 one-token decodes 0.8-1.3 ms vs 3.9-5.0 ms
(memory-bound: 64 separate caches), a 200-token prefill 0.57 ms vs 1.3 ms for the masked SDPA.
Accuracy: closer to fp64 attention than the fp32 SDPA it replaces (tests/model/test_attention.py).

Where the kernel cannot be built (no C++ compiler, KV not on the CPU) the transformer falls back
to the per-row SDPA path (`per_row_attention`), which is also batch-invariant, only slower. A
process uses one of the two throughout, so within it speculative and plain decoding agree.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import subprocess
import tempfile
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F

# The vector helpers both CPU kernels use (this one and fused_ops.py): 16-lane types, loads and
# stores, the fixed-tree lane sum and the fixed exp polynomial, one copy so they cannot drift.
VECTOR_PRELUDE = r"""
#include <cstdint>
#include <cstring>
#include <type_traits>

namespace {

// Explicit 16-lane vectors. Every floating-point operation of a kernel is a vector operation on
// whole lanes; there is no scalar twin of any loop whose rounding could differ (contracted or
// not) from the vector one. Kernels use the operators (+ - * / & | ~ << >> and comparisons,
// lane-wise, a scalar operand broadcast) and the helpers below, never GCC builtins directly, so
// the two spellings of the types compute the same bits:
//   - AVX-512 and other CPUs: GCC vector extensions of 16 lanes (one AVX-512 register);
//   - AVX2 without AVX-512: a pair of 8-lane halves (lanes 0..7, 8..15). GCC has no register for
//     a 64-byte vector there and keeps every such value on the stack (~10x slower kernels); the
//     pair lives in two ymm registers and does the same operation on each half.
constexpr int64_t W = 16;
typedef float v8 __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));
typedef uint32_t v8u __attribute__((vector_size(32)));
typedef uint16_t v8h __attribute__((vector_size(16)));
typedef uint16_t v16h __attribute__((vector_size(32)));
typedef float v4 __attribute__((vector_size(16)));

#if defined(__AVX2__) && !defined(__AVX512F__) && !defined(DSPARK_NATIVE_V16)
#define DSPARK_V16_PAIRS 1

template <class H>
struct Pair {
  H lo, hi;  // lanes 0..7, 8..15
  auto operator[](int i) const { return i < 8 ? lo[i] : hi[i - 8]; }
};
typedef Pair<v8> v16;
typedef Pair<v8i> v16i;
typedef Pair<v8u> v16u;

template <class S>
using if_scalar = std::enable_if_t<std::is_arithmetic_v<S>, int>;

#define DSPARK_PAIR_OP(OP)                                                                                   \
  template <class H> inline Pair<H> operator OP(Pair<H> a, Pair<H> b) { return {a.lo OP b.lo, a.hi OP b.hi}; } \
  template <class H, class S, if_scalar<S> = 0> inline Pair<H> operator OP(Pair<H> a, S s) { return {a.lo OP s, a.hi OP s}; } \
  template <class H, class S, if_scalar<S> = 0> inline Pair<H> operator OP(S s, Pair<H> a) { return {s OP a.lo, s OP a.hi}; }
DSPARK_PAIR_OP(+) DSPARK_PAIR_OP(-) DSPARK_PAIR_OP(*) DSPARK_PAIR_OP(/) DSPARK_PAIR_OP(&) DSPARK_PAIR_OP(|)
DSPARK_PAIR_OP(<<) DSPARK_PAIR_OP(>>)
#undef DSPARK_PAIR_OP
#define DSPARK_PAIR_CMP(OP)                                                                                  \
  template <class H> inline auto operator OP(Pair<H> a, Pair<H> b) { return Pair<decltype(a.lo OP b.lo)>{a.lo OP b.lo, a.hi OP b.hi}; } \
  template <class H, class S, if_scalar<S> = 0> inline auto operator OP(Pair<H> a, S s) { return Pair<decltype(a.lo OP s)>{a.lo OP s, a.hi OP s}; }
DSPARK_PAIR_CMP(<) DSPARK_PAIR_CMP(>) DSPARK_PAIR_CMP(<=) DSPARK_PAIR_CMP(>=) DSPARK_PAIR_CMP(==) DSPARK_PAIR_CMP(!=)
#undef DSPARK_PAIR_CMP
template <class H> inline Pair<H> operator-(Pair<H> a) { return {-a.lo, -a.hi}; }
template <class H> inline Pair<H> operator~(Pair<H> a) { return {~a.lo, ~a.hi}; }

inline v16 splat(float x) { return {v8{} + x, v8{} + x}; }
inline v16i iota() { return {v8i{0, 1, 2, 3, 4, 5, 6, 7}, v8i{8, 9, 10, 11, 12, 13, 14, 15}}; }
// lanes of m set (all ones) take a, the others b
template <class M, class H> inline Pair<H> select(Pair<M> m, Pair<H> a, Pair<H> b) { return {m.lo ? a.lo : b.lo, m.hi ? a.hi : b.hi}; }
// the same 64 bytes as another lane type
template <class To, class H> inline To bits(Pair<H> x) { return {(decltype(To::lo))x.lo, (decltype(To::lo))x.hi}; }
inline v16i to_i32(v16 x) { return {__builtin_convertvector(x.lo, v8i), __builtin_convertvector(x.hi, v8i)}; }  // truncating
template <class H> inline v16 to_f32(Pair<H> x) { return {__builtin_convertvector(x.lo, v8), __builtin_convertvector(x.hi, v8)}; }
inline v16u widen(v16h h) {  // uint16 -> uint32 lanes
  const v8h lo = __builtin_shufflevector(h, h, 0, 1, 2, 3, 4, 5, 6, 7), hi = __builtin_shufflevector(h, h, 8, 9, 10, 11, 12, 13, 14, 15);
  return {__builtin_convertvector(lo, v8u), __builtin_convertvector(hi, v8u)};
}
inline v16h narrow(v16u u) {  // uint32 -> uint16 lanes (the low halves)
  const v8h lo = __builtin_convertvector(u.lo, v8h), hi = __builtin_convertvector(u.hi, v8h);
  return __builtin_shufflevector(lo, hi, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
}

// The first n (<= 16) floats at p, zeros in the remaining lanes; a whole vector is two loads.
inline v16 load(const float* p, int64_t n = W) {
  v16 x;
  if (n == W) {
    std::memcpy(&x.lo, p, 32);
    std::memcpy(&x.hi, p + 8, 32);
  } else {
    float buf[W] = {0};
    std::memcpy(buf, p, n * sizeof(float));
    std::memcpy(&x.lo, buf, 32);
    std::memcpy(&x.hi, buf + 8, 32);
  }
  return x;
}
inline void store(float* p, v16 x, int64_t n = W) {
  if (n == W) {
    std::memcpy(p, &x.lo, 32);
    std::memcpy(p + 8, &x.hi, 32);
  } else {
    float buf[W];
    std::memcpy(buf, &x.lo, 32);
    std::memcpy(buf + 8, &x.hi, 32);
    std::memcpy(p, buf, n * sizeof(float));
  }
}

// lanes summed by a fixed tree: 16 -> 8 -> 4 -> 2 -> 1 (as the attention kernel)
inline float hsum(v16 x) {
  const v8 a = x.lo + x.hi;
  const v4 b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
  return (b[0] + b[2]) + (b[1] + b[3]);
}

#else  // native 16-lane vectors

typedef float v16 __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));
typedef uint32_t v16u __attribute__((vector_size(64)));

inline v16 splat(float x) { return v16{} + x; }
inline v16i iota() { return v16i{0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15}; }
template <class M, class V> inline V select(M m, V a, V b) { return m ? a : b; }
template <class To, class V> inline To bits(V x) { return (To)x; }
inline v16i to_i32(v16 x) { return __builtin_convertvector(x, v16i); }
template <class V> inline v16 to_f32(V x) { return __builtin_convertvector(x, v16); }
inline v16u widen(v16h h) { return __builtin_convertvector(h, v16u); }
inline v16h narrow(v16u u) { return __builtin_convertvector(u, v16h); }

// The first n (<= 16) floats at p, zeros in the remaining lanes. Whole vectors take a
// fixed-size copy (one vector load; a runtime-sized memcpy is a library call), a row's tail
// the sized one: the same vector either way, so the arithmetic that follows is the same.
inline v16 load(const float* p, int64_t n = W) {
  v16 x = {0};
  if (n == W) std::memcpy(&x, p, sizeof x);
  else std::memcpy(&x, p, n * sizeof(float));
  return x;
}
inline void store(float* p, v16 x, int64_t n = W) {
  if (n == W) std::memcpy(p, &x, sizeof x);
  else std::memcpy(p, &x, n * sizeof(float));
}

// lanes summed by a fixed tree: 16 -> 8 -> 4 -> 2 -> 1 (as the attention kernel)
inline float hsum(v16 x) {
  v8 lo, hi;
  std::memcpy(&lo, &x, 32);
  std::memcpy(&hi, reinterpret_cast<char*>(&x) + 32, 32);
  v8 a = lo + hi;
  v4 alo, ahi;
  std::memcpy(&alo, &a, 16);
  std::memcpy(&ahi, reinterpret_cast<char*>(&a) + 16, 16);
  v4 b = alo + ahi;
  return (b[0] + b[2]) + (b[1] + b[3]);
}

#endif

// exp(x) for x <= 0: Cephes expf (the attention kernel's), x < -87 gives exactly 0
inline v16 exp_nonpos(v16 x) {
  const v16i tiny = x < -87.0f;
  v16 xc = select(tiny, splat(-87.0f), x);
  v16 n = (xc * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
  v16 r = xc - n * 0.693359375f;
  r = r + n * 2.12194440e-4f;
  v16 y = splat(1.9875691500e-4f);
  y = y * r + 1.3981999507e-3f;
  y = y * r + 8.3334519073e-3f;
  y = y * r + 4.1665795894e-2f;
  y = y * r + 1.6666665459e-1f;
  y = y * r + 5.0000001201e-1f;
  y = (y * (r * r) + r) + 1.0f;
  const v16 pow2n = bits<v16>((to_i32(n) + 127) << 23);
  y = y * pow2n;
  return bits<v16>(bits<v16i>(y) & ~tiny);
}

}  // namespace
"""

_SOURCE = VECTOR_PRELUDE + r"""
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace {

#if defined(DSPARK_V16_PAIRS)
// The same tree on pairs of 8-lane halves: each level's 16-lane shuffles take a half of the
// output from the matching halves of its inputs, so every half is one 8-lane shuffle pair.
inline v16 transpose_reduce(const v16* x) {
  v16 y[8], z[4], w[2];
  for (int p = 0; p < 8; ++p) y[p] = {x[2 * p].lo + x[2 * p].hi, x[2 * p + 1].lo + x[2 * p + 1].hi};
  auto level = [](v8 a, v8 b, auto pick_a, auto pick_b) { return pick_a(a, b) + pick_b(a, b); };
  for (int p = 0; p < 4; ++p) {
    auto a = [](v8 u, v8 v) { return __builtin_shufflevector(u, v, 0, 1, 2, 3, 8, 9, 10, 11); };
    auto b = [](v8 u, v8 v) { return __builtin_shufflevector(u, v, 4, 5, 6, 7, 12, 13, 14, 15); };
    z[p] = {level(y[2 * p].lo, y[2 * p + 1].lo, a, b), level(y[2 * p].hi, y[2 * p + 1].hi, a, b)};
  }
  for (int p = 0; p < 2; ++p) {
    auto a = [](v8 u, v8 v) { return __builtin_shufflevector(u, v, 0, 1, 8, 9, 4, 5, 12, 13); };
    auto b = [](v8 u, v8 v) { return __builtin_shufflevector(u, v, 2, 3, 10, 11, 6, 7, 14, 15); };
    w[p] = {level(z[2 * p].lo, z[2 * p + 1].lo, a, b), level(z[2 * p].hi, z[2 * p + 1].hi, a, b)};
  }
  auto a = [](v8 u, v8 v) { return __builtin_shufflevector(u, v, 0, 8, 2, 10, 4, 12, 6, 14); };
  auto b = [](v8 u, v8 v) { return __builtin_shufflevector(u, v, 1, 9, 3, 11, 5, 13, 7, 15); };
  const v16 f = {level(w[0].lo, w[1].lo, a, b), level(w[0].hi, w[1].hi, a, b)};
  return {__builtin_shufflevector(f.lo, f.hi, 0, 8, 4, 12, 2, 10, 6, 14),
          __builtin_shufflevector(f.lo, f.hi, 1, 9, 5, 13, 3, 11, 7, 15)};
}
#else
inline v16 transpose_reduce(const v16* x) {
  v16 y[8], z[4], w[2];
  for (int p = 0; p < 8; ++p)
    y[p] = __builtin_shufflevector(x[2 * p], x[2 * p + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
           __builtin_shufflevector(x[2 * p], x[2 * p + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  for (int p = 0; p < 4; ++p)
    z[p] = __builtin_shufflevector(y[2 * p], y[2 * p + 1], 0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27) +
           __builtin_shufflevector(y[2 * p], y[2 * p + 1], 4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31);
  for (int p = 0; p < 2; ++p)
    w[p] = __builtin_shufflevector(z[2 * p], z[2 * p + 1], 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29) +
           __builtin_shufflevector(z[2 * p], z[2 * p + 1], 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31);
  const v16 f = __builtin_shufflevector(w[0], w[1], 0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30) +
                __builtin_shufflevector(w[0], w[1], 1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31);
  return __builtin_shufflevector(f, f, 0, 8, 4, 12, 2, 10, 6, 14, 1, 9, 5, 13, 3, 11, 7, 15);
}
#endif


}  // namespace

extern "C" {

// Copy the new tokens' K and V into their requests' caches: token t goes to request
// tok_req[t] at position tok_pos[t], layer `layer`. Cache buffers: [layers, kv_heads, cap, hd].
void dspark_write_kv(const float* k, int64_t k_tok_stride, int64_t k_head_stride,
                     const float* v, int64_t v_tok_stride, int64_t v_head_stride,
                     int64_t num_tokens, const int64_t* tok_req, const int64_t* tok_pos,
                     const int64_t* kbufs, const int64_t* vbufs, const int64_t* caps,
                     int64_t layer, int64_t kv_heads, int64_t hd) {
  for (int64_t t = 0; t < num_tokens; ++t) {
    const int64_t r = tok_req[t], cap = caps[r];
    float* kc = reinterpret_cast<float*>(kbufs[r]) + layer * kv_heads * cap * hd;
    float* vc = reinterpret_cast<float*>(vbufs[r]) + layer * kv_heads * cap * hd;
    for (int64_t h = 0; h < kv_heads; ++h) {
      std::memcpy(kc + (h * cap + tok_pos[t]) * hd, k + t * k_tok_stride + h * k_head_stride, hd * sizeof(float));
      std::memcpy(vc + (h * cap + tok_pos[t]) * hd, v + t * v_tok_stride + h * v_head_stride, hd * sizeof(float));
    }
  }
}

}  // extern "C"

namespace {

constexpr int RB = 8;  // rows of one request that share a task (and its K/V reads)

struct Rows {  // the rows of one task: consecutive rows of one request
  int count;
  const float* q[RB];  // [group, hd] each
  float* o[RB];  // [group, hd] each
  int64_t n[RB];  // keys each row attends to
};

struct Scratch {
  std::vector<float> s;  // [RB, group, npad] scores, then probabilities
  std::vector<v16> qv;  // [RB, group, CH] queries
  std::vector<v16> acc;  // [RB, group, 2, CH] output accumulators (even and odd keys)
  std::vector<float> denom;  // [RB, group] softmax denominators
  std::vector<float> tail;  // [16, hd] zero-padded last key block
};

// One task: the `group` query heads of one KV head for up to RB rows of one request, each row
// over its own first n keys. The rows only share memory reads (a key or value block is loaded
// once for all of them); each row's arithmetic is exactly what it gets alone, so a row's
// output does not depend on which rows share its task. CH: 16-lane chunks per head
// (compile-time, so chunk loops unroll into registers); the last chunk holds `last` lanes.
template <int CH>
void attend_task(const Rows& rows, const float* K, const float* V, int64_t group, int64_t hd, int64_t last,
                 float scale, Scratch& sc) {
  auto ld = [last](const float* p, int c) { return c + 1 < CH || last == W ? load(p) : load(p, last); };
  const int R = rows.count;
  int64_t nmax = 0;
  for (int r = 0; r < R; ++r) nmax = rows.n[r] > nmax ? rows.n[r] : nmax;
  const int64_t npad = (nmax + W - 1) / W * W;  // the scores' row stride, >= every row's padded length
  sc.s.resize(R * group * npad);
  sc.qv.resize(R * group * CH);
  sc.acc.assign(R * group * 2 * CH, v16{});
  sc.denom.resize(R * group);
  for (int r = 0; r < R; ++r)
    for (int64_t g = 0; g < group; ++g)
      for (int c = 0; c < CH; ++c) sc.qv[(r * group + g) * CH + c] = ld(rows.q[r] + g * hd + c * W, c);

  // Scores, 16 keys at a time: acc[jj] = lane-wise partial sums of q . k_jj over elements
  // l, l+16, ... in order, then one transpose-reduce tree turns the 16 accumulators into the 16
  // dot products (lanes never mix keys, so a key's score does not depend on its neighbours).
  // Keys past a row's prefix are masked to -inf; past every row's, read as zeros (never past
  // the cache).
  const v16i lane = iota();
  for (int64_t j0 = 0; j0 < npad; j0 += W) {
    const float* kb = K + j0 * hd;  // [16, hd]
    if (nmax - j0 < W) {
      sc.tail.assign(W * hd, 0.0f);
      std::memcpy(sc.tail.data(), kb, (nmax - j0) * hd * sizeof(float));
      kb = sc.tail.data();
    }
    for (int r = 0; r < R; ++r) {
      if (j0 >= rows.n[r]) continue;
      const v16i live = lane < static_cast<int32_t>(rows.n[r] - j0);
      for (int64_t g = 0; g < group; ++g) {
        v16 qg[CH], acc[W];
        for (int c = 0; c < CH; ++c) qg[c] = sc.qv[(r * group + g) * CH + c];
        for (int jj = 0; jj < W; ++jj) {
          const float* kj = kb + jj * hd;
          v16 a = qg[0] * ld(kj, 0);
          for (int c = 1; c < CH; ++c) a = qg[c] * ld(kj + c * W, c) + a;
          acc[jj] = a;
        }
        const v16 dots = transpose_reduce(acc) * scale;
        store(sc.s.data() + (r * group + g) * npad + j0, select(live, dots, splat(-std::numeric_limits<float>::infinity())));
      }
    }
  }

  // softmax: exact max, exp by the fixed polynomial, the sum in 16 lanes + the fixed tree
  for (int r = 0; r < R; ++r) {
    const int64_t nr = (rows.n[r] + W - 1) / W * W;
    for (int64_t g = 0; g < group; ++g) {
      float* sg = sc.s.data() + (r * group + g) * npad;
      v16 mv = splat(-std::numeric_limits<float>::infinity());
      for (int64_t j = 0; j < nr; j += W) {
        v16 x = load(sg + j);
        mv = select(x > mv, x, mv);
      }
      float m = mv[0];  // max is exact: any order gives the same value
      for (int l = 1; l < W; ++l) m = mv[l] > m ? mv[l] : m;
      v16 acc = {};
      for (int64_t j = 0; j < nr; j += W) {  // padding (-inf) gives exact zeros
        v16 p = exp_nonpos(load(sg + j) - m);
        store(sg + j, p);
        acc = acc + p;
      }
      sc.denom[r * group + g] = hsum(acc);
    }
  }

  // output: sum_j p_j v_j, each lane on its own, in two interleaved sequential sums (even and
  // odd keys, added at the end). Values in blocks of 16 keys, each block used by every row;
  // a (row, head)'s accumulators stay in registers within a block.
  for (int64_t j0 = 0; j0 < nmax; j0 += W) {
    for (int r = 0; r < R; ++r) {
      const int64_t n = rows.n[r];
      if (j0 >= n) continue;
      const int64_t end = n - j0 < W ? n : j0 + W;
      for (int64_t g = 0; g < group; ++g) {
        v16* a = sc.acc.data() + (r * group + g) * 2 * CH;
        v16 even[CH], odd[CH];
        for (int c = 0; c < CH; ++c) even[c] = a[c], odd[c] = a[CH + c];
        const float* pg = sc.s.data() + (r * group + g) * npad;
        int64_t j = j0;
        for (; j + 1 < end; j += 2) {
          const v16 p0 = splat(pg[j]), p1 = splat(pg[j + 1]);
          const float* v0 = V + j * hd;
          for (int c = 0; c < CH; ++c) {
            even[c] = p0 * ld(v0 + c * W, c) + even[c];
            odd[c] = p1 * ld(v0 + hd + c * W, c) + odd[c];
          }
        }
        if (j < end) {  // only at the row's last key (blocks are even-sized): n odd
          const v16 p0 = splat(pg[j]);
          for (int c = 0; c < CH; ++c) even[c] = p0 * ld(V + j * hd + c * W, c) + even[c];
        }
        for (int c = 0; c < CH; ++c) a[c] = even[c], a[CH + c] = odd[c];
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int64_t g = 0; g < group; ++g) {
      const v16* a = sc.acc.data() + (r * group + g) * 2 * CH;
      float* O = rows.o[r] + g * hd;
      for (int c = 0; c < CH; ++c) {
        const v16 x = (a[c] + a[CH + c]) / sc.denom[r * group + g];
        if (c + 1 < CH || last == W) store(O + c * W, x);
        else store(O + c * W, x, last);
      }
    }
}

typedef void (*task_fn)(const Rows&, const float*, const float*, int64_t, int64_t, int64_t, float, Scratch&);

task_fn task_for(int64_t chunks) {
  switch (chunks) {
    case 1: return attend_task<1>;
    case 2: return attend_task<2>;
    case 3: return attend_task<3>;
    case 4: return attend_task<4>;
    case 5: return attend_task<5>;
    case 6: return attend_task<6>;
    case 8: return attend_task<8>;
    case 16: return attend_task<16>;
    default: return nullptr;
  }
}

}  // namespace

extern "C" {

// Whether the kernel handles this head size (1-6, 8 or 16 chunks of 16 lanes).
int dspark_supports(int64_t hd) { return task_for((hd + W - 1) / W) != nullptr; }

// Attention of `rows` query rows, each over the first row_prefix[i] keys of its request's cache.
// q: token row_tok[i] at q + row_tok[i] * q_tok_stride, heads contiguous ([heads, hd]);
// out: [num_tokens, heads, hd] contiguous, written at the same token rows. Query head
// h = kv_head * group + g attends to KV head kv_head (GQA as in HF's repeat_kv).
void dspark_attend(const float* q, int64_t q_tok_stride, float* out,
                   int64_t rows, const int64_t* row_tok, const int64_t* row_req, const int64_t* row_prefix,
                   const int64_t* kbufs, const int64_t* vbufs, const int64_t* caps,
                   int64_t layer, int64_t heads, int64_t kv_heads, int64_t hd, float scale, int num_threads) {
  const int64_t group = heads / kv_heads;
  const int64_t chunks = (hd + W - 1) / W;
  const int64_t last = hd - (chunks - 1) * W;  // lanes of the last chunk
  const task_fn run = task_for(chunks);
  // row blocks: runs of at most RB consecutive rows of the same request
  std::vector<int64_t> starts;
  for (int64_t i = 0; i < rows; ++i)
    if (i == 0 || row_req[i] != row_req[i - 1] || i - starts.back() == RB) starts.push_back(i);
  starts.push_back(rows);
  const int64_t blocks = static_cast<int64_t>(starts.size()) - 1;
  const int64_t tasks = blocks * kv_heads;
  int64_t work = 0;  // (key, KV head) pairs: ~10 ns each
  for (int64_t i = 0; i < rows; ++i) work += row_prefix[i] * kv_heads;
  if (work < 4096) num_threads = 1;  // below ~40 us waking a thread costs more than it saves
#pragma omp parallel num_threads(num_threads)
  {
    Scratch sc;
#pragma omp for schedule(dynamic, 1)
    for (int64_t task = 0; task < tasks; ++task) {
      const int64_t b = task / kv_heads, kvh = task % kv_heads;
      const int64_t r = row_req[starts[b]], cap = caps[r];
      const float* K = reinterpret_cast<const float*>(kbufs[r]) + ((layer * kv_heads + kvh) * cap) * hd;  // [cap, hd]
      const float* V = reinterpret_cast<const float*>(vbufs[r]) + ((layer * kv_heads + kvh) * cap) * hd;  // [cap, hd]
      Rows block;
      block.count = static_cast<int>(starts[b + 1] - starts[b]);
      for (int k = 0; k < block.count; ++k) {
        const int64_t i = starts[b] + k;
        block.q[k] = q + row_tok[i] * q_tok_stride + kvh * group * hd;
        block.o[k] = out + (row_tok[i] * heads + kvh * group) * hd;
        block.n[k] = row_prefix[i];
      }
      run(block, K, V, group, hd, last, scale, sc);
    }
  }
}

}  // extern "C"
"""

# -ffp-contract=off is part of every kernel's contract: FMAs only where written. It is a flag, not
# `#pragma GCC optimize`: the pragma left contractions in inlined vector code (seen on AVX2), and
# the attention kernel had neither, so its rounding depended on what the compiler fused.
_FLAGS = ["-O3", "-march=native", "-fopenmp", "-fPIC", "-shared", "-std=c++17", "-ffp-contract=off"]

_kernel: ctypes.CDLL | None = None
_kernel_error: str | None = None


def _cache_dir() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(root) / "dspark" / "kernels"


def _cpu_signature() -> str:
    """-march=native code runs only on the CPU it was built for: key the cached library by it."""
    try:
        flags = next((l for l in Path("/proc/cpuinfo").read_text().splitlines() if l.startswith("flags")), "")
    except OSError:
        flags = ""
    return platform.machine() + flags


def _build(path: Path, source: str, stem: str) -> None:
    """Compile `source` to `path`: into a temporary file beside it, then an atomic rename, so
    that concurrent builders (test workers, service processes) each publish a whole file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    compiler = os.environ.get("CXX", "c++")
    fd, tmp_lib = tempfile.mkstemp(dir=path.parent, suffix=".so.tmp")
    os.close(fd)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            src = Path(tmp) / f"{stem}.cpp"
            src.write_text(source)
            subprocess.run([compiler, *_FLAGS, str(src), "-o", tmp_lib], check=True, capture_output=True, text=True)
        os.replace(tmp_lib, path)
    finally:
        if os.path.exists(tmp_lib):
            os.unlink(tmp_lib)


def build_library(source: str, stem: str) -> tuple[ctypes.CDLL | None, str | None]:
    """The C++ `source` compiled (about a second, once: cached by source, flags and CPU) and
    loaded, or None and why not. Shared with dspark/model/fused_ops.py.

    DSPARK_NATIVE_V16=1 builds the prelude's native 16-lane vectors on every CPU, also where the
    kernels use 8-lane pairs (AVX2): slower there, and the same bits (the test of the pairs)."""
    if os.environ.get("DSPARK_NATIVE_V16") == "1":
        source = "#define DSPARK_NATIVE_V16 1\n" + source
    digest = hashlib.sha256("\0".join([source, *_FLAGS, _cpu_signature()]).encode()).hexdigest()[:16]
    name = f"dspark_{stem}_{digest}.so"
    errors = []
    # the user's cache first, then the temporary directory (a read-only home in a container)
    for directory in (_cache_dir(), Path(tempfile.gettempdir()) / "dspark-kernels"):
        path = directory / name
        try:
            if not path.exists():
                _build(path, source, stem)
            return ctypes.CDLL(str(path)), None
        except (OSError, subprocess.CalledProcessError) as e:
            errors.append((getattr(e, "stderr", "") or str(e)).strip()[:500])
    return None, "; ".join(errors)


class LazyLibrary:
    """A kernel library built and loaded on first use (build_library), with its functions'
    ctypes signatures set; None, warned once, where the build fails (the caller's fallback)."""

    def __init__(self, source: str, stem: str, signatures: dict[str, list], fallback: str):
        self.source, self.stem, self.signatures, self.fallback = source, stem, signatures, fallback
        self.lib: ctypes.CDLL | None = None
        self.error: str | None = None

    def get(self) -> ctypes.CDLL | None:
        if self.lib is not None or self.error is not None:
            return self.lib
        lib, error = build_library(self.source, self.stem)
        if lib is None:
            self.error = f"{self.stem} kernels unavailable ({error}); {self.fallback}"
            warnings.warn(self.error, RuntimeWarning, stacklevel=3)
            return None
        for name, argtypes in self.signatures.items():
            getattr(lib, name).argtypes = argtypes
            getattr(lib, name).restype = None
        self.lib = lib
        return lib


def load_kernel() -> ctypes.CDLL | None:
    """The compiled kernel, building it on first use (about a second); None where that fails."""
    global _kernel, _kernel_error
    if _kernel is not None or _kernel_error is not None:
        return _kernel
    lib, error = build_library(_SOURCE, "attention")
    if lib is None:
        _kernel_error = f"batched attention kernel unavailable ({error}); using per-row SDPA"
        warnings.warn(_kernel_error, RuntimeWarning, stacklevel=2)
        return None
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.dspark_write_kv.argtypes = [ptr, i64, i64, ptr, i64, i64, i64, ptr, ptr, ptr, ptr, ptr, i64, i64, i64]
    lib.dspark_write_kv.restype = None
    lib.dspark_attend.argtypes = [ptr, i64, ptr, i64, ptr, ptr, ptr, ptr, ptr, ptr, i64, i64, i64, i64, ctypes.c_float, ctypes.c_int]
    lib.dspark_attend.restype = None
    lib.dspark_supports.argtypes = [i64]
    lib.dspark_supports.restype = ctypes.c_int
    _kernel = lib
    return lib


def kernel_available(head_dim: int | None = None) -> bool:
    """Whether the kernel is built (and handles `head_dim`: at most 96, 113-128 or 241-256)."""
    lib = load_kernel()
    return lib is not None and (head_dim is None or bool(lib.dspark_supports(head_dim)))


class CacheTable:
    """Raw addresses of a batch's per-request K/V buffers, for the kernel. Holds the buffers
    themselves too, so they outlive every call that uses the addresses."""

    def __init__(self, keys: list[torch.Tensor], values: list[torch.Tensor]):
        # keys, values: per request [num_layers, kv_heads, capacity, head_dim] fp32, contiguous, CPU
        for t in (*keys, *values):
            if t.dtype != torch.float32 or not t.is_contiguous() or t.device.type != "cpu":
                raise ValueError("the batched attention kernel needs contiguous fp32 CPU K/V buffers")
        self.buffers = (keys, values)
        self.kptrs = torch.tensor([t.data_ptr() for t in keys], dtype=torch.int64)  # [requests]
        self.vptrs = torch.tensor([t.data_ptr() for t in values], dtype=torch.int64)  # [requests]
        self.caps = torch.tensor([t.shape[2] for t in keys], dtype=torch.int64)  # [requests]


def write_kv(
    table: CacheTable,
    layer: int,
    k: torch.Tensor,  # [num_tokens, kv_heads, head_dim] fp32, head_dim contiguous
    v: torch.Tensor,  # [num_tokens, kv_heads, head_dim] fp32, head_dim contiguous
    tok_req: torch.Tensor,  # [num_tokens] int64 request index into the table
    tok_pos: torch.Tensor,  # [num_tokens] int64 position in that request's cache
) -> None:
    assert k.dtype == v.dtype == torch.float32 and k.stride(-1) == v.stride(-1) == 1
    lib = load_kernel()
    kv_heads, head_dim = k.shape[1], k.shape[2]
    lib.dspark_write_kv(k.data_ptr(), k.stride(0), k.stride(1), v.data_ptr(), v.stride(0), v.stride(1), k.shape[0],
                        tok_req.data_ptr(), tok_pos.data_ptr(), table.kptrs.data_ptr(), table.vptrs.data_ptr(),
                        table.caps.data_ptr(), layer, kv_heads, head_dim)


def attend_rows(
    table: CacheTable,
    layer: int,
    q: torch.Tensor,  # [num_tokens, heads, head_dim] fp32, [heads, head_dim] contiguous per token
    out: torch.Tensor,  # [num_tokens, heads, head_dim] fp32 contiguous; rows `row_tok` are written
    row_tok: torch.Tensor,  # [rows] int64 token index of each row
    row_req: torch.Tensor,  # [rows] int64 request index into the table
    row_prefix: torch.Tensor,  # [rows] int64 keys the row attends to (its causal prefix, itself included)
    kv_heads: int,
) -> None:
    heads, head_dim = q.shape[1], q.shape[2]
    assert q.dtype == out.dtype == torch.float32 and out.is_contiguous()
    assert q.stride(2) == 1 and q.stride(1) == head_dim
    lib = load_kernel()
    lib.dspark_attend(q.data_ptr(), q.stride(0), out.data_ptr(), row_tok.shape[0], row_tok.data_ptr(),
                      row_req.data_ptr(), row_prefix.data_ptr(), table.kptrs.data_ptr(), table.vptrs.data_ptr(),
                      table.caps.data_ptr(), layer, heads, kv_heads, head_dim, head_dim**-0.5, torch.get_num_threads())


def grouped_attention(
    q: torch.Tensor,  # [q_len, heads, head_dim]
    keys: torch.Tensor,  # [kv_heads, kv_len, head_dim]
    values: torch.Tensor,  # [kv_heads, kv_len, head_dim]
    mask: torch.Tensor | None,  # [q_len, kv_len] bool (True = attend), None = attend to all
) -> torch.Tensor:  # [q_len, heads, head_dim]
    """GQA as plain multi-query SDPA: the `group` query heads sharing a KV head become `group`
    rows of one query block (head h = kv_head * group + g, as in HF's repeat_kv). ~20x faster on
    this CPU than SDPA's enable_gqa path for decode-sized queries, and no K/V copies."""
    q_len, heads, head_dim = q.shape
    kv_heads = keys.shape[0]
    group = heads // kv_heads
    if q_len == 1:  # decode: the group's rows are already contiguous, views only (no copies)
        o = F.scaled_dot_product_attention(q.view(1, kv_heads, group, head_dim), keys.unsqueeze(0), values.unsqueeze(0))
        return o.view(1, heads, head_dim)
    rows = q.view(q_len, kv_heads, group, head_dim).permute(1, 2, 0, 3).reshape(1, kv_heads, group * q_len, head_dim)
    if mask is not None:
        mask = mask.repeat(group, 1)  # [group * q_len, kv_len], row order (g, i) as in `rows`
    o = F.scaled_dot_product_attention(rows, keys.unsqueeze(0), values.unsqueeze(0), attn_mask=mask)
    return o.view(kv_heads, group, q_len, head_dim).permute(2, 0, 1, 3).reshape(q_len, heads, head_dim)


def per_row_attention(
    q: torch.Tensor,  # [q_len, heads, head_dim] the rows of one continuing request
    keys: torch.Tensor,  # [kv_heads, >= ctx_len + q_len, head_dim]
    values: torch.Tensor,  # [kv_heads, >= ctx_len + q_len, head_dim]
    ctx_len: int,
) -> torch.Tensor:  # [q_len, heads, head_dim]
    """The fallback: each row as plain decoding computes it, one 1-row SDPA over its prefix."""
    return torch.cat([grouped_attention(q[i : i + 1], keys[:, : ctx_len + i + 1], values[:, : ctx_len + i + 1], None)
                      for i in range(q.shape[0])])


def reference_attention(
    q: torch.Tensor,  # [heads, head_dim] one query row
    keys: torch.Tensor,  # [kv_heads, n, head_dim] its prefix
    values: torch.Tensor,  # [kv_heads, n, head_dim]
) -> torch.Tensor:  # [heads, head_dim] fp64
    """Exact attention in fp64, the yardstick for the kernel's accuracy."""
    heads, kv_heads = q.shape[0], keys.shape[0]
    k = keys.double().repeat_interleave(heads // kv_heads, dim=0)  # [heads, n, head_dim]
    v = values.double().repeat_interleave(heads // kv_heads, dim=0)
    scores = torch.einsum("hd,hnd->hn", q.double(), k) / q.shape[-1] ** 0.5  # [heads, n]
    return torch.einsum("hn,hnd->hd", scores.softmax(-1), v)
