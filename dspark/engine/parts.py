"""How the engine reaches its drafter and verifier: `Parts`, and its in-process implementation.

The engine does request lifecycle and runs rounds (dspark/engine/round.py); every call it makes to
a part outside a round (admit, free) and the guard around a round go through `Parts`. Parts in
this process (`InProcessParts`) fail only by bugs, which propagate: nothing to recover, so the
embedded mode never imports the fault handling. A part in another process (its `in_process` is
False) gets `dspark.engine.resilience.ResilientParts`: outages, rebuilds and retries.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from dspark.drafters.base import Drafter
from dspark.engine.faults import Outage
from dspark.engine.requests import RequestState
from dspark.engine.round import RoundResult
from dspark.engine.verifier import Verifier
from dspark.sampling.params import SamplingParams

__all__ = ["InProcessParts", "Parts"]


class Parts(Protocol):
    drafter: Drafter  # what rounds draft with (for remote parts: a wrapper that absorbs failures)
    verifier: Verifier  # what rounds verify with
    drafter_outage: Outage | None  # the drafter failed and has not answered since (always None in process)
    verifier_outage: Outage | None  # the verifier failed and no round has succeeded since (always None in process)

    def admit(self, request_id: str, prompt_ids: list[int], params: SamplingParams, num_kv_tokens: int) -> None:
        """Register a request with the verifier (reserving its KV), then with the drafter."""
        ...

    def free(self, request_ids: list[str]) -> None:
        """Free finished or aborted requests on both parts."""
        ...

    def before_round(self, table: list[RequestState]) -> bool:
        """Get the table ready for a round; False: no round can run now."""
        ...

    def round(self, table: list[RequestState], run: Callable[[], RoundResult]) -> RoundResult | None:
        """Run one round over `table`; None when the verifier lost it (nothing was emitted)."""
        ...

    def stalled_for_s(self, table: list[RequestState]) -> float:
        """Seconds until a round can do anything (> 0 only while every request waits for the verifier)."""
        ...


class InProcessParts:
    """A drafter and verifier in this process: every call goes straight through."""

    drafter_outage = None
    verifier_outage = None

    def __init__(self, verifier: Verifier, drafter: Drafter):
        self.verifier = verifier
        self.drafter = drafter

    def admit(self, request_id: str, prompt_ids: list[int], params: SamplingParams, num_kv_tokens: int) -> None:
        self.verifier.add_request(request_id, prompt_ids, params, num_kv_tokens)
        try:
            self.drafter.add_request(request_id, prompt_ids, params)
        except BaseException:  # half-admitted would hold its KV forever
            self.verifier.remove_request([request_id])
            raise

    def free(self, request_ids: list[str]) -> None:
        try:
            self.verifier.remove_request(request_ids)
        finally:  # a verifier that failed to free must not leave the drafter holding them too
            self.drafter.remove_requests(request_ids)

    def before_round(self, table: list[RequestState]) -> bool:
        return True

    def round(self, table: list[RequestState], run: Callable[[], RoundResult]) -> RoundResult | None:
        return run()

    def stalled_for_s(self, table: list[RequestState]) -> float:
        return 0.0
