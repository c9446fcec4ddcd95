"""Sampling: the target distribution (`params`) and lossless verification of drafts
(`rejection_sampler`, with its fused Triton kernel in `rejection_kernel`, imported lazily so
that this package does not import triton)."""

from dspark.sampling.params import SamplingParams, logits_to_probs
from dspark.sampling.rejection_sampler import (
    DraftProbs,
    RejectionBatch,
    RejectionResult,
    draw_exp_noise,
    draw_rejection_randoms,
    draw_uniforms,
    rejection_sample,
    rejection_sample_batched,
    rejection_sample_reference,
)

__all__ = [
    "DraftProbs",
    "RejectionBatch",
    "RejectionResult",
    "SamplingParams",
    "draw_exp_noise",
    "draw_rejection_randoms",
    "draw_uniforms",
    "logits_to_probs",
    "rejection_sample",
    "rejection_sample_batched",
    "rejection_sample_reference",
]
