"""Fault handling for a drafter or verifier in another process: outages, rebuilds, retries.

The engine picks `ResilientParts` (dspark/engine/parts.py's `Parts`) when a part declares
`in_process = False` (services/drafter/client.py, services/verifier/client.py); in-process parts
never load this module. What is done on each failure (`PartFailure`) and why is in
dspark/engine/faults.py; here is how:

- `ResilientDrafter` wraps the drafter the round drafts with. A failed call starts an outage and
  marks every request it holds as lost; lost requests get empty proposals (plain decoding,
  lossless) and no features. Once `retry_interval_s` has passed, `ResilientParts.before_round`
  registers them again from their tokens so far (a drafter that reads hidden states has them
  rebuilt on the verifier instead, whose prefill hands it every position).
- `ResilientVerifier` wraps the verifier the round verifies with: a failed verify becomes
  `RoundLost`, raised before the round emits anything, so no token is lost or duplicated. The
  round's requests are then marked `needs_rebuild` and rebuilt (prompt + output so far,
  prefilled again) before the next round, within `FaultPolicy`'s bounds; past them they fail
  with RequestsFailed.
- Frees that fail are kept and tried again once the part answers.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch

from dspark.drafters.base import Drafter, DrafterSpec, DraftProposal, DraftRequest
from dspark.engine.faults import FaultPolicy, Outage, PartFailure, RequestsFailed, continuation_params
from dspark.engine.requests import RequestState, kv_tokens_needed
from dspark.engine.round import RoundResult
from dspark.engine.verifier import Verifier, VerifyBatch, VerifyResult
from dspark.model.kv_cache import KVBudgetExceeded
from dspark.profiling.sps import SPSProfile
from dspark.sampling.params import SamplingParams

__all__ = ["ResilientDrafter", "ResilientParts", "ResilientVerifier", "RoundLost"]

log = logging.getLogger(__name__)


class RoundLost(Exception):
    """The verifier failed a round: the state of the round's requests on it is unknown."""

    def __init__(self, failure: PartFailure):
        super().__init__(str(failure))
        self.failure = failure


class ResilientDrafter(Drafter):
    """A drafter whose failures cost drafts, never the round."""

    in_process = False

    def __init__(self, inner: Drafter, faults: FaultPolicy):
        self.inner = inner
        self.faults = faults
        self.outage: Outage | None = None  # it failed and has not answered since
        self.unfreed: set[str] = set()  # ids a failed (or skipped) remove could not free
        self._known: set[str] = set()  # ids registered with it (or tried), not removed since
        self._lost: set[str] = set()  # of those, the ones it does not hold as of their tokens

    @property
    def spec(self) -> DrafterSpec:
        return self.inner.spec

    def is_lost(self, request_id: str) -> bool:
        return request_id in self._lost

    def mark_held(self, request_id: str) -> None:
        self._lost.discard(request_id)

    def failed(self, error: PartFailure) -> None:
        if self.outage is None:
            log.warning("the drafter failed (%s); decoding without drafts until it answers", error)
            self.outage = Outage.begin(error, retry_at=time.monotonic() + self.faults.retry_interval_s)
        else:
            self.outage.failed_again(error, retry_interval_s=self.faults.retry_interval_s)
        self._lost |= self._known  # what it held may be gone with it

    # ---- the Drafter contract ------------------------------------------------------------

    def add_request(self, request_id: str, token_ids: list[int], params: SamplingParams) -> None:
        if self.outage is not None:  # registered again when it answers (ResilientParts.before_round)
            self._known.add(request_id)
            self._lost.add(request_id)
            return
        try:
            self.inner.add_request(request_id, token_ids, params)
        except PartFailure as e:
            self._known.add(request_id)
            self.failed(e)  # marks it lost, with every other request it held
            return
        self._known.add(request_id)
        self._lost.discard(request_id)

    def propose(self, requests: list[DraftRequest]) -> list[DraftProposal]:
        held = [r for r in requests if r.request_id not in self._lost]
        if not held:
            return [DraftProposal.empty() for _ in requests]
        try:
            proposals = self.inner.propose(held)
        except PartFailure as e:
            self.failed(e)
            return [DraftProposal.empty() for _ in requests]
        if len(proposals) != len(held):
            raise RuntimeError(f"drafter {self.spec.name!r} returned {len(proposals)} proposals for {len(held)} requests")
        by_id = {r.request_id: p for r, p in zip(held, proposals)}
        return [by_id[r.request_id] if r.request_id in by_id else DraftProposal.empty() for r in requests]

    def observe_many(self, features: dict[str, torch.Tensor]) -> None:  # request id -> [n_new, num_capture_layers, hidden]
        # A request it does not hold gets its features again when it is registered again.
        held = {rid: f for rid, f in features.items() if rid not in self._lost}
        if not held:
            return
        try:
            self.inner.observe_many(held)
        except PartFailure as e:
            self.failed(e)

    def observe(self, request_id: str, features: torch.Tensor) -> None:  # [n_new, num_capture_layers, hidden]
        self.observe_many({request_id: features})

    def context_len(self, request_id: str) -> int:
        return self.inner.context_len(request_id)

    def remove_request(self, request_id: str) -> None:
        self.remove_requests([request_id])

    def remove_requests(self, request_ids: list[str]) -> None:
        self._known.difference_update(request_ids)
        self._lost.difference_update(request_ids)
        if self.outage is not None:
            self.unfreed.update(request_ids)
            return
        try:
            self.inner.remove_requests(request_ids)
        except PartFailure as e:
            self.failed(e)
            self.unfreed.update(request_ids)


