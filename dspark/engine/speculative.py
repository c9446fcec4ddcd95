"""The speculative decoding loop over a batch of requests, scheduler side (plain decoding is γ = 0).

The engine holds every running request's tokens and counters and, each round, talks to two
parties: a Drafter (`dspark.drafters.base`) and a Verifier (`dspark.engine.verifier`: the target,
its KV caches and the rejection sampler). Both may live in this process (`SpeculativeEngine(runtime,
drafter)` builds a LocalVerifier) or behind gRPC (`SpeculativeEngine.from_parts(verifier=
RemoteVerifier(...), drafter=RemoteDrafter(...))`); the loop is the same.

Invariant of a round, for every running request:
  before: the target's KV cache holds prompt + output[:-1]; output[-1] is the anchor x_0
          (the last token the target emitted, K/V not computed yet).
  round:  the drafter proposes x_1..x_ℓ from p_d; the verifier runs [x_0, x_1..x_ℓ] in one
          batched forward; its rejection sampler accepts a prefix x_1..x_a and emits one more
          token (the corrected token at the first rejection, else the bonus token).
  after:  KV truncated to prompt + output[:-1] + [x_0, x_1..x_a]; output += [x_1..x_a, new].
Exactness rests on the rejection sampler seeing the very p_d each draft was sampled from, and on
ℓ never depending on the realisation of the token being admitted: a fixed γ, or a policy of
`dspark.scheduling` (Algorithm 1's break; the async variant's two-rounds-old capacity).
A request in its first round is prefilled: its whole prompt goes through the same forward and
the first token is sampled from the last position (ℓ = 0).

Random streams: a request's rejection sampling draws from a generator the verifier seeds with
`params.seed`; its drafts from a separate generator seeded with `draft_stream_seed(seed)` (held
here for an in-process drafter, by the drafter service otherwise). Two streams, never the same
numbers: a draft token and the uniform that decides its acceptance must be independent.

The drafter is read through its contract only (dspark/drafters/base.py): what it declares in
`drafter.spec` (hidden states and which layers, confidences, free proposals), checked once here,
and its lifecycle: `add_request` before a request's first round (and after a rebuild),
`observe_many` with each round's verified hidden states, `remove_requests` when requests leave.
In-process drafters inherit defaults; a remote drafter makes each one RPC. `add_request`
registers a request afresh: a part replaces whatever it still holds under that id (a dead
scheduler's state).

Where things live: the round itself (draft -> schedule -> verify -> emit) is `run_round` in
dspark/engine/round.py, a function over the table of running requests; this class keeps request
lifecycle (validate, admit, finish, abort, free) and calls it once per step. It reaches its parts
through `Parts` (dspark/engine/parts.py). When the drafter or verifier lives in another process
(it declares `in_process = False`), failed calls (`PartFailure`) are recovered from by
dspark/engine/resilience.py: a failed drafter leaves rounds without drafts (plain decoding,
lossless) until it answers again and its requests are registered again; a failed verifier leaves
its requests to be rebuilt (prompt + output so far, prefilled again) when it answers, within the
bounds of `FaultPolicy` (dspark/engine/faults.py); past them the requests fail with RequestsFailed.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from dspark.drafters.base import Drafter, NoDrafter, checked_spec
from dspark.engine.faults import FaultPolicy, Outage
from dspark.engine.parts import InProcessParts, Parts
from dspark.engine.requests import EngineCounters, GenerationRequest, RequestState, StepOutput, kv_tokens_needed
from dspark.engine.round import request_rounds, run_round
from dspark.engine.verifier import LocalVerifier, Verifier
from dspark.model.target_runtime import TargetRuntime
from dspark.observability import tracing
from dspark.observability.round_feed import RoundDetail, RoundFeed
from dspark.observability.rounds import RoundObserver
from dspark.profiling.sps import SPSProfile
from dspark.sampling.logprobs import MAX_LOGPROBS
from dspark.scheduling.draft_gate import DraftGate
from dspark.scheduling.policies import Policy

__all__ = ["EngineCounters", "GenerationRequest", "RequestState", "SpeculativeEngine", "StepOutput", "draft_stream_seed"]

_DRAFT_STREAM_SALT = 0x2545F4914F6CDD1D  # < 2**63, non-zero low 32 bits (the bits torch's CPU generator reads)


def draft_stream_seed(seed: int) -> int:
    """The seed of a request's draft stream, derived from its `params.seed` (the verifier's
    rejection stream uses `seed` itself). XOR with a constant whose low 32 bits are non-zero: the
    two streams always start from different Mersenne-Twister states, and negative seeds stay in
    torch's accepted range."""
    return seed ^ _DRAFT_STREAM_SALT


