"""The decoder's layer loop in C++: one call per forward instead of ~300 kernel calls from Python.

With compact weights, fused ops and the batched attention kernel, every op of a decoder layer
is already one of our own C kernels:

    h = add_rms_norm(x, [], input_norm)           fused_ops.py
    qkv = compact_gemm(h, W_qkv)                  compact_weights.py
    q, k, v = rope_split(qkv, cos, sin)           fused_ops.py
    write_kv(k, v); attn = attend(q)              attention.py
    o = compact_gemm(attn, W_o)
    h = add_rms_norm(x += o, post_attn_norm)
    gate_up = compact_gemm(h, W_gate_up)
    act = silu_mul(gate_up)
    down = compact_gemm(act, W_down)
    h = add_rms_norm(x += down, next norm)        (the next layer's input norm, or the final norm)

and the Python that sequences them (Transformer._forward_fused) cost ~4 of the ~21 ms of a
one-token step on a 2-core AVX2 EPYC: ctypes argument marshalling (5-20 µs a call, ~300 calls),
the per-layer tensor bookkeeping and the interpreter. This module runs the same sequence in C++:
it calls the very same compiled functions (their addresses are taken from the loaded libraries,
nothing is recompiled or re-implemented) with the same arguments, into buffers allocated once
per forward. The result is therefore bit-identical to the Python loop by construction, and
tests/model/test_layer_loop.py checks it on prefill, decode, verification and capture shapes.

Used when the model is compact + fused + batched attention (the default on every CPU); any
other configuration, or DSPARK_LAYER_LOOP=0, keeps the Python loop.

    steps = LayerLoop.for_model(model)   # None where it does not apply
    steps.run(x, h_out, cos, sin, plan, capture_slots, captured)
"""

from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass

import torch

from dspark.model import attention, compact_weights, fused_ops