class ResilientVerifier(Verifier):
    """The verifier rounds verify with: a failed verify is a `RoundLost`. Everything else is the
    wrapped verifier's (ResilientParts handles failures of the other calls itself)."""

    in_process = False
    runtime = None

    def __init__(self, inner: Verifier):
        self.inner = inner
        self.outage: Outage | None = None  # it failed and no round has succeeded since
        self.vocab_size = inner.vocab_size
        self.max_model_len = inner.max_model_len
        self.capture_layers = tuple(inner.capture_layers)
        self.hidden_size = inner.hidden_size
        self.kv_budget_tokens = inner.kv_budget_tokens

    @property
    def sampler_backend(self) -> str:
        return self.inner.sampler_backend

    @property
    def sps_profile(self) -> SPSProfile | None:
        # A remote verifier fetches its profile on first use, inside a round (the draft gate, the
        # policy): a failed fetch loses the round as a failed verify does, before anything is emitted.
        try:
            return self.inner.sps_profile
        except PartFailure as e:
            raise RoundLost(e) from e

    @sps_profile.setter
    def sps_profile(self, profile: SPSProfile | None) -> None:
        self.inner.sps_profile = profile

    @property
    def free_kv_tokens(self) -> int:
        return self.inner.free_kv_tokens

    def add_request(self, request_id: str, prompt_ids: list[int], params: SamplingParams, num_kv_tokens: int) -> None:
        self.inner.add_request(request_id, prompt_ids, params, num_kv_tokens)

    def remove_request(self, request_ids: list[str]) -> int:
        return self.inner.remove_request(request_ids)

    def verify(self, batch: VerifyBatch) -> VerifyResult:
        try:
            result = self.inner.verify(batch)
        except PartFailure as e:
            raise RoundLost(e) from e
        self.outage = None
        return result


