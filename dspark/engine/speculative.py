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

Faults (dspark/engine/faults.py): when the drafter or verifier lives in another process, a failed
call (`PartFailure`) is recovered from here: a failed drafter leaves rounds without drafts (plain
decoding, lossless) until it answers again and its requests are registered again; a failed
verifier leaves its requests to be rebuilt (prompt + output so far, prefilled again) when it
answers, within the bounds of `FaultPolicy`; past them the requests fail with RequestsFailed.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import numpy as np
import torch
from opentelemetry.trace import SpanContext

from dspark.drafters.base import Drafter, DraftProposal, DraftRequest, NoDrafter, checked_spec
from dspark.engine.faults import FaultPolicy, Outage, PartFailure, RequestsFailed, continuation_params
from dspark.engine.verifier import PREFILL_ANCHOR, LocalVerifier, Verifier, VerifyBatch
from dspark.model.kv_cache import KVBudgetExceeded
from dspark.model.target_runtime import TargetRuntime
from dspark.observability import tracing
from dspark.observability.round_feed import RequestRound, RoundDetail, RoundFeed
from dspark.observability.rounds import RoundObserver
from dspark.profiling.sps import SPSProfile
from dspark.sampling import DraftProbs
from dspark.sampling.logprobs import MAX_LOGPROBS, NOT_ASKED, TokenLogprobs
from dspark.sampling.params import SamplingParams
from dspark.scheduling.draft_gate import DraftGate
from dspark.scheduling.policies import Policy

log = logging.getLogger(__name__)

_DRAFT_STREAM_SALT = 0x2545F4914F6CDD1D  # < 2**63, non-zero low 32 bits (the bits torch's CPU generator reads)


