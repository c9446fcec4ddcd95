"""The contract between a drafter and the speculative engine.

A drafter sees, per request, the tokens so far (prompt + output, the last one being the anchor
x_0 whose K/V the target has not computed yet) and proposes up to γ draft tokens together with
the exact distribution rows it sampled them from. Losslessness needs nothing else from it: the
rejection sampler is exact for ANY p_d, provided it is the p_d the drafter really sampled from.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from dspark.sampling.params import SamplingParams


@dataclass
class DraftRequest:
    request_id: str
    token_ids: list[int]  # prompt + generated so far; token_ids[-1] is the anchor x_0
    num_prompt_tokens: int
    params: SamplingParams
    max_draft_tokens: int  # γ for this round (may be less near max_tokens)
    generator: torch.Generator | None = None  # the request's own stream, for reproducible seeded drafts
    # True on a round the draft gate judged not worth the model drafter's cost: a drafter with
    # `free_proposals` (lookups) proposes only what costs nothing, or nothing
    free_only: bool = False


@dataclass
class DraftProposal:
    token_ids: torch.Tensor  # [num_draft] int64 (may be empty)
    # The rows the tokens were sampled from: sparse (ids + probs, zero elsewhere) or dense.
    # A deterministic drafter (n-gram lookup) proposes from a point mass: ids [[x_k]], probs [[1.0]].
    prob_ids: torch.Tensor | None = None  # [num_draft, k] int64, -1 = padding
    probs: torch.Tensor | None = None  # [num_draft, k] fp32, rows sum to 1
    dense_probs: torch.Tensor | None = None  # [num_draft, vocab] fp32, rows sum to 1
    confidences: torch.Tensor | None = None  # [num_draft] calibrated conditional c_k, if the drafter has them
    # True: drafting it cost next to nothing (a lookup in the context, not a model forward); the
    # draft gate, which decides whether the model drafts at all, learns from the other proposals
    free: bool = False

    def __post_init__(self) -> None:
        if (self.dense_probs is None) == (self.prob_ids is None or self.probs is None):
            raise ValueError("a DraftProposal needs exactly one of dense_probs or (prob_ids, probs)")

    @classmethod
    def empty(cls) -> "DraftProposal":
        return cls(
            token_ids=torch.empty(0, dtype=torch.long),
            prob_ids=torch.empty(0, 1, dtype=torch.long),
            probs=torch.empty(0, 1, dtype=torch.float32),
        )

    @classmethod
    def point_mass(cls, token_ids: list[int]) -> "DraftProposal":
        ids = torch.tensor(token_ids, dtype=torch.long)
        return cls(token_ids=ids, prob_ids=ids.unsqueeze(1), probs=torch.ones(len(token_ids), 1))

    def __len__(self) -> int:
        return int(self.token_ids.shape[0])

    def truncated(self, length: int) -> "DraftProposal":
        """The first `length` drafts (a prefix keeps each token's row: still exactly what it was
        sampled from)."""
        if length >= len(self):
            return self
        cut = lambda t: None if t is None else t[:length]  # noqa: E731
        return DraftProposal(token_ids=self.token_ids[:length], prob_ids=cut(self.prob_ids), probs=cut(self.probs),
                             dense_probs=cut(self.dense_probs), confidences=cut(self.confidences), free=self.free)

    def dense(self, vocab_size: int) -> torch.Tensor:  # [num_draft, vocab] fp32
        if self.dense_probs is not None:
            return self.dense_probs
        rows = torch.zeros(len(self), vocab_size)
        keep = self.prob_ids >= 0
        rows.scatter_add_(1, self.prob_ids.clamp(min=0), torch.where(keep, self.probs, torch.zeros_like(self.probs)))
        return rows


class Drafter(Protocol):
    """What the engine calls. A drafter that reads the target's hidden states (DSpark) also sets
    `needs_hidden_states = True` and implements `observe(request_id, features)`: the engine then
    captures the target's chosen layer outputs and hands over those of every newly verified
    position ([num_new, num_capture_layers, hidden]), in order. A drafter whose proposals carry
    calibrated confidences sets `provides_confidences = True` (the dspark/threshold policies need them).
    A drafter with proposals that cost nothing next to a verify step (lookups) sets
    `free_proposals = True`: the engine then asks it for those (DraftRequest.free_only) on rounds
    whose model drafting the draft gate skips."""

    name: str

    def propose(self, requests: list[DraftRequest]) -> list[DraftProposal]: ...

    def remove_request(self, request_id: str) -> None: ...


class NoDrafter:
    """Plain autoregressive decoding: nothing proposed, every round emits one target token."""

    name = "none"

    def propose(self, requests: list[DraftRequest]) -> list[DraftProposal]:
        return [DraftProposal.empty() for _ in requests]

    def remove_request(self, request_id: str) -> None:
        pass