class ResilientParts:
    """`Parts` (dspark/engine/parts.py) for a drafter or verifier in another process."""

    def __init__(self, verifier: Verifier, drafter: Drafter, faults: FaultPolicy, *, running: dict[str, RequestState],
                 release: Callable[[list[str]], None]):
        self.faults = faults
        self.verifier = ResilientVerifier(verifier)
        self.drafter = ResilientDrafter(drafter, faults)
        self._running = running  # the engine's table: requests that cannot go on leave it
        self._release = release  # the engine's release (frees on both parts, forgets policy state)
        self._unfreed_on_verifier: set[str] = set()

    @property
    def drafter_outage(self) -> Outage | None:
        return self.drafter.outage

    @property
    def verifier_outage(self) -> Outage | None:
        return self.verifier.outage

    # ---- admit and free ------------------------------------------------------------------

    def admit(self, request_id: str, prompt_ids: list[int], params: SamplingParams, num_kv_tokens: int) -> None:
        self._unfreed_on_verifier.discard(request_id)  # adding replaces what a part still holds under this id
        self.drafter.unfreed.discard(request_id)
        try:
            self.verifier.inner.add_request(request_id, prompt_ids, params, num_kv_tokens)
        except PartFailure as e:
            self._verifier_failed(e)  # AsyncEngine keeps the request waiting, up to faults.verifier_timeout_s
            raise
        self.verifier.outage = None  # it answers again (requests it lost are still marked for a rebuild)
        try:
            self.drafter.add_request(request_id, prompt_ids, params)  # a failure leaves it undrafted, not failed
        except BaseException:
            self._free_on_verifier([request_id])
            raise

    def free(self, request_ids: list[str]) -> None:
        self._free_on_verifier(request_ids)
        self.drafter.remove_requests(request_ids)

    def _free_on_verifier(self, request_ids: list[str]) -> None:
        try:
            self.verifier.inner.remove_request(request_ids)
        except PartFailure as e:  # its KV stays reserved there until a later retry (or the verifier restarts)
            log.warning("freeing %d requests on the verifier failed (%s); trying again later", len(request_ids), e)
            self._unfreed_on_verifier.update(request_ids)

    def _retry_frees(self) -> None:
        """Free what failed calls could not, once the part answers again."""
        if self._unfreed_on_verifier and self.verifier.outage is None:
            ids = sorted(self._unfreed_on_verifier)
            self._unfreed_on_verifier.clear()
            self._free_on_verifier(ids)
        if self.drafter.unfreed and self.drafter.outage is None:
            ids = sorted(self.drafter.unfreed)
            self.drafter.unfreed.clear()
            self.drafter.remove_requests(ids)

    # ---- around a round ------------------------------------------------------------------

    def before_round(self, table: list[RequestState]) -> bool:
        self._retry_frees()
        self._recover_drafter(table)
        return self._recover_verifier(table)  # raises RequestsFailed for requests it gives up on

    def round(self, table: list[RequestState], run: Callable[[], RoundResult]) -> RoundResult | None:
        try:
            return run()
        except RoundLost as lost:  # the requests' state on the verifier is now unknown
            self._verifier_failed(lost.failure, table)
            return None

    def stalled_for_s(self, table: list[RequestState]) -> float:
        outage = self.verifier.outage
        if outage is None or not table or not all(s.needs_rebuild for s in table):
            return 0.0
        return max(0.0, outage.retry_at - time.monotonic())

    # ---- recovery ------------------------------------------------------------------------

    def _verifier_failed(self, error: PartFailure, states: list[RequestState] = ()) -> None:
        """Record a verifier failure; `states` (a failed round's requests) are to be rebuilt."""
        if self.verifier.outage is None:
            log.warning("the verifier failed (%s); its %d requests are rebuilt when it answers", error, len(states))
            self.verifier.outage = Outage.begin(error, retry_at=time.monotonic())  # a restarted verifier answers at once
        else:
            self.verifier.outage.failed_again(error, retry_interval_s=self.faults.retry_interval_s)
        for s in states:
            s.needs_rebuild = True
            s.verifier_failures += 1

    def _recover_drafter(self, table: list[RequestState]) -> None:
        """Once the retry time has come, register the requests a failed drafter lost again. A
        drafter that reads hidden states needs every position's features: those requests are
        rebuilt on the verifier, whose prefill returns them."""
        outage = self.drafter.outage
        if outage is None or time.monotonic() < outage.retry_at:
            return
        lost = [s for s in table if self.drafter.is_lost(s.request.request_id) and not s.needs_rebuild]
        try:
            for s in lost:
                params = continuation_params(s.request.params, len(s.output_ids))
                self.drafter.inner.add_request(s.request.request_id, s.all_token_ids, params)
                if self.drafter.spec.needs_hidden_states:
                    s.needs_rebuild = True
                else:
                    self.drafter.mark_held(s.request.request_id)
        except PartFailure as e:
            self.drafter.failed(e)
            return
        log.info("the drafter answers again after %.1f s: %d requests registered again", outage.seconds, len(lost))
        self.drafter.outage = None

    def _recover_verifier(self, table: list[RequestState]) -> bool:
        """Rebuild the requests whose verifier state was lost; True when every running request can
        take part in a round now. Requests past the fault policy's bounds fail (RequestsFailed)."""
        lost = [s for s in table if s.needs_rebuild]
        if not lost:
            return True
        outage, policy = self.verifier.outage, self.faults
        last_error = outage.error if outage is not None else "unknown"
        if outage is not None and outage.seconds > policy.verifier_timeout_s:
            self._fail(lost, f"the verifier has not answered for {outage.seconds:.0f} s "
                             f"(limit {policy.verifier_timeout_s:.0f} s); last error: {last_error}")
        worn = [s for s in lost if s.verifier_failures > policy.max_rebuilds]
        if worn:  # e.g. a request that crashes the verifier: it must not crash it forever
            self._fail(worn, f"the verifier failed {worn[0].verifier_failures} rounds of the request (at most "
                             f"{policy.max_rebuilds} are rebuilt); last error: {last_error}")
        if outage is not None and time.monotonic() < outage.retry_at:
            return False
        for s in lost:
            try:
                self._rebuild(s)
            except PartFailure as e:
                self._verifier_failed(e)
                return False
            except (KVBudgetExceeded, ValueError) as e:  # e.g. a verifier restarted with a smaller budget
                self._fail([s], f"the request could not be rebuilt on the verifier: {e}")
        return True

    def _rebuild(self, s: RequestState) -> None:
        """Free the request on the verifier and add it again with prompt + output so far as its
        prompt: its next round is a prefill that samples the next token (a continuation, exact by
        the chain rule). The drafter starts over from the same tokens; the prefill's hidden states
        are its context features."""
        rid = s.request.request_id
        tokens = s.all_token_ids
        params = continuation_params(s.request.params, len(s.output_ids))
        self.verifier.inner.remove_request([rid])
        self.verifier.inner.add_request(rid, tokens, params, kv_tokens_needed(s.request))
        s.needs_rebuild, s.prefilled = False, False
        log.info("request %r rebuilt on the verifier from %d tokens", rid, len(tokens))
        # registered afresh: an in-process drafter drops the context features the prefill hands over again
        self.drafter.add_request(rid, tokens, params)

    def _fail(self, states: list[RequestState], message: str) -> None:
        """Release requests that cannot go on and raise RequestsFailed for them."""
        ids = [s.request.request_id for s in states]
        for s in states:
            s.finish_reason = "abort"
            self._running.pop(s.request.request_id, None)
        log.error("failing %d requests %s: %s", len(ids), ids[:4], message)
        self._release(ids)
        raise RequestsFailed(ids, message)