def draft_stream_seed(seed: int) -> int:
    """The seed of a request's draft stream, derived from its `params.seed` (the verifier's
    rejection stream uses `seed` itself). XOR with a constant whose low 32 bits are non-zero: the
    two streams always start from different Mersenne-Twister states, and negative seeds stay in
    torch's accepted range."""
    return seed ^ _DRAFT_STREAM_SALT


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
    drafter_synced: bool = True  # the drafter holds this request as of its tokens (False after a drafter failure)
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
        self.runtime: TargetRuntime | None = getattr(verifier, "runtime", None)  # None when the target is remote
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
        self.running: dict[str, RequestState] = {}
        self.counters = EngineCounters()
        self.faults = faults if faults is not None else FaultPolicy()
        self.drafter_outage: Outage | None = None  # the drafter failed and has not answered since
        self.verifier_outage: Outage | None = None  # the verifier failed and no round has succeeded since
        self._unfreed: dict[str, set[str]] = {"verifier": set(), "drafter": set()}  # ids a failed call could not free
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
        return getattr(self.verifier, "sampler_backend", None)

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

    @staticmethod
    def kv_tokens_needed(request: GenerationRequest) -> int:
        """KV a request reserves: prompt + output (the last emitted token never enters the cache,
        and drafts are capped so that a round never passes max_new_tokens)."""
        return len(request.prompt_ids) + request.max_new_tokens

    def add_request(self, request: GenerationRequest) -> None:
        """Admit a request; raises KVBudgetExceeded when its KV cannot be reserved now. The span
        current here is the request's: its admission calls and its rounds join that trace."""
        self.validate(request)
        rid = request.request_id
        for unfreed in self._unfreed.values():
            unfreed.discard(rid)  # adding replaces what a part still holds under this id
        try:
            self.verifier.add_request(rid, request.prompt_ids, request.params, self.kv_tokens_needed(request))
        except PartFailure as e:
            self._verifier_failed(e)  # AsyncEngine keeps the request waiting, up to faults.verifier_timeout_s
            raise
        self.verifier_outage = None  # it answers again (requests it lost are still marked for a rebuild)
        try:
            synced = self._register_with_drafter(rid, request.prompt_ids, request.params)
        except BaseException:
            self._free_on_verifier([rid])
            raise
        seed = request.params.seed
        if seed is None:
            seed = int(torch.randint(0, 2**62, (1,), generator=self._seed_source))
        self.running[rid] = RequestState(request=request, generator=torch.Generator().manual_seed(draft_stream_seed(seed)),
                                         drafter_synced=synced, span_context=tracing.current_span_context())

    def abort(self, request_id: str) -> None:
        state = self.running.pop(request_id, None)
        if state is not None:
            state.finish_reason = state.finish_reason or "abort"
            self._release([request_id])

    def _release(self, request_ids: list[str]) -> None:
        """Free finished or aborted requests everywhere: one verifier call (and one drafter call
        when the drafter takes a batch) for all of them."""
        self._free_on_verifier(request_ids)
        self._free_on_drafter(request_ids)
        if self.policy is not None:
            for rid in request_ids:
                self.policy.remove_request(rid)

    @property
    def has_unfinished(self) -> bool:
        return bool(self.running)

    # ---- one round -----------------------------------------------------------------------

    @torch.inference_mode()
    def step(self) -> list[StepOutput]:
        """One round for every running request. A PartFailure of the drafter or verifier is recovered
        from (module docstring), and a round that lost the verifier returns no output; requests that
        cannot be recovered are released and named by RequestsFailed. If it raises anything else, the
        round's requests are in an unknown state on the verifier: abort them, as AsyncEngine does."""
        states = list(self.running.values())
        if not states:
            return []
        self._retry_frees()
        self._recover_drafter(states)
        if not self._recover_verifier(states):  # raises RequestsFailed for requests it gives up on
            return []
        with RoundObserver(self.counters.steps, [s.span_context for s in states], feed=self.round_feed) as observed:
            return self._round(states, observed)

    def _round(self, states: list[RequestState], observed: RoundObserver) -> list[StepOutput]:
        decoding = [s for s in states if s.prefilled]
        with observed.phase("draft"):
            drafting = self._gate_allows_drafting(decoding, states)
            self.counters.rounds_without_drafting += int(not drafting)
            t_draft = time.perf_counter()
            if drafting:
                proposals = self._propose(decoding)
            elif self.drafter_has_free_proposals:  # the gate skips the model, not a free lookup
                proposals = self._propose(decoding, free_only=True)
            else:
                proposals = [DraftProposal.empty() for _ in decoding]
            t_draft = time.perf_counter() - t_draft
        # the requests the model drafted for (not a free lookup): what the draft gate learns from
        model_drafted = [s for s, p in zip(decoding, proposals) if len(p) and not p.free] if drafting else []
        drafted, trace = proposals, None  # before the policy cuts them, and its trace: for the round feed
        with observed.phase("schedule"):
            if self.policy is not None and decoding:
                prefilling = [s for s in states if not s.prefilled]
                lengths = self._draft_lengths(decoding, proposals, prefilling)
                proposals = [p.truncated(int(n)) for p, n in zip(proposals, lengths)]
                trace = self.policy.last_trace if observed.watched else None
        draft_of = {s.request.request_id: p for s, p in zip(decoding, proposals)}

        with observed.phase("verify"):
            try:
                verified = self.verifier.verify(self._verify_batch(states, draft_of))
            except PartFailure as e:  # the requests' state on the verifier is now unknown
                self._verifier_failed(e, states)
                return []
        self.verifier_outage = None
        num_accepted = verified.result.num_accepted.tolist()
        tokens = verified.result.output_token_ids.tolist()
        round_logprobs = verified.logprobs
        if round_logprobs is None and any(s.request.logprobs is not None for s in states):
            raise RuntimeError("requests of the round asked for logprobs; the verifier returned none")
        self.counters.steps += 1
        if self.draft_gate is not None and model_drafted:
            accepted_of = {s.request.request_id: a for s, a in zip(states, num_accepted)}
            ids = [s.request.request_id for s in model_drafted]
            self.draft_gate.record(num_requests=len(ids), draft_seconds=t_draft,
                                   verified=sum(len(draft_of[rid]) for rid in ids), accepted=sum(accepted_of[rid] for rid in ids))
        if self.drafter_needs_hidden:  # positions now verified: the whole prompt, or x_0..x_a
            self._hand_over_features(states, verified.hidden_states, verified.num_hidden_positions)

        outputs, finished = [], []
        round_drafts, round_accepted, round_emitted, prefill_tokens = [], [], [], 0  # per decoding request, for the metrics
        now = time.perf_counter()
        for i, s in enumerate(states):
            a = num_accepted[i]
            emitted = tokens[i][: a + 1]
            if s.prefilled:
                num_drafts = len(draft_of[s.request.request_id])
                round_drafts.append(num_drafts)
                round_accepted.append(a)
                round_emitted.append(len(emitted))
                s.rounds += 1
                s.draft_tokens += num_drafts
                s.accepted_tokens += a
                s.emitted_in_rounds += len(emitted)
                self.counters.decode_request_rounds += 1
                self.counters.emitted_in_decode_rounds += len(emitted)
            else:
                s.prefilled = True
                if s.first_token_time is None:  # not a rebuild's prefill
                    s.first_token_time = now
                prefill_tokens += len(s.request.prompt_ids)
            logprobs = None
            if s.request.logprobs is not None:
                logprobs = round_logprobs.for_request(i, len(emitted), s.request.logprobs)
            out = self._append(s, emitted, logprobs)
            if out.finish_reason is not None:
                finished.append(out.request_id)
            outputs.append(out)
        if finished:
            self._release(finished)
        detail = None
        if observed.watched:  # the round feed's view, built only while someone watches
            detail = lambda: RoundDetail(  # called by the observer, which logs any failure
                requests=self._request_rounds(decoding, drafted, draft_of, num_accepted, outputs), schedule=trace,
                sps_profile=self.sps_profile, running=len(self.running), drafting=drafting,
                policy=self.policy.spec if self.policy is not None else None)
        observed.finish(num_draft_tokens=round_drafts, num_accepted=round_accepted, num_emitted=round_emitted,
                        prefill_tokens=prefill_tokens, generated_tokens=sum(len(o.new_token_ids) for o in outputs),
                        detail=detail)
        return outputs

    @staticmethod
    def _request_rounds(decoding: list[RequestState], drafted: list[DraftProposal], draft_of: dict[str, DraftProposal],
                        num_accepted: list[int], outputs: list[StepOutput]) -> list[RequestRound]:
        """Each request's part of the round for the round feed (outputs and num_accepted in batch order)."""
        proposed = {s.request.request_id: p for s, p in zip(decoding, drafted)}
        rounds = []
        for out, a in zip(outputs, num_accepted):
            p = proposed.get(out.request_id)  # None: prefilled this round
            rounds.append(RequestRound(
                request_id=out.request_id, prefill=p is None, drafted=p.token_ids.tolist() if p is not None else [],
                confidences=p.confidences.tolist() if p is not None and p.confidences is not None else [],
                admitted=len(draft_of[out.request_id]) if p is not None else 0, accepted=a if p is not None else 0,
                emitted=list(out.new_token_ids), finish_reason=out.finish_reason))
        return rounds

    def _gate_allows_drafting(self, decoding: list[RequestState], states: list[RequestState]) -> bool:
        """The draft gate's decision for this round, from earlier rounds only (draft_gate.py)."""
        if self.draft_gate is None or not decoding or self.sps_profile is None:
            return True
        prefill_tokens = sum(len(s.all_token_ids) for s in states if not s.prefilled)
        table = self.sps_profile.table(upto=prefill_tokens + len(decoding) * (1 + max(self.gamma, 1)))
        return self.draft_gate.should_draft(num_requests=len(decoding), sps_table=table, prefill_tokens=prefill_tokens)

    def _propose(self, decoding: list[RequestState], *, free_only: bool = False) -> list[DraftProposal]:
        """Drafts for the requests the drafter holds; none for the others, or for all of them when
        the drafter fails (plain decoding for this round)."""
        no_drafts = [DraftProposal.empty() for _ in decoding]
        drafting = [s for s in decoding if s.drafter_synced]
        if not drafting or self.gamma == 0:
            return no_drafts
        cap = self.gamma if self.policy is None or self.policy.max_drafts is None else self.policy.max_drafts
        reqs = [
            DraftRequest(
                request_id=s.request.request_id,
                token_ids=s.all_token_ids,
                num_prompt_tokens=len(s.request.prompt_ids),
                params=s.request.params,
                # at most remaining-1 drafts: a round emits ℓ+1 tokens and must not pass max_new_tokens
                max_draft_tokens=max(0, min(self.gamma, s.remaining - 1, cap)),
                generator=s.generator,
                free_only=free_only,
            )
            for s in drafting
        ]
        try:
            proposals = self.drafter.propose(reqs)
        except PartFailure as e:
            self._drafter_failed(e)
            return no_drafts
        if len(proposals) != len(reqs):
            raise RuntimeError(f"drafter {self.drafter.spec.name!r} returned {len(proposals)} proposals for {len(reqs)} requests")
        for req, p in zip(reqs, proposals):
            if len(p) > req.max_draft_tokens:
                raise RuntimeError(f"drafter {self.drafter.spec.name!r} proposed {len(p)} > {req.max_draft_tokens} tokens")
        by_id = {req.request_id: p for req, p in zip(reqs, proposals)}
        return [by_id.get(s.request.request_id, no_drafts[0]) for s in decoding]

    def _draft_lengths(self, decoding: list[RequestState], proposals: list[DraftProposal],
                       prefilling: list[RequestState]) -> np.ndarray:
        """ℓ_r per request from the policy (Algorithm 1 for `dspark`), which sees only the
        drafts' calibrated confidences and the SPS profile, never the tokens. The prefills of
        this round ride in the same forward: their tokens count in B, their first tokens in τ*."""
        num = np.array([len(p) for p in proposals], dtype=np.int64)  # [R]
        width = max(int(num.max(initial=0)), 1)
        confidences = np.zeros((len(proposals), width))  # [R, γ], 0 where no draft
        for r, p in enumerate(proposals):
            if len(p) and p.confidences is not None:
                confidences[r, : len(p)] = p.confidences.double().numpy()
            elif len(p) and self.policy.needs_confidences:
                raise RuntimeError(f"policy {self.policy.spec!r} needs confidences; drafter {self.drafter.spec.name!r} gives none")
        prefill_tokens = sum(len(s.all_token_ids) for s in prefilling)  # a rebuild prefills prompt + output so far
        sps_table = None
        profile = self.sps_profile
        if profile is not None:
            sps_table = profile.table(upto=prefill_tokens + len(proposals) * (1 + width))  # [B_max]
        return self.policy.draft_lengths(
            request_ids=[s.request.request_id for s in decoding], num_drafts=num, confidences=confidences, sps_table=sps_table,
            prefill_tokens=prefill_tokens, prefill_emitted=len(prefilling),
        )

    def _verify_batch(self, states: list[RequestState], draft_of: dict[str, DraftProposal]) -> VerifyBatch:
        """The draft side of the round: anchors, drafts and the exact rows they were sampled from."""
        anchors, num_drafts, drafts = [], [], []
        for s in states:
            if s.prefilled:
                d = draft_of[s.request.request_id]
                anchors.append(s.output_ids[-1])
                num_drafts.append(len(d))
                if len(d):
                    drafts.append(d)
            else:
                anchors.append(PREFILL_ANCHOR)
                num_drafts.append(0)
        draft_ids = torch.cat([d.token_ids for d in drafts]) if drafts else torch.empty(0, dtype=torch.long)  # [Σ l_r]
        wanted = [NOT_ASKED if s.request.logprobs is None else s.request.logprobs for s in states]
        return VerifyBatch(
            round_id=self.counters.steps,
            request_ids=[s.request.request_id for s in states],
            anchor_token_ids=torch.tensor(anchors, dtype=torch.long),  # [num_requests]
            num_draft_tokens=torch.tensor(num_drafts, dtype=torch.long),  # [num_requests]
            draft_token_ids=draft_ids,
            draft_probs=self._draft_probs(drafts),
            capture_hidden_states=self.drafter_needs_hidden,
            num_logprobs=torch.tensor(wanted, dtype=torch.long) if any(k != NOT_ASKED for k in wanted) else None,  # [num_requests]
        )

    def _draft_probs(self, drafts: list[DraftProposal]) -> DraftProbs | None:
        """All requests' rows in one DraftProbs: dense if any proposal is dense, else sparse rows
        padded to the widest k (padding id -1, probability 0)."""
        if not drafts:
            return None
        if any(d.dense_probs is not None for d in drafts):
            vocab = self.verifier.vocab_size
            return DraftProbs(dense=torch.cat([d.dense(vocab) for d in drafts]))  # [Σ l_r, vocab]
        k = max(d.prob_ids.shape[1] for d in drafts)
        ids = torch.cat([torch.nn.functional.pad(d.prob_ids, (0, k - d.prob_ids.shape[1]), value=-1) for d in drafts])
        probs = torch.cat([torch.nn.functional.pad(d.probs, (0, k - d.probs.shape[1]), value=0.0) for d in drafts])
        return DraftProbs(sparse_ids=ids, sparse_probs=probs)  # [Σ l_r, k] each

    def _hand_over_features(self, states: list[RequestState], hidden: torch.Tensor | None, counts: torch.Tensor | None) -> None:
        """Give the drafter the target's hidden states of each request's newly verified positions."""
        if hidden is None or counts is None:
            raise RuntimeError("the drafter reads target hidden states, the verifier returned none")
        pieces = torch.split(hidden, counts.tolist())  # per request [n_r, num_capture_layers, hidden]
        # A request the drafter does not hold gets its features again when it is registered again.
        features = {s.request.request_id: f for s, f in zip(states, pieces) if s.drafter_synced}
        if not features:
            return
        try:
            self.drafter.observe_many(features)
        except PartFailure as e:
            self._drafter_failed(e)

    def _append(self, s: RequestState, emitted: list[int], logprobs: TokenLogprobs | None = None) -> StepOutput:
        req = s.request
        kept = []
        for t in emitted:
            if len(s.output_ids) >= req.max_new_tokens:
                break
            s.output_ids.append(t)
            kept.append(t)
            if t in req.stop_token_ids:
                s.finish_reason = "stop"
                break
        if s.finish_reason is None and len(s.output_ids) >= req.max_new_tokens:
            s.finish_reason = "length"
        self.counters.emitted_tokens += len(kept)
        if s.finish_reason is not None:
            del self.running[req.request_id]
            self.counters.finished += 1
        return StepOutput(request_id=req.request_id, new_token_ids=kept, finish_reason=s.finish_reason,
                          logprobs=None if logprobs is None else logprobs.head(len(kept)))

    # ---- faults (dspark/engine/faults.py) -------------------------------------------------

    def stalled_for_s(self) -> float:
        """Seconds until a step can do anything: > 0 only while every running request waits for
        the verifier to answer again (a caller may sleep that long, or until a new command)."""
        outage = self.verifier_outage
        if outage is None or not self.running or not all(s.needs_rebuild for s in self.running.values()):
            return 0.0
        return max(0.0, outage.retry_at - time.monotonic())

    def _verifier_failed(self, error: PartFailure, states: list[RequestState] = ()) -> None:
        """Record a verifier failure; `states` (a failed round's requests) are to be rebuilt."""
        if self.verifier_outage is None:
            log.warning("the verifier failed (%s); its %d requests are rebuilt when it answers", error, len(states))
            self.verifier_outage = Outage.begin(error, retry_at=time.monotonic())  # a restarted verifier answers at once
        else:
            self.verifier_outage.failed_again(error, retry_interval_s=self.faults.retry_interval_s)
        for s in states:
            s.needs_rebuild = True
            s.verifier_failures += 1

    def _drafter_failed(self, error: PartFailure) -> None:
        """Record a drafter failure: no request is drafted until the drafter holds it again."""
        if self.drafter_outage is None:
            log.warning("the drafter failed (%s); decoding without drafts until it answers", error)
            self.drafter_outage = Outage.begin(error, retry_at=time.monotonic() + self.faults.retry_interval_s)
        else:
            self.drafter_outage.failed_again(error, retry_interval_s=self.faults.retry_interval_s)
        for s in self.running.values():
            s.drafter_synced = False

    def _register_with_drafter(self, rid: str, token_ids: list[int], params: SamplingParams) -> bool:
        """Register a request with the drafter (afresh) from its tokens so far; False while the
        drafter fails (the request is then decoded without drafts)."""
        if self.drafter_outage is not None:
            return False
        try:
            self.drafter.add_request(rid, token_ids, params)
        except PartFailure as e:
            self._drafter_failed(e)
            return False
        return True

    def _recover_drafter(self, states: list[RequestState]) -> None:
        """Once the retry time has come, register the requests a failed drafter lost again. A
        drafter that reads hidden states needs every position's features: those requests are
        rebuilt on the verifier, whose prefill returns them."""
        outage = self.drafter_outage
        if outage is None or time.monotonic() < outage.retry_at:
            return
        lost = [s for s in states if not s.drafter_synced and not s.needs_rebuild]
        try:
            for s in lost:
                params = continuation_params(s.request.params, len(s.output_ids))
                self.drafter.add_request(s.request.request_id, s.all_token_ids, params)
                if self.drafter_needs_hidden:
                    s.needs_rebuild = True
                else:
                    s.drafter_synced = True
        except PartFailure as e:
            self._drafter_failed(e)
            return
        log.info("the drafter answers again after %.1f s: %d requests registered again", outage.seconds, len(lost))
        self.drafter_outage = None

    def _recover_verifier(self, states: list[RequestState]) -> bool:
        """Rebuild the requests whose verifier state was lost; True when every running request can
        take part in a round now. Requests past the fault policy's bounds fail (RequestsFailed)."""
        lost = [s for s in states if s.needs_rebuild]
        if not lost:
            return True
        outage, policy = self.verifier_outage, self.faults
        last_error = outage.error if outage is not None else "unknown"
        if outage is not None and outage.seconds > policy.verifier_timeout_s:
            self._fail(lost, f"the verifier has not answered for {outage.seconds:.0f} s (limit {policy.verifier_timeout_s:.0f} s); "
                             f"last error: {last_error}")
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
        self.verifier.remove_request([rid])
        self.verifier.add_request(rid, tokens, params, self.kv_tokens_needed(s.request))
        s.needs_rebuild, s.prefilled = False, False
        log.info("request %r rebuilt on the verifier from %d tokens", rid, len(tokens))
        # registered afresh: an in-process drafter drops the context features the prefill hands over again
        s.drafter_synced = self._register_with_drafter(rid, tokens, params)

    def _fail(self, states: list[RequestState], message: str) -> None:
        """Release requests that cannot go on and raise RequestsFailed for them."""
        ids = [s.request.request_id for s in states]
        for s in states:
            s.finish_reason = "abort"
            self.running.pop(s.request.request_id, None)
        log.error("failing %d requests %s: %s", len(ids), ids[:4], message)
        self._release(ids)
        raise RequestsFailed(ids, message)

    def _free_on_verifier(self, request_ids: list[str]) -> None:
        try:
            self.verifier.remove_request(request_ids)
        except PartFailure as e:  # its KV stays reserved there until a later retry (or the verifier restarts)
            log.warning("freeing %d requests on the verifier failed (%s); trying again later", len(request_ids), e)
            self._unfreed["verifier"].update(request_ids)

    def _free_on_drafter(self, request_ids: list[str]) -> None:
        if self.drafter_outage is not None:
            self._unfreed["drafter"].update(request_ids)
            return
        try:
            self.drafter.remove_requests(request_ids)
        except PartFailure as e:
            self._drafter_failed(e)
            self._unfreed["drafter"].update(request_ids)

    def _retry_frees(self) -> None:
        """Free what failed calls could not, once the part answers again."""
        for part, outage, free in (("verifier", self.verifier_outage, self._free_on_verifier),
                                   ("drafter", self.drafter_outage, self._free_on_drafter)):
            if self._unfreed[part] and outage is None:
                ids = sorted(self._unfreed[part])
                self._unfreed[part].clear()
                free(ids)

    # ---- convenience ---------------------------------------------------------------------

    def generate(self, requests: list[GenerationRequest]) -> list[RequestState]:
        """Run requests to completion (all admitted at once) and return their final states."""
        states = []
        for r in requests:
            self.add_request(r)
            states.append(self.running[r.request_id])
        while self.has_unfinished:
            self.step()
            if (stalled := self.stalled_for_s()) > 0:  # only while every request waits for the verifier
                time.sleep(stalled)
        return states