class SpeculativeEngine:
    def __init__(
        self,
        runtime: TargetRuntime | None,
        drafter: Drafter | None = None,
        *,
        num_speculative_tokens: int = 7,
        sampler_backend: str = "auto",  # "torch" | "triton" | "auto" (Triton kernel when CUDA is present)
        policy: Policy | None = None,  # how many drafts each request verifies; None = all of them (fixed:γ)
        verifier: Verifier | None = None,  # instead of `runtime`: a verifier elsewhere (RemoteVerifier)
        faults: FaultPolicy | None = None,  # how failed remote parts are retried (dspark/engine/faults.py)
    ):
        if num_speculative_tokens < 0:
            raise ValueError(f"num_speculative_tokens must be >= 0, got {num_speculative_tokens}")
        if (runtime is None) == (verifier is None):
            raise ValueError("pass exactly one of runtime (an in-process LocalVerifier is built on it) or verifier=")
        if verifier is None:
            verifier = LocalVerifier(runtime, sampler_backend=sampler_backend)
        elif sampler_backend != "auto":
            raise ValueError(f"sampler_backend={sampler_backend!r} applies to an in-process verifier only; the given verifier chooses its own")
        self.verifier: Verifier = verifier
        self.runtime: TargetRuntime | None = verifier.runtime  # None when the target is remote
        self.drafter: Drafter = drafter if drafter is not None else NoDrafter()
        spec = checked_spec(self.drafter)  # TypeError for anything but a Drafter declaring a DrafterSpec
        self.gamma = num_speculative_tokens if not isinstance(self.drafter, NoDrafter) else 0
        self.drafter_needs_hidden = spec.needs_hidden_states
        self.drafter_has_free_proposals = spec.free_proposals
        if self.drafter_needs_hidden:
            captured = tuple(verifier.capture_layers)
            if spec.capture_layers != captured:
                raise ValueError(
                    f"drafter {spec.name!r} reads target layers {spec.capture_layers}, the verifier captures "
                    f"{captured}; load the target with capture_layers={spec.capture_layers}"
                )
        self.policy = policy
        # skips rounds whose drafting would not pay (policies that declare gates_drafting)
        self.draft_gate: DraftGate | None = DraftGate() if policy is not None and policy.gates_drafting else None
        if policy is not None and policy.needs_confidences and not spec.provides_confidences:
            raise ValueError(f"policy {policy.spec!r} needs calibrated confidences; drafter {spec.name!r} gives none")
        self.running: dict[str, RequestState] = {}  # the request table the rounds run over
        self.counters = EngineCounters()
        self.faults = faults if faults is not None else FaultPolicy()
        self._parts: Parts
        if verifier.in_process and self.drafter.in_process:
            self._parts = InProcessParts(verifier, self.drafter)
        else:  # only a part in another process can fail without a bug: load its fault handling
            from dspark.engine.resilience import ResilientParts

            self._parts = ResilientParts(verifier, self.drafter, self.faults, running=self.running, release=self._release)
        self.round_feed = RoundFeed()  # each round's RoundEvent while someone watches (dspark/observability/round_feed.py)
        self._seed_source = torch.Generator().manual_seed(int(time.time_ns() % 2**63))

    @classmethod
    def from_parts(
        cls, *, verifier: Verifier, drafter: Drafter | None = None, num_speculative_tokens: int = 7, policy: Policy | None = None,
        faults: FaultPolicy | None = None,
    ) -> SpeculativeEngine:
        """The round loop over a given verifier and drafter (e.g. RemoteVerifier + RemoteDrafter)."""
        return cls(None, drafter, num_speculative_tokens=num_speculative_tokens, policy=policy, verifier=verifier, faults=faults)

    # ---- what the verifier fixed at start ------------------------------------------------

    @property
    def vocab_size(self) -> int:
        return self.verifier.vocab_size

    @property
    def max_model_len(self) -> int:
        return self.verifier.max_model_len

    @property
    def sampler_backend(self) -> str | None:
        return self.verifier.sampler_backend

    @property
    def sps_profile(self) -> SPSProfile | None:
        """The verifier's SPS(B) profile, the prefix scheduler's input (measured at server start-up)."""
        return self.verifier.sps_profile

    @sps_profile.setter
    def sps_profile(self, profile: SPSProfile | None) -> None:
        self.verifier.sps_profile = profile

    # ---- requests ------------------------------------------------------------------------

    def validate(self, request: GenerationRequest) -> None:
        """Raise ValueError for a request the engine cannot serve (checked before any state changes)."""
        vocab = self.verifier.vocab_size
        if not request.prompt_ids:
            raise ValueError("the prompt is empty; at least one token is needed")
        if request.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {request.max_new_tokens}")
        bad = [t for t in request.prompt_ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token ids must be in [0, {vocab}), got {bad[:5]}")
        need = self.kv_tokens_needed(request)
        if need > self.verifier.max_model_len:
            raise ValueError(
                f"prompt ({len(request.prompt_ids)} tokens) + max_new_tokens ({request.max_new_tokens}) = {need} "
                f"exceeds the context window of {self.verifier.max_model_len} tokens"
            )
        if request.logprobs is not None and not 0 <= request.logprobs <= MAX_LOGPROBS:
            raise ValueError(f"logprobs must be None or in [0, {MAX_LOGPROBS}] (alternatives per token), got {request.logprobs}")
        if request.request_id in self.running:
            raise ValueError(f"request id {request.request_id!r} is already running")
        if need > self.verifier.kv_budget_tokens:
            raise ValueError(
                f"the request needs {need} KV tokens (prompt {len(request.prompt_ids)} + max_new_tokens "
                f"{request.max_new_tokens}), the whole KV budget is {self.verifier.kv_budget_tokens}"
            )

    kv_tokens_needed = staticmethod(kv_tokens_needed)

    def add_request(self, request: GenerationRequest) -> None:
        """Admit a request; raises KVBudgetExceeded when its KV cannot be reserved now. The span
        current here is the request's: its admission calls and its rounds join that trace."""
        self.validate(request)
        rid = request.request_id
        self._parts.admit(rid, request.prompt_ids, request.params, self.kv_tokens_needed(request))
        seed = request.params.seed
        if seed is None:
            seed = int(torch.randint(0, 2**62, (1,), generator=self._seed_source))
        self.running[rid] = RequestState(request=request, generator=torch.Generator().manual_seed(draft_stream_seed(seed)),
                                         span_context=tracing.current_span_context())

    def abort(self, request_id: str) -> None:
        state = self.running.pop(request_id, None)
        if state is not None:
            state.finish_reason = state.finish_reason or "abort"
            self._release([request_id])

    def _release(self, request_ids: list[str]) -> None:
        """Free finished or aborted requests everywhere: one verifier call (and one drafter call
        when the drafter takes a batch) for all of them. The policy forgets them even if a part
        failed to free them (that failure is raised: AsyncEngine._safe_abort retries the verifier)."""
        try:
            self._parts.free(request_ids)
        finally:
            if self.policy is not None:
                for rid in request_ids:
                    self.policy.remove_request(rid)

    @property
    def has_unfinished(self) -> bool:
        return bool(self.running)

    # ---- one round -----------------------------------------------------------------------

    @torch.inference_mode()
    def step(self) -> list[StepOutput]:
        """One round for every running request. For remote parts, a PartFailure of the drafter or
        verifier is recovered from (dspark/engine/resilience.py), and a round that lost the verifier
        returns no output; requests that cannot be recovered are released and named by
        RequestsFailed. If it raises anything else, the round's requests are in an unknown state on
        the verifier: abort them, as AsyncEngine does."""
        table = list(self.running.values())
        if not table:
            return []
        if not self._parts.before_round(table):  # raises RequestsFailed for requests it gives up on
            return []
        with RoundObserver(self.counters.steps, [s.span_context for s in table], feed=self.round_feed) as observed:
            result = self._parts.round(table, lambda: run_round(
                table, drafter=self._parts.drafter, verifier=self._parts.verifier, policy=self.policy, gamma=self.gamma,
                counters=self.counters, draft_gate=self.draft_gate, phase=observed.phase, trace_schedule=observed.watched))
            if result is None:  # the verifier lost the round: nothing was emitted, its requests are rebuilt
                return []
            finished = result.finished
            for rid in finished:
                del self.running[rid]
            self.counters.finished += len(finished)
            if finished:
                self._release(finished)
            detail = None
            if observed.watched:  # the round feed's view, built only while someone watches
                detail = lambda: RoundDetail(  # called by the observer, which logs any failure
                    requests=self._request_rounds(result), schedule=result.schedule_trace, sps_profile=self.sps_profile,
                    running=len(self.running), drafting=result.drafting,
                    policy=self.policy.spec if self.policy is not None else None)
            observed.finish(num_draft_tokens=result.num_draft_tokens, num_accepted=result.num_decode_accepted,
                            num_emitted=result.num_emitted, prefill_tokens=result.prefill_tokens,
                            generated_tokens=sum(len(o.new_token_ids) for o in result.outputs), detail=detail)
            return result.outputs

    _request_rounds = staticmethod(request_rounds)  # the round feed's per-request view, built only while watched

    # ---- faults (remote parts only: dspark/engine/resilience.py) ----------------------------

    @property
    def drafter_outage(self) -> Outage | None:
        """The drafter failed and has not answered since (always None for an in-process drafter)."""
        return self._parts.drafter_outage

    @property
    def verifier_outage(self) -> Outage | None:
        """The verifier failed and no round has succeeded since (always None in process)."""
        return self._parts.verifier_outage

    def stalled_for_s(self) -> float:
        """Seconds until a step can do anything: > 0 only while every running request waits for
        the verifier to answer again (a caller may sleep that long, or until a new command)."""
        return self._parts.stalled_for_s(list(self.running.values()))

    # ---- convenience ---------------------------------------------------------------------

    def generate(self, requests: list[GenerationRequest],
                 on_output: Callable[[StepOutput], None] | None = None) -> list[RequestState]:
        """Run requests to completion (all admitted at once) and return their final states;
        `on_output` sees every round's outputs (what a state does not keep: logprobs)."""
        states = []
        for r in requests:
            self.add_request(r)
            states.append(self.running[r.request_id])
        while self.has_unfinished:
            for out in self.step():
                if on_output is not None:
                    on_output(out)
            if (stalled := self.stalled_for_s()) > 0:  # only while every request waits for the verifier
                time.sleep(stalled)
        return states