_SOURCE = r"""
#include <cstdint>
#include <cstring>

extern "C" {

// The kernels' entry points (their definitions: compact_weights.py, fused_ops.py, attention.py).
typedef void (*gemm_fn)(const float*, int64_t, int64_t, int64_t, int, const void*, const float*, const float*,
                        int64_t, float*, int64_t, int);
typedef void (*add_rms_norm_fn)(float*, int64_t, int64_t, int64_t, int64_t, const int64_t*, const int64_t*, int,
                                const float*, float, void*, int, int);
typedef void (*rope_split_fn)(const void*, int, int64_t, int64_t, int64_t, int64_t, int64_t, const float*,
                              const float*, float*, float*, float*, int);
typedef void (*silu_mul_fn)(const void*, int, int64_t, int64_t, int64_t, int64_t, const int64_t*, void*, int);
typedef void (*write_kv_fn)(const float*, int64_t, int64_t, const float*, int64_t, int64_t, int64_t, const int64_t*,
                            const int64_t*, const int64_t*, const int64_t*, const int64_t*, int64_t, int64_t, int64_t);
typedef void (*attend_fn)(const float*, int64_t, float*, int64_t, const int64_t*, const int64_t*, const int64_t*,
                          const int64_t*, const int64_t*, const int64_t*, int64_t, int64_t, int64_t, int64_t, float, int);

struct Kernels {
  gemm_fn gemm;
  add_rms_norm_fn add_rms_norm;
  rope_split_fn rope_split;
  silu_mul_fn silu_mul;
  write_kv_fn write_kv;
  attend_fn attend;
};

struct Gemm {  // one compact weight [n, k]: CompactWeight.kernel_args
  int64_t format;
  const void* q;
  const float* d;
  const float* mn;
  int64_t n, k;
};

struct Layer {
  Gemm qkv, o, gate_up, down;
  const float* input_norm;      // [hidden]
  const float* post_attn_norm;  // [hidden]
};

struct Geometry {
  int64_t num_layers, hidden, heads, kv_heads, head_dim, intermediate;
  float eps, scale;  // RMSNorm epsilon; attention's 1 / sqrt(head_dim)
};

struct Step {  // one forward of n tokens; every buffer contiguous, fp32
  int64_t n;
  float* x;         // [n, hidden] residual stream, in: the embeddings; out: the last layer's output
  float* h;         // [n, hidden] normed GEMM input (scratch)
  float* out;       // [n, hidden] the final norm's output
  float* qkv;       // [n, q_size + 2 kv_size]
  float* q;         // [n, heads, head_dim]
  float* k;         // [n, kv_heads, head_dim]
  float* v;         // [n, kv_heads, head_dim]
  float* attn;      // [n, heads * head_dim]
  float* o;         // [n, hidden] o_proj / down_proj output
  float* gate_up;   // [n, 2 intermediate]
  float* act;       // [n, intermediate]
  const float* cos; // [n, head_dim / 2]
  const float* sin;
  const float* final_norm;  // [hidden]
  // the batched attention kernel's plan (transformer.KernelPlan, attention.CacheTable)
  const int64_t* rows;
  const int64_t* tok_req;
  const int64_t* tok_pos;
  const int64_t* row_prefix;
  const int64_t* kptrs;
  const int64_t* vptrs;
  const int64_t* caps;
  const int64_t* capture_slot;  // [num_layers] slot of layer i's output in `captured`, -1 if none
  float* captured;              // [n, num_captured, hidden] or null
  int64_t num_captured;
  int threads;
};

inline void gemm(const Kernels& kn, const Gemm& w, const float* x, int64_t n, float* y, int threads) {
  kn.gemm(x, w.k, n, w.k, static_cast<int>(w.format), w.q, w.d, w.mn, w.n, y, w.n, threads);
}

// Transformer._forward_fused, call for call.
void dspark_decoder_layers(const Kernels* kn_, const Layer* layers, const Geometry* g_, const Step* s_) {
  const Kernels& kn = *kn_;
  const Geometry& g = *g_;
  const Step& s = *s_;
  const int64_t n = s.n, d = g.hidden;
  const int64_t qkv_stride = (g.heads + 2 * g.kv_heads) * g.head_dim;
  const int64_t act_bounds[2] = {0, g.intermediate};
  const int64_t addend_stride[1] = {d};
  const int64_t o_addend[1] = {reinterpret_cast<int64_t>(s.o)};
  kn.add_rms_norm(s.x, d, n, d, 0, o_addend, addend_stride, 0, layers[0].input_norm, g.eps, s.h, 0, s.threads);
  for (int64_t i = 0; i < g.num_layers; ++i) {
    const Layer& L = layers[i];
    gemm(kn, L.qkv, s.h, n, s.qkv, s.threads);
    kn.rope_split(s.qkv, 0, qkv_stride, n, g.heads, g.kv_heads, g.head_dim, s.cos, s.sin, s.q, s.k, s.v, s.threads);
    const int64_t kv_tok = g.kv_heads * g.head_dim;
    kn.write_kv(s.k, kv_tok, g.head_dim, s.v, kv_tok, g.head_dim, n, s.tok_req, s.tok_pos, s.kptrs, s.vptrs, s.caps,
                i, g.kv_heads, g.head_dim);
    kn.attend(s.q, g.heads * g.head_dim, s.attn, n, s.rows, s.tok_req, s.row_prefix, s.kptrs, s.vptrs, s.caps, i,
              g.heads, g.kv_heads, g.head_dim, g.scale, s.threads);
    gemm(kn, L.o, s.attn, n, s.o, s.threads);
    kn.add_rms_norm(s.x, d, n, d, 1, o_addend, addend_stride, 0, L.post_attn_norm, g.eps, s.h, 0, s.threads);
    gemm(kn, L.gate_up, s.h, n, s.gate_up, s.threads);
    kn.silu_mul(s.gate_up, 0, 2 * g.intermediate, n, g.intermediate, 1, act_bounds, s.act, s.threads);
    gemm(kn, L.down, s.act, n, s.o, s.threads);
    const bool last = i + 1 == g.num_layers;
    kn.add_rms_norm(s.x, d, n, d, 1, o_addend, addend_stride, 0, last ? s.final_norm : layers[i + 1].input_norm,
                    g.eps, last ? s.out : s.h, 0, s.threads);
    const int64_t slot = s.capture_slot[i];
    if (slot >= 0)
      for (int64_t t = 0; t < n; ++t)
        std::memcpy(s.captured + (t * s.num_captured + slot) * d, s.x + t * d, d * sizeof(float));
  }
}

}  // extern "C"
"""

