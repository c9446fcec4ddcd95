"""What the trained drafter families share, so that no family imports another's folder.

    shared = SharedWeights.from_target(target)          # the target's embedding and LM head, referenced
    self.shared = checked_shared(shared, config)         # a drafter's `attach_shared`
    tokens, probs = draw_tokens(logits, temperature=1.0, generator=g)   # probs None when greedy
    proposal = to_proposal(tokens, probs, truncated=False)               # dense rows

The weights: every trained drafter reads the target's token embedding and LM head, never
trains them and never saves them (they are the target's tensors, not its parameters).

The draws: the baselines sample every draft position from its own softmax, with no bias from
the tokens drawn before it inside the round (DFlash: all γ positions of one parallel forward at
once; EAGLE-3: one position per autoregressive step). Both go through `draw_tokens` and
`to_proposal`, so the row a proposal carries is, bit for bit, the distribution its token was
drawn from (what the rejection sampler's exactness rests on). Temperature 0 takes the argmax
(ties: lowest id) and proposes a point mass; top-k / top-p truncate the drafter's own softmax
exactly as the target side does (`logits_to_probs`) and the rows travel sparse (ids of the kept
tokens, -1 padding).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from dspark.drafters.base import DraftProposal
from dspark.model.transformer import Transformer
from dspark.sampling.categorical import sample_categorical
from dspark.sampling.params import logits_to_probs

# ---- the target's weights -----------------------------------------------------------------------


@dataclass(frozen=True)
class SharedWeights:
    """The target's token embedding and LM head, referenced (same storage), never trained."""

    embed: torch.Tensor  # [vocab, hidden] fp32
    lm_head: torch.Tensor  # [vocab, hidden] fp32 (the same tensor as `embed` when tied)

    @classmethod
    def from_target(cls, target: Transformer) -> SharedWeights:
        # .detach() shares storage and cuts autograd: no gradient can reach the target's tensors
        return cls(embed=target.embed.weight.detach(), lm_head=target.lm_head_weight.detach())


class _Geometry(Protocol):  # what checked_shared reads of a drafter config
    vocab_size: int
    hidden_size: int


def checked_shared(shared: SharedWeights, config: _Geometry) -> SharedWeights:
    """`shared`, after checking both tensors are [vocab, hidden] as the drafter config says
    (ValueError naming the tensor, its shape and the expected one otherwise)."""
    expected = (config.vocab_size, config.hidden_size)
    for name, tensor in (("embed", shared.embed), ("lm_head", shared.lm_head)):
        got = tuple(tensor.shape)
        if got != expected:
            raise ValueError(f"shared {name} has shape {got}, the drafter config expects [vocab, hidden] = {list(expected)}")
    return shared


# ---- drawing draft tokens with their exact rows -------------------------------------------------


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


__all__ = ["SharedWeights", "checked_shared", "draw_tokens", "is_truncated", "to_proposal"]
