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

Optional drafter hooks (a remote drafter implements them; in-process drafters need not):
`add_request(request_id, prompt_ids, params)` before a request's first round,
`observe_many({request_id: features})` instead of one `observe` per request, and
`remove_requests(ids)` instead of one `remove_request` per id.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import torch

from dspark.drafters.base import Drafter, DraftProposal, DraftRequest, NoDrafter
from dspark.engine.verifier import PREFILL_ANCHOR, LocalVerifier, Verifier, VerifyBatch
from dspark.model.target_runtime import TargetRuntime
from dspark.profiling.sps import SPSProfile
from dspark.sampling import DraftProbs
from dspark.sampling.params import SamplingParams
from dspark.scheduling.policies import Policy

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


@dataclass
class EngineCounters:
    """Cumulative counters since the engine started (read by the scheduler service's Stats)."""

    steps: int = 0  # verification rounds run (prefills included)
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
        self.gamma = num_speculative_tokens if not isinstance(self.drafter, NoDrafter) else 0
        self.drafter_needs_hidden = bool(getattr(self.drafter, "needs_hidden_states", False))
        if self.drafter_needs_hidden:
            captured = tuple(verifier.capture_layers)
            wanted = tuple(getattr(self.drafter, "capture_layers", captured))
            if wanted != captured:
                raise ValueError(
                    f"drafter {self.drafter.name!r} reads target layers {wanted}, the verifier captures "
                    f"{captured}; load the target with capture_layers={wanted}"
                )
        self.policy = policy
        if policy is not None and policy.needs_confidences and not getattr(self.drafter, "provides_confidences", False):
            raise ValueError(f"policy {policy.spec!r} needs calibrated confidences; drafter {self.drafter.name!r} gives none")
        self.running: dict[str, RequestState] = {}
        self.counters = EngineCounters()
        self._seed_source = torch.Generator().manual_seed(int(time.time_ns() % 2**63))

    @classmethod
    def from_parts(
        cls, *, verifier: Verifier, drafter: Drafter | None = None, num_speculative_tokens: int = 7, policy: Policy | None = None,
    ) -> SpeculativeEngine:
        """The round loop over a given verifier and drafter (e.g. RemoteVerifier + RemoteDrafter)."""
        return cls(None, drafter, num_speculative_tokens=num_speculative_tokens, policy=policy, verifier=verifier)

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
        """Admit a request; raises KVBudgetExceeded when its KV cannot be reserved now."""
        self.validate(request)
        rid = request.request_id
        self.verifier.add_request(rid, request.prompt_ids, request.params, self.kv_tokens_needed(request))
        register = getattr(self.drafter, "add_request", None)
        if register is not None:
            try:
                register(rid, request.prompt_ids, request.params)
            except BaseException:
                self.verifier.remove_request([rid])
                raise
        seed = request.params.seed
        if seed is None:
            seed = int(torch.randint(0, 2**62, (1,), generator=self._seed_source))
        self.running[rid] = RequestState(request=request, generator=torch.Generator().manual_seed(draft_stream_seed(seed)))

    def abort(self, request_id: str) -> None:
        state = self.running.pop(request_id, None)
        if state is not None:
            state.finish_reason = state.finish_reason or "abort"
            self._release([request_id])

    def _release(self, request_ids: list[str]) -> None:
        """Free finished or aborted requests everywhere: one verifier call (and one drafter call
        when the drafter takes a batch) for all of them."""
        self.verifier.remove_request(request_ids)
        remove_many = getattr(self.drafter, "remove_requests", None)
        if remove_many is not None:
            remove_many(request_ids)
        else:
            for rid in request_ids:
                self.drafter.remove_request(rid)
        if self.policy is not None:
            for rid in request_ids:
                self.policy.remove_request(rid)

    @property
    def has_unfinished(self) -> bool:
        return bool(self.running)

    # ---- one round -----------------------------------------------------------------------

    @torch.inference_mode()
    def step(self) -> list[StepOutput]:
        """One round for every running request. If it raises (a drafter or verifier error, a
        deadline), the round's requests are in an unknown state on the verifier (it may have
        verified the round after all): abort them, as AsyncEngine does."""
        states = list(self.running.values())
        if not states:
            return []
        decoding = [s for s in states if s.prefilled]
        proposals = self._propose(decoding)
        if self.policy is not None and decoding:
            lengths = self._draft_lengths(decoding, proposals)
            proposals = [p.truncated(int(n)) for p, n in zip(proposals, lengths)]
        draft_of = {s.request.request_id: p for s, p in zip(decoding, proposals)}

        verified = self.verifier.verify(self._verify_batch(states, draft_of))
        num_accepted = verified.result.num_accepted.tolist()
        tokens = verified.result.output_token_ids.tolist()
        self.counters.steps += 1
        if self.drafter_needs_hidden:  # positions now verified: the whole prompt, or x_0..x_a
            self._hand_over_features(states, verified.hidden_states, verified.num_hidden_positions)

        outputs, finished = [], []
        now = time.perf_counter()
        for i, s in enumerate(states):
            a = num_accepted[i]
            emitted = tokens[i][: a + 1]
            if s.prefilled:
                num_drafts = len(draft_of[s.request.request_id])
                s.rounds += 1
                s.draft_tokens += num_drafts
                s.accepted_tokens += a
                s.emitted_in_rounds += len(emitted)
                self.counters.decode_request_rounds += 1
                self.counters.emitted_in_decode_rounds += len(emitted)
            else:
                s.prefilled = True
                s.first_token_time = now
            out = self._append(s, emitted)
            if out.finish_reason is not None:
                finished.append(out.request_id)
            outputs.append(out)
        if finished:
            self._release(finished)
        return outputs

    def _propose(self, decoding: list[RequestState]) -> list[DraftProposal]:
        if not decoding or self.gamma == 0:
            return [DraftProposal.empty() for _ in decoding]
        reqs = [
            DraftRequest(
                request_id=s.request.request_id,
                token_ids=s.all_token_ids,
                num_prompt_tokens=len(s.request.prompt_ids),
                params=s.request.params,
                # at most remaining-1 drafts: a round emits ℓ+1 tokens and must not pass max_new_tokens
                max_draft_tokens=max(0, min(self.gamma, s.remaining - 1)),
                generator=s.generator,
            )
            for s in decoding
        ]
        proposals = self.drafter.propose(reqs)
        if len(proposals) != len(reqs):
            raise RuntimeError(f"drafter {self.drafter.name!r} returned {len(proposals)} proposals for {len(reqs)} requests")
        for req, p in zip(reqs, proposals):
            if len(p) > req.max_draft_tokens:
                raise RuntimeError(f"drafter {self.drafter.name!r} proposed {len(p)} > {req.max_draft_tokens} tokens")
        return proposals

    def _draft_lengths(self, decoding: list[RequestState], proposals: list[DraftProposal]) -> np.ndarray:
        """ℓ_r per request from the policy (Algorithm 1 for `dspark`), which sees only the
        drafts' calibrated confidences and the SPS profile, never the tokens."""
        num = np.array([len(p) for p in proposals], dtype=np.int64)  # [R]
        width = max(int(num.max(initial=0)), 1)
        confidences = np.zeros((len(proposals), width))  # [R, γ], 0 where no draft
        for r, p in enumerate(proposals):
            if len(p) and p.confidences is not None:
                confidences[r, : len(p)] = p.confidences.double().numpy()
            elif len(p) and self.policy.needs_confidences:
                raise RuntimeError(f"policy {self.policy.spec!r} needs confidences; drafter {self.drafter.name!r} gives none")
        sps_table = None
        profile = self.sps_profile
        if profile is not None:
            sps_table = profile.table(upto=len(proposals) * (1 + width))  # [B_max]
        return self.policy.draft_lengths(
            request_ids=[s.request.request_id for s in decoding], num_drafts=num, confidences=confidences, sps_table=sps_table
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
        return VerifyBatch(
            round_id=self.counters.steps,
            request_ids=[s.request.request_id for s in states],
            anchor_token_ids=torch.tensor(anchors, dtype=torch.long),  # [num_requests]
            num_draft_tokens=torch.tensor(num_drafts, dtype=torch.long),  # [num_requests]
            draft_token_ids=draft_ids,
            draft_probs=self._draft_probs(drafts),
            capture_hidden_states=self.drafter_needs_hidden,
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
        features = {s.request.request_id: f for s, f in zip(states, pieces)}
        observe_many = getattr(self.drafter, "observe_many", None)
        if observe_many is not None:
            observe_many(features)
        else:
            for rid, f in features.items():
                self.drafter.observe(rid, f)

    def _append(self, s: RequestState, emitted: list[int]) -> StepOutput:
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
        return StepOutput(request_id=req.request_id, new_token_ids=kept, finish_reason=s.finish_reason)

    # ---- convenience ---------------------------------------------------------------------

    def generate(self, requests: list[GenerationRequest]) -> list[RequestState]:
        """Run requests to completion (all admitted at once) and return their final states."""
        states = []
        for r in requests:
            self.add_request(r)
            states.append(self.running[r.request_id])
        while self.has_unfinished:
            self.step()
        return states
