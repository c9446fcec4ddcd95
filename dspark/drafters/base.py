"""The contract between a drafter and the speculative engine.

A drafter sees, per request, the tokens so far (prompt + output, the last one being the anchor
x_0 whose K/V the target has not computed yet) and proposes up to γ draft tokens together with
the exact distribution rows it sampled them from. Losslessness needs nothing else from it: the
rejection sampler is exact for ANY p_d, provided it is the p_d the drafter really sampled from.

What a drafter is and needs it declares once, as data (`DrafterSpec`); what it does per request
is the small `Drafter` base (propose, and the lifecycle methods with their defaults). The
engine, the drafter service and the evaluation read `drafter.spec` and call these methods,
nothing else: a capability that is not in the spec does not exist, so none can go missing
because a drafter forgot an attribute (`checked_spec` refuses anything else at the boundary).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

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
    # True on a round the draft gate judged not worth the model drafter's cost: a drafter whose
    # spec declares `free_proposals` (lookups) proposes only what costs nothing, or nothing
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


@dataclass(frozen=True)
class DrafterSpec:
    """What a drafter declares about itself: read once by the engine and the drafter service
    (and sent over gRPC as DrafterInfo), never probed."""

    name: str  # the registry name: "ngram", "dspark", "dspark-lookup", ...
    # the engine captures the target's `capture_layers` outputs and hands them over (observe)
    needs_hidden_states: bool = False
    capture_layers: tuple[int, ...] = ()  # target layers it reads, in order; empty unless needs_hidden_states
    provides_confidences: bool = False  # every non-empty proposal carries calibrated c_k (the dspark/threshold policies need them)
    # some proposals cost nothing next to a verify step (lookups): the engine asks for those
    # (DraftRequest.free_only) on rounds whose model drafting the draft gate skips
    free_proposals: bool = False
    block_size: int | None = None  # the most drafts one proposal holds (its trained block); None = no bound of its own
    draft_vocab_size: int | None = None  # N, the vocabulary it drafts from; None = the target's whole vocabulary

    def __post_init__(self) -> None:
        object.__setattr__(self, "capture_layers", tuple(self.capture_layers))
        if not self.name:
            raise ValueError("a DrafterSpec needs a non-empty name")
        if self.needs_hidden_states != bool(self.capture_layers):
            raise ValueError(f"drafter {self.name!r}: capture_layers must list the target layers read exactly when "
                             f"needs_hidden_states, got needs_hidden_states={self.needs_hidden_states}, "
                             f"capture_layers={self.capture_layers}")
        if any(layer < 0 for layer in self.capture_layers):
            raise ValueError(f"drafter {self.name!r}: capture_layers must be >= 0, got {self.capture_layers}")
        for field, value in (("block_size", self.block_size), ("draft_vocab_size", self.draft_vocab_size)):
            if value is not None and value < 1:
                raise ValueError(f"drafter {self.name!r}: {field} must be >= 1 or None, got {value}")


class Drafter(ABC):
    """What the engine calls. Every drafter declares `spec` (a DrafterSpec: a class attribute, a
    property, or set in __init__) and implements `propose`; the lifecycle methods have defaults
    for a drafter that keeps nothing per request. Per request, the engine calls

      add_request     before its first round, and again, from its tokens so far, when the request
                      is rebuilt: it registers the request afresh, replacing whatever the drafter
                      still holds under that id (default: `remove_request`);
      observe         after every round, only if spec.needs_hidden_states: the target's outputs at
                      spec.capture_layers of every newly verified position, [num_new,
                      num_capture_layers, hidden], in order (`observe_many`: several requests at
                      once, one call; default: one `observe` each);
      propose         every round, for all running requests at once;
      remove_request  when it finishes or is aborted (`remove_requests`: several at once).

    A drafter that reads hidden states implements `observe` and `context_len`; their defaults
    raise, since the engine only calls them on such a drafter. A remote drafter
    (services/drafter/client.py) implements each method as one RPC."""

    spec: DrafterSpec
    # False for a drafter in another process (services/drafter/client.py): its calls can fail for
    # reasons that are not the request's, and the engine handles that (dspark/engine/resilience.py)
    in_process: bool = True

    @abstractmethod
    def propose(self, requests: list[DraftRequest]) -> list[DraftProposal]:
        """One proposal per request, in order, each of at most its max_draft_tokens drafts."""

    def add_request(self, request_id: str, token_ids: list[int], params: SamplingParams) -> None:
        self.remove_request(request_id)

    def observe(self, request_id: str, features: torch.Tensor) -> None:
        raise NotImplementedError(f"drafter {self.spec.name!r} takes no hidden states: it implements no observe()")

    def observe_many(self, features: dict[str, torch.Tensor]) -> None:  # request id -> [num_new, m, hidden]
        for request_id, f in features.items():
            self.observe(request_id, f)

    def context_len(self, request_id: str) -> int:
        """Verified positions whose features the drafter holds for the request."""
        raise NotImplementedError(f"drafter {self.spec.name!r} takes no hidden states: it implements no context_len()")

    def remove_request(self, request_id: str) -> None:
        """Free what the drafter holds for the request (nothing, by default)."""

    def remove_requests(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            self.remove_request(request_id)


def checked_spec(drafter: object) -> DrafterSpec:
    """The spec of a drafter handed to the engine or the drafter service. TypeError, naming what
    was got, for anything but a `Drafter` declaring a DrafterSpec: an object that only looks like
    a drafter would have its capabilities ignored without a word."""
    if not isinstance(drafter, Drafter):
        raise TypeError(f"expected a Drafter (dspark.drafters.base: subclass it and declare its DrafterSpec as "
                        f"`spec`), got {type(drafter).__qualname__}")
    spec = drafter.spec
    if not isinstance(spec, DrafterSpec):
        raise TypeError(f"{type(drafter).__qualname__}.spec must be a DrafterSpec, got {type(spec).__qualname__}")
    return spec


class NoDrafter(Drafter):
    """Plain autoregressive decoding: nothing proposed, every round emits one target token."""

    spec = DrafterSpec(name="none")

    def propose(self, requests: list[DraftRequest]) -> list[DraftProposal]:
        return [DraftProposal.empty() for _ in requests]
