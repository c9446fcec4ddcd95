"""What the scheduler-side engine does when its drafter or verifier fails (they may live in other processes).

A call across a process boundary can fail for reasons that are not the request's: the process
crashed or is restarting, a deadline passed, a reply was broken, the part lost a request's state.
Such failures are `PartFailure`s (services.grpc_common.ServiceError is one); everything else (a
ValueError for a bad request, a bug) is not recovered from. The engine's answers
(dspark/engine/speculative.py, `FaultPolicy` for the knobs):

- Drafter: the round drafts nothing for the requests it could not serve (plain decoding, which
  is lossless), and the drafter is tried again every `retry_interval_s`. When it answers, every
  running request is registered with it again from its tokens so far; a drafter that reads target
  hidden states gets them from a rebuild on the verifier (below), so nothing it held is needed.
- Verifier: after a failed round the requests' state on it is unknown (gone with a crashed
  process, or advanced by a round that finished after its deadline). Each request is rebuilt:
  freed and added again with prompt + output so far as its prompt, then prefilled; that prefill
  samples the next token. By the chain rule this continuation is distributed exactly as the rest
  of the original generation (greedy: the same tokens), as a re-claimed bus request is
  (dspark/bus/worker.py). Requests wait for the verifier for at most `verifier_timeout_s` and are
  rebuilt at most `max_rebuilds` times each (a request that crashes the verifier must not crash it
  forever); past that they fail with `RequestsFailed`, whose message says why.

Seeded requests continue with `continuation_seed(seed, emitted)`: deterministic, and not a replay
of the random numbers the earlier tokens consumed (which would correlate them with what follows).
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass, replace

from dspark.sampling.params import SamplingParams

__all__ = [
    "SEED_MODULUS", "FaultPolicy", "Outage", "PartFailure", "RequestsFailed", "continuation_params", "continuation_seed",
]

SEED_MODULUS = 2**63  # what torch.Generator.manual_seed accepts, non-negative


class PartFailure(RuntimeError):
    """A drafter or verifier in another process failed a call for a reason that is not the request's."""


class RequestsFailed(RuntimeError):
    """These requests cannot go on (the message says why); the engine has already released them.
    The other running requests are unaffected."""

    def __init__(self, request_ids: list[str], message: str):
        super().__init__(message)
        self.request_ids = list(request_ids)


@dataclass(frozen=True)
class FaultPolicy:
    retry_interval_s: float = 1.0  # how often a failed drafter or verifier is tried again
    verifier_timeout_s: float = 60.0  # how long requests wait for their verifier to answer again
    max_rebuilds: int = 3  # rebuilds of one request on the verifier before it fails

    def __post_init__(self) -> None:
        if not (self.retry_interval_s > 0 and self.verifier_timeout_s > 0):
            raise ValueError(f"retry_interval_s and verifier_timeout_s must be > 0, "
                             f"got {self.retry_interval_s}, {self.verifier_timeout_s}")
        if self.max_rebuilds < 0:
            raise ValueError(f"max_rebuilds must be >= 0, got {self.max_rebuilds}")


@dataclass
class Outage:
    """A part that failed and has not answered since: when it first failed, why, when to try again."""

    since: float  # time.monotonic() of the first failure
    error: str  # the latest failure
    retry_at: float

    @classmethod
    def begin(cls, error: BaseException, *, retry_at: float) -> Outage:
        return cls(since=time.monotonic(), error=str(error), retry_at=retry_at)

    def failed_again(self, error: BaseException, *, retry_interval_s: float) -> None:
        self.error = str(error)
        self.retry_at = time.monotonic() + retry_interval_s

    @property
    def seconds(self) -> float:
        return time.monotonic() - self.since


def continuation_seed(seed: int, offset: int) -> int:
    """The seed of a seeded request continued after `offset` emitted tokens (offset 0: the seed)."""
    if offset == 0:
        return seed
    digest = hashlib.blake2b(f"dspark-continuation:{seed}:{offset}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") % SEED_MODULUS


def continuation_params(params: SamplingParams, offset: int) -> SamplingParams:
    """`params` for the continuation of a request after `offset` emitted tokens."""
    if params.seed is None or offset == 0:
        return params
    return replace(params, seed=continuation_seed(params.seed, offset))
