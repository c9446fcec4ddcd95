"""The engine's table of running requests: what it keeps per request, and what a step returns.

A table row (`RequestState`) is read and written by the round (dspark/engine/round.py: tokens
emitted, per-request counters), by the engine's lifecycle (dspark/engine/speculative.py: admit,
finish, abort) and, for remote parts only, by the fault handling (dspark/engine/resilience.py:
the rebuild flags).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from opentelemetry.trace import SpanContext

from dspark.sampling.logprobs import TokenLogprobs
from dspark.sampling.params import SamplingParams

__all__ = ["EngineCounters", "GenerationRequest", "RequestState", "StepOutput", "kv_tokens_needed"]


@dataclass(frozen=True)
class GenerationRequest:
    request_id: str
    prompt_ids: list[int]
    max_new_tokens: int
    params: SamplingParams = SamplingParams()  # noqa: RUF009  (frozen: one shared default is safe)
    stop_token_ids: frozenset[int] = frozenset()  # emitting one ends the request (it is kept in the output)
    # Log-probabilities of the emitted tokens with this many alternatives each (0: the token's
    # own only), dspark/sampling/logprobs.py; None: none (and nothing is computed for it)
    logprobs: int | None = None


def kv_tokens_needed(request: GenerationRequest) -> int:
    """KV a request reserves: prompt + output (the last emitted token never enters the cache,
    and drafts are capped so that a round never passes max_new_tokens)."""
    return len(request.prompt_ids) + request.max_new_tokens


@dataclass
class RequestState:
    request: GenerationRequest
    generator: torch.Generator  # the request's draft stream (an in-process drafter samples from it)
    output_ids: list[int] = field(default_factory=list)
    prefilled: bool = False
    rounds: int = 0  # decode rounds (the prefill that samples the first token is not one)
    draft_tokens: int = 0  # tokens proposed by the drafter and verified
    accepted_tokens: int = 0  # of those, accepted
    emitted_in_rounds: int = 0  # tokens emitted by decode rounds (accepted + corrected/bonus)
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    first_token_time: float | None = None
    # Set only by the fault handling of remote parts (dspark/engine/resilience.py); in-process
    # parts never lose a request's state, so these stay False / 0 there.
    needs_rebuild: bool = False  # its state on the verifier is lost or unknown: rebuild it before its next round
    verifier_failures: int = 0  # its rounds the verifier failed (each one is followed by a rebuild, dspark/engine/faults.py)
    span_context: SpanContext | None = None  # the request's trace (dspark/observability/tracing.py), None if untraced

    @property
    def all_token_ids(self) -> list[int]:
        return self.request.prompt_ids + self.output_ids

    @property
    def remaining(self) -> int:
        return self.request.max_new_tokens - len(self.output_ids)

    @property
    def mean_accepted_length(self) -> float:
        """τ: tokens per decode round, accepted drafts + the corrected or bonus token."""
        return self.emitted_in_rounds / self.rounds if self.rounds else 0.0


@dataclass
class StepOutput:
    request_id: str
    new_token_ids: list[int]
    finish_reason: str | None
    logprobs: TokenLogprobs | None = None  # one entry per new token, iff the request asked for logprobs


@dataclass
class EngineCounters:
    """Cumulative counters since the engine started (read by the scheduler service's Stats)."""

    steps: int = 0  # verification rounds run (prefills included)
    rounds_without_drafting: int = 0  # rounds with decoding requests whose drafting the draft gate skipped
    finished: int = 0  # requests that ended with stop or length
    emitted_tokens: int = 0  # tokens appended to outputs
    decode_request_rounds: int = 0  # Σ over requests of their decode rounds
    emitted_in_decode_rounds: int = 0  # tokens those rounds emitted (τ = this / decode_request_rounds)
