"""Draw draft tokens from per-position logits and package them with the exact rows drawn from.

The baselines sample every draft position from its own softmax, with no bias from the tokens
drawn before it inside the round (DFlash: all γ positions of one parallel forward at once;
EAGLE-3: one position per autoregressive step). Both go through these two functions, so the
row a proposal carries is, bit for bit, the distribution its token was drawn from (what the
rejection sampler's exactness rests on):

    tokens, probs = draw_tokens(logits, temperature=1.0, generator=g)   # probs None when greedy
    proposal = to_proposal(tokens, probs, truncated=False)               # dense rows

Temperature 0 takes the argmax (ties: lowest id) and proposes a point mass; top-k / top-p
truncate the drafter's own softmax exactly as the target side does (`logits_to_probs`) and the
rows travel sparse (ids of the kept tokens, -1 padding).
"""

from __future__ import annotations

import torch

from dspark.drafters.base import DraftProposal
from dspark.sampling.categorical import sample_categorical
from dspark.sampling.params import logits_to_probs


def is_truncated(*, temperature: float, top_k: int, top_p: float, vocab_size: int) -> bool:
    """Whether sampled rows are truncated (then they travel sparse)."""
    return temperature > 0.0 and ((0 < top_k < vocab_size) or top_p < 1.0)


@torch.no_grad()
def draw_tokens(
    logits: torch.Tensor,  # [n, V] one row per draft position
    *,
    temperature: float,
    top_k: int = 0,
    top_p: float = 1.0,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:  # tokens [n] int64, probs [n, V] fp32 (None when greedy)
    """One token per row from softmax(logits / T) truncated by top-k / top-p; argmax at T = 0."""
    if logits.dim() != 2:
        raise ValueError(f"logits must be [n, vocab], got {list(logits.shape)}")
    if not temperature >= 0.0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if temperature == 0.0:
        return logits.float().argmax(dim=-1), None
    probs = logits_to_probs(logits, temperature=temperature, top_k=top_k, top_p=top_p)  # [n, V]
    return sample_categorical(probs, generator), probs


def to_proposal(
    tokens: torch.Tensor,  # [k] int64
    probs: torch.Tensor | None,  # [k, V] the rows the tokens were drawn from; None = greedy (point masses)
    *,
    truncated: bool,  # rows hold zeros outside a top-k / top-p set: send them sparse
) -> DraftProposal:
    if probs is None:
        return DraftProposal.point_mass(tokens.tolist())
    if not truncated:
        return DraftProposal(token_ids=tokens, dense_probs=probs)
    width = max(int((probs > 0).sum(-1).max()), 1) if len(tokens) else 1
    values, ids = torch.topk(probs, width, dim=-1)  # [k, width], kept tokens first
    return DraftProposal(token_ids=tokens, prob_ids=torch.where(values > 0, ids, torch.full_like(ids, -1)), probs=values)


__all__ = ["draw_tokens", "is_truncated", "to_proposal"]