_i64, _ptr = ctypes.c_int64, ctypes.c_void_p


class _Kernels(ctypes.Structure):
    _fields_ = [(name, _ptr) for name in ("gemm", "add_rms_norm", "rope_split", "silu_mul", "write_kv", "attend")]


class _Gemm(ctypes.Structure):
    _fields_ = [("format", _i64), ("q", _ptr), ("d", _ptr), ("mn", _ptr), ("n", _i64), ("k", _i64)]


class _Layer(ctypes.Structure):
    _fields_ = [("qkv", _Gemm), ("o", _Gemm), ("gate_up", _Gemm), ("down", _Gemm),
                ("input_norm", _ptr), ("post_attn_norm", _ptr)]


class _Geometry(ctypes.Structure):
    _fields_ = [("num_layers", _i64), ("hidden", _i64), ("heads", _i64), ("kv_heads", _i64), ("head_dim", _i64),
                ("intermediate", _i64), ("eps", ctypes.c_float), ("scale", ctypes.c_float)]


_STEP_BUFFERS = ("x", "h", "out", "qkv", "q", "k", "v", "attn", "o", "gate_up", "act", "cos", "sin", "final_norm",
                 "rows", "tok_req", "tok_pos", "row_prefix", "kptrs", "vptrs", "caps", "capture_slot", "captured")


class _Step(ctypes.Structure):
    _fields_ = [("n", _i64), *[(name, _ptr) for name in _STEP_BUFFERS], ("num_captured", _i64), ("threads", ctypes.c_int)]


_LIBRARY = attention.LazyLibrary(_SOURCE, "layer_loop", {"dspark_decoder_layers": [_ptr, _ptr, _ptr, _ptr]},
                                 fallback="the layer loop stays in Python")


def enabled() -> bool:
    """DSPARK_LAYER_LOOP=0 keeps the Python loop (for A/B measurements); on by default."""
    return os.environ.get("DSPARK_LAYER_LOOP", "1") != "0"


def _address(lib: ctypes.CDLL, name: str) -> int:
    return ctypes.cast(getattr(lib, name), ctypes.c_void_p).value


def _gemm(cw: compact_weights.CompactWeight) -> _Gemm:
    fmt, q, scale, offset = cw.kernel_args
    return _Gemm(fmt, q, scale, offset, cw.out_features, cw.in_features)


