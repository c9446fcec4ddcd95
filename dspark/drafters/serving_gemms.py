"""The drafters' GEMMs at serving time: every linear layer and the vocabulary projections
through a row-invariant kernel that is fast at a handful of rows, not MKL's sgemm.

Which kernel, per weight (`serving_gemm`):
- the compact kernel (dspark/model/compact_weights.py) where the weight has an exact compact
  format: a checkpoint stored in bf16 (the shipped drafter's is: every fp32 weight it loads is a
  bf16 value) and the target's q8_0 LM head rows. The same fp32 weights read from 2 (bf16) or
  1.125 (q8_0) bytes instead of 4;
- otherwise oneDNN's prepacked fp32 path (`SplitKLinear`, the target's dense GEMM): weights
  trained and kept in fp32 (the tests' random drafters).
Both give a row the same bits whatever the other rows (a seeded request draws the same drafts
alone or batched): the compact kernel by construction, packed fp32 weights for reductions up to
1024 (longer ones are split in fixed chunks); tests/drafters/test_serving_gemms.py checks both
at the drafters' shapes. Neither changes a weight, so the serving drafter samples from the
distribution training fits (tests/drafters/test_serving_matches_training.py).

Why not the plain layers: a drafting round multiplies γ rows per request by each weight. On an
AMD EPYC (avx512_bf16, torch 2.13) MKL's sgemm took 6.4 ms for [7, 576] x [576, 8192] (the draft
vocabulary's LM head), oneDNN packed 0.78 ms. On an Intel Xeon (AMX, 2 threads) MKL is not slow
there; the compact kernel's fewer bytes took a round of one greedy request from 6.1-6.3 ms
(packed) to 4.0-4.2 ms (docs/results/forward.md, `benchmarks/bench_drafter.py`).
`DSPARK_DRAFTER_GEMMS=packed` skips the compact kernel, `=plain` keeps the plain layers (A/B runs).

Training never uses this path (no autograd through either): `prepare_for_serving` is called by
the serving drafters' `load`, on their own copy of the model.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch
from torch import nn

from dspark.model import compact_weights
from dspark.model.transformer import SplitKLinear

# A packed call costs ~50 µs of fixed overhead here: a layer with few outputs (the confidence
# head's single logit: 4 µs plain) is faster as it is.
MIN_OUT_FEATURES = 64
_MODE = os.environ.get("DSPARK_DRAFTER_GEMMS", "auto")  # auto (compact where exact, else packed) | packed | plain
if _MODE not in ("auto", "packed", "plain"):
    raise ValueError(f"DSPARK_DRAFTER_GEMMS must be auto, packed or plain, got {_MODE!r}")
ENABLED = _MODE != "plain"

Gemm = Callable[[torch.Tensor], torch.Tensor]  # x [n, in] fp32 -> x Wᵀ (+ b) [n, out] fp32


class ServingLinear(nn.Module):
    """An nn.Linear's y = x Wᵀ + b through `serving_gemm`, for inputs of any leading shape. Keeps
    the original `weight` (and `bias`) readable: code that slices the weight (a layer's context
    keys/values use W_K, W_V alone) still works."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight, self.bias = linear.weight, linear.bias
        self.__dict__["gemm"] = serving_gemm(linear.weight.detach(), None if linear.bias is None else linear.bias.detach())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [..., in_features] -> [..., out_features] fp32
        y = self.__dict__["gemm"](x.reshape(-1, self.in_features).float())  # [prod(...), out_features]
        return y.view(*x.shape[:-1], self.out_features)


class CompactGemm:
    """x -> x Wᵀ (+ b) through the compact kernel, W in its exact compact format."""

    def __init__(self, weight: compact_weights.CompactWeight, bias: torch.Tensor | None):
        self.weight, self.bias = weight, bias  # bias: [out] fp32 or None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        # x: [n, in] -> [n, out] fp32
        y = compact_weights.matmul(x.float().contiguous(), self.weight)
        return y if self.bias is None else y.add_(self.bias)

    def __repr__(self) -> str:
        return f"CompactGemm({self.weight.in_features}, {self.weight.out_features}, format={self.weight.format})"


def serving_gemm(weight: torch.Tensor, bias: torch.Tensor | None = None) -> Gemm:
    """x -> x Wᵀ (+ b) [n, out] fp32 for weight [out, in]: the compact kernel where the weight has
    an exact compact format, else oneDNN's prepacked fp32 path (module docstring)."""
    if _MODE == "auto" and compact_weights.available():
        found = compact_weights.compact(weight)
        if found is not None:
            return CompactGemm(found, None if bias is None else bias.detach().float().contiguous())
    return packed_gemm(weight, bias)


def packed_gemm(weight: torch.Tensor, bias: torch.Tensor | None = None) -> SplitKLinear:
    """x -> x Wᵀ (+ b) in fp32 through oneDNN's prepacked path. weight: [out, in]; x: [n, in]."""
    gemm = SplitKLinear(weight.shape[1], weight.shape[0], bias=bias is not None, dtype=torch.float32)
    gemm.load(weight.float(), None if bias is None else bias.float())
    gemm.requires_grad_(False)
    gemm.prepack()
    return gemm


def available(model: nn.Module) -> bool:
    """Whether the packed path applies to `model` (enabled, oneDNN present, weights on the CPU)."""
    return ENABLED and torch.backends.mkldnn.is_available() and all(p.device.type == "cpu" for p in model.parameters())


def prepare_for_serving(model: nn.Module) -> nn.Module:
    """Swap every nn.Linear of `model` (in place) for a ServingLinear; returns the model. Only on
    the CPU: elsewhere the plain layers are already the fast path."""
    if not available(model):
        return model
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear and child.out_features >= MIN_OUT_FEATURES:
                setattr(parent, name, ServingLinear(child))
    return model


__all__ = ["CompactGemm", "ServingLinear", "available", "packed_gemm", "prepare_for_serving", "serving_gemm"]
