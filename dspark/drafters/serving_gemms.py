"""The drafters' GEMMs at serving time: every linear layer and the vocabulary projections
through oneDNN's prepacked fp32 path (`SplitKLinear`, the target's own GEMM), not MKL's sgemm.

Why: a drafting round multiplies a handful of rows (γ per request) by each weight, and MKL's
fp32 sgemm is slow there. Measured on an AMD EPYC (avx512_bf16, 2 threads, torch 2.13):
[7, 576] x [576, 8192] (the draft-vocabulary LM head) 6.4 ms plain, 0.78 ms packed;
[7, 576] x [576, 3072] (gate/up) 0.63 -> 0.17 ms; the LM head alone was a third of a round.
`DSPARK_DRAFTER_GEMMS=plain` keeps the plain layers (for A/B runs of benchmarks/bench_drafter.py).

Exactness does not depend on these numbers: a proposal carries the rows its tokens were
sampled from, and the verifier corrects against them (docs/method.md §1). What must hold is
that a request's rows do not depend on the other requests in the batch (a seeded request
draws the same drafts alone or batched): fp32 weights packed for batch 8 give row-invariant
results for reductions up to 1024 (longer ones are split in fixed chunks), checked in
tests/drafters/test_serving_gemms.py at the drafters' shapes. Training never uses this path
(no autograd through packed weights): `prepare_for_serving` is called by the serving
drafters' `load`, on their own copy of the model.
"""

from __future__ import annotations

import os

import torch
from torch import nn

from dspark.model.transformer import SplitKLinear


# A packed call costs ~50 µs of fixed overhead here: a layer with few outputs (the confidence
# head's single logit: 4 µs plain) is faster as it is. The sequential head's x W2 at one row per
# request (61 µs plain, 95 µs packed for [1, 64] x [64, 8192]) stays plain for the same reason.
MIN_OUT_FEATURES = 64
ENABLED = os.environ.get("DSPARK_DRAFTER_GEMMS", "packed") != "plain"


class PackedLinear(nn.Module):
    """An nn.Linear's y = x Wᵀ + b through a prepacked SplitKLinear, for inputs of any leading
    shape. Keeps the original `weight` (and `bias`) readable: code that slices the weight (a
    layer's context keys/values use W_K, W_V alone) still works, on the plain path."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight, self.bias = linear.weight, linear.bias
        self.__dict__["gemm"] = packed_gemm(linear.weight.detach(), None if linear.bias is None else linear.bias.detach())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [..., in_features] -> [..., out_features] fp32
        y = self.__dict__["gemm"](x.reshape(-1, self.in_features).float())  # [prod(...), out_features]
        return y.view(*x.shape[:-1], self.out_features)


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
    """Swap every nn.Linear of `model` (in place) for a PackedLinear; returns the model. Only on
    the CPU: elsewhere the plain layers are already the fast path."""
    if not available(model):
        return model
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear and child.out_features >= MIN_OUT_FEATURES:
                setattr(parent, name, PackedLinear(child))
    return model


__all__ = ["PackedLinear", "available", "packed_gemm", "prepare_for_serving"]