@dataclass
class LayerLoop:
    """The C++ loop bound to one model's weights (addresses taken once; the model keeps them alive)."""

    library: ctypes.CDLL
    kernels: _Kernels
    layers: ctypes.Array
    geometry: _Geometry
    q_size: int
    kv_size: int

    @classmethod
    def for_model(cls, model) -> "LayerLoop | None":
        """The loop for a compact, fused model with the batched attention kernel; None otherwise
        (or where a library does not build)."""
        c = model.config
        if not (model.compact and model.fused and model.attention == "batched"):
            return None
        libraries = [_LIBRARY.get(), compact_weights.load(), fused_ops.load(), attention.load_kernel()]
        if any(lib is None for lib in libraries):
            return None
        loop_lib, gemm_lib, fused_lib, attn_lib = libraries
        kernels = _Kernels(_address(gemm_lib, "dspark_compact_gemm"), _address(fused_lib, "dspark_add_rms_norm"),
                           _address(fused_lib, "dspark_rope_split"), _address(fused_lib, "dspark_silu_mul"),
                           _address(attn_lib, "dspark_write_kv"), _address(attn_lib, "dspark_attend"))
        layers = (_Layer * c.num_layers)()
        for i, layer in enumerate(model.layers):
            layers[i] = _Layer(_gemm(layer.qkv_proj.weight), _gemm(layer.o_proj.weight), _gemm(layer.gate_up_proj.weight),
                               _gemm(layer.down_proj.weight), layer.input_norm.data_ptr(), layer.post_attn_norm.data_ptr())
        geometry = _Geometry(c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, c.intermediate_size,
                             c.rms_norm_eps, c.head_dim**-0.5)
        return cls(loop_lib, kernels, layers, geometry, c.q_size, c.kv_size)

    def run(
        self,
        x: torch.Tensor,  # [num_tokens, hidden] fp32 contiguous: the embeddings in, the last layer's output out
        cos: torch.Tensor,  # [num_tokens, head_dim // 2] fp32 contiguous
        sin: torch.Tensor,  # [num_tokens, head_dim // 2] fp32 contiguous
        final_norm: torch.Tensor,  # [hidden] fp32
        plan,  # transformer.KernelPlan of this forward
        capture_layers: tuple[int, ...] = (),
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The final normed hidden states [num_tokens, hidden] and the captured layers' outputs
        [num_tokens, len(capture_layers), hidden] (None without capture_layers)."""
        g = self.geometry
        n = x.shape[0]
        assert x.dtype == torch.float32 and x.is_contiguous() and x.shape[1] == g.hidden
        assert cos.is_contiguous() and sin.is_contiguous() and cos.shape == sin.shape == (n, g.head_dim // 2)
        buffers = {
            "h": torch.empty(n, g.hidden),
            "out": torch.empty(n, g.hidden),
            "qkv": torch.empty(n, self.q_size + 2 * self.kv_size),
            "q": torch.empty(n, g.heads, g.head_dim),
            "k": torch.empty(n, g.kv_heads, g.head_dim),
            "v": torch.empty(n, g.kv_heads, g.head_dim),
            "attn": torch.empty(n, self.q_size),
            "o": torch.empty(n, g.hidden),
            "gate_up": torch.empty(n, 2 * g.intermediate),
            "act": torch.empty(n, g.intermediate),
        }
        slots = [-1] * g.num_layers
        for slot, layer in enumerate(capture_layers):
            slots[layer] = slot  # a layer named twice: its last slot (the Python loop's stack repeats it; handled below)
        capture_slot = torch.tensor(slots, dtype=torch.int64)  # [num_layers]
        captured = torch.empty(n, len(capture_layers), g.hidden) if capture_layers else None
        table = plan.table
        tensors = {**buffers, "x": x, "cos": cos, "sin": sin, "final_norm": final_norm, "rows": plan.rows,
                   "tok_req": plan.tok_req, "tok_pos": plan.tok_pos, "row_prefix": plan.row_prefix,
                   "kptrs": table.kptrs, "vptrs": table.vptrs, "caps": table.caps, "capture_slot": capture_slot}
        step = _Step(n, *[tensors[name].data_ptr() if name != "captured" else (captured.data_ptr() if captured is not None else None)
                          for name in _STEP_BUFFERS], len(capture_layers), torch.get_num_threads())
        self.library.dspark_decoder_layers(ctypes.byref(self.kernels), self.layers, ctypes.byref(self.geometry),
                                           ctypes.byref(step))
        if captured is not None:
            for slot, layer in enumerate(capture_layers):  # a repeated layer: copy its one written slot
                if slots[layer] != slot:
                    captured[:, slot] = captured[:, slots[layer]]
        return buffers["out"], captured
