"""One draw per row of a categorical distribution, by inversion in float64.

    tokens = sample_categorical(probs, generator)  # probs [n, V] -> tokens [n]

Drafters draw their tokens with this (DSpark's sequential head, DFlash, EAGLE-3). Why not
`torch.multinomial`: on the CPU it draws V exponentials per row (a race), which for V = 49,152
costs more than the rest of a drafting step; inversion needs one uniform per row and one
cumulative sum. Why float64: the token i is drawn with probability (cdf_i - cdf_{i-1}) / cdf_V,
exact to ~1e-16 relative, far below the fp32 resolution of the rows themselves, so the draw
follows the row the drafter returns (and the verifier corrects against) as closely as that
row's own bits allow. `benchmarks/bench_drafter.py` times the drafting step that uses it.
"""

from __future__ import annotations

import torch


def sample_categorical(probs: torch.Tensor, generator: torch.Generator | list[torch.Generator | None] | None = None) -> torch.Tensor:
    """x_i ~ probs[i] / probs[i].sum() for each row i of probs [n, V] (non-negative, each row
    with positive mass; need not be normalised). Returns [n] int64. A token of probability 0 is
    never drawn. Consumes n float64 uniforms of `generator`, in row order; or, given a list of n
    generators (one per request in a batch), one uniform of each: row i's draw is then what it
    would be alone."""
    if probs.dim() != 2:
        raise ValueError(f"probs must be [n, vocab], got {list(probs.shape)}")
    cdf = probs.double().cumsum(dim=-1)  # [n, V]
    total = cdf[:, -1:]  # [n, 1]
    if not bool((total > 0).all()):
        raise ValueError("every row of probs needs positive mass")
    if isinstance(generator, list):
        if len(generator) != probs.shape[0]:
            raise ValueError(f"need one generator per row, got {len(generator)} for {probs.shape[0]} rows")
        u = torch.cat([torch.rand(1, 1, dtype=torch.float64, generator=g, device=probs.device) for g in generator])  # [n, 1]
    else:
        u = torch.rand(probs.shape[0], 1, dtype=torch.float64, generator=generator, device=probs.device)  # [n, 1] in [0, 1)
    # u·total may round up to total itself; the largest double below it keeps the draw inside the row
    target = torch.minimum(u * total, torch.nextafter(total, torch.zeros_like(total)))  # [n, 1]
    # the first i with cdf_i > target: cdf_i > cdf_{i-1}, so probs[i] > 0
    return torch.searchsorted(cdf, target, right=True).squeeze(1)  # [n]


__all__ = ["sample_categorical"]
