"""The speculative decoding loop over a batch of requests (plain decoding is the γ = 0 case).

Invariant of a round, for every running request:
  before: the target's KV cache holds prompt + output[:-1]; output[-1] is the anchor x_0
          (the last token the target emitted, K/V not computed yet).
  round:  the drafter proposes x_1..x_ℓ from p_d; the target runs [x_0, x_1..x_ℓ] in one
          batched forward; the rejection sampler accepts a prefix x_1..x_a and emits one more
          token (the corrected token at the first rejection, else the bonus token).
  after:  KV truncated to prompt + output[:-1] + [x_0, x_1..x_a]; output += [x_1..x_a, new].
Exactness rests on the rejection sampler seeing the very p_d each draft was sampled from, and on
ℓ never depending on the realisation of the token being admitted: a fixed γ, or a policy of
`dspark.scheduling` (Algorithm 1's break; the async variant's two-rounds-old capacity).
A request in its first round is prefilled: its whole prompt goes through the same forward and
the first token is sampled from the last position (ℓ = 0).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import torch

from dspark.drafters.base import DraftProposal, DraftRequest, Drafter, NoDrafter
from dspark.model.target_runtime import TargetRuntime
from dspark.profiling.sps import SPSProfile
from dspark.sampling import DraftProbs, RejectionBatch, draw_rejection_randoms, rejection_sample
from dspark.sampling.params import SamplingParams
from dspark.scheduling.policies import Policy


@dataclass(frozen=True)
class GenerationRequest:
    request_id: str
    prompt_ids: list[int]
    max_new_tokens: int
    params: SamplingParams = SamplingParams()
    stop_token_ids: frozenset[int] = frozenset()  # emitting one ends the request (it is kept in the output)


@dataclass
class RequestState:
    request: GenerationRequest
    generator: torch.Generator
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


class SpeculativeEngine:
    def __init__(
        self,
        runtime: TargetRuntime,
        drafter: Drafter | None = None,
        *,
        num_speculative_tokens: int = 7,
        sampler_backend: str = "auto",  # "torch" | "triton" | "auto" (Triton kernel when CUDA is present)
        policy: Policy | None = None,  # how many drafts each request verifies; None = all of them (fixed:γ)
    ):
        if num_speculative_tokens < 0:
            raise ValueError(f"num_speculative_tokens must be >= 0, got {num_speculative_tokens}")
        self.runtime = runtime
        self.drafter: Drafter = drafter if drafter is not None else NoDrafter()
        self.gamma = num_speculative_tokens if not isinstance(self.drafter, NoDrafter) else 0
        self.drafter_needs_hidden = bool(getattr(self.drafter, "needs_hidden_states", False))
        if self.drafter_needs_hidden:
            wanted = tuple(getattr(self.drafter, "capture_layers", runtime.capture_layers))
            if wanted != tuple(runtime.capture_layers):
                raise ValueError(
                    f"drafter {self.drafter.name!r} reads target layers {wanted}, the runtime captures "
                    f"{tuple(runtime.capture_layers)}; load the target with capture_layers={wanted}"
                )
        if sampler_backend not in ("auto", "torch", "triton"):
            raise ValueError(f"sampler_backend must be 'auto', 'torch' or 'triton', got {sampler_backend!r}")
        if sampler_backend == "auto":
            sampler_backend = "triton" if torch.cuda.is_available() else "torch"
        self.sampler_backend = sampler_backend
        self.policy = policy
        if policy is not None and policy.needs_confidences and not getattr(self.drafter, "provides_confidences", False):
            raise ValueError(f"policy {policy.spec!r} needs calibrated confidences; drafter {self.drafter.name!r} gives none")
        self.running: dict[str, RequestState] = {}
        self.sps_profile: SPSProfile | None = None  # measured at server start-up; the prefix scheduler's input
        self._seed_source = torch.Generator().manual_seed(int(time.time_ns() % 2**63))

    # ---- requests ------------------------------------------------------------------------

    def validate(self, request: GenerationRequest) -> None:
        """Raise ValueError for a request the engine cannot serve (checked before any state changes)."""
        vocab = self.runtime.vocab_size
        if not request.prompt_ids:
            raise ValueError("the prompt is empty; at least one token is needed")
        if request.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {request.max_new_tokens}")
        bad = [t for t in request.prompt_ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token ids must be in [0, {vocab}), got {bad[:5]}")
        need = self.kv_tokens_needed(request)
        if need > self.runtime.max_model_len:
            raise ValueError(
                f"prompt ({len(request.prompt_ids)} tokens) + max_new_tokens ({request.max_new_tokens}) = {need} "
                f"exceeds the context window of {self.runtime.max_model_len} tokens"
            )
        if request.request_id in self.running:
            raise ValueError(f"request id {request.request_id!r} is already running")
        if need > self.runtime.kv.budget_tokens:
            raise ValueError(
                f"the request needs {need} KV tokens (prompt {len(request.prompt_ids)} + max_new_tokens "
                f"{request.max_new_tokens}), the whole KV budget is {self.runtime.kv.budget_tokens}"
            )

    @staticmethod
    def kv_tokens_needed(request: GenerationRequest) -> int:
        """KV a request reserves: prompt + output (the last emitted token never enters the cache,
        and drafts are capped so that a round never passes max_new_tokens)."""
        return len(request.prompt_ids) + request.max_new_tokens

    def add_request(self, request: GenerationRequest) -> None:
        """Admit a request; raises KVBudgetExceeded when its KV cannot be reserved now."""
        self.validate(request)
        self.runtime.add_request(request.request_id, self.kv_tokens_needed(request))
        seed = request.params.seed
        if seed is None:
            seed = int(torch.randint(0, 2**62, (1,), generator=self._seed_source))
        self.running[request.request_id] = RequestState(request=request, generator=torch.Generator().manual_seed(seed))

    def abort(self, request_id: str) -> None:
        state = self.running.pop(request_id, None)
        if state is not None:
            state.finish_reason = state.finish_reason or "abort"
            self._release(request_id)

    def _release(self, request_id: str) -> None:
        self.runtime.free_request(request_id)
        self.drafter.remove_request(request_id)
        if self.policy is not None:
            self.policy.remove_request(request_id)

    @property
    def has_unfinished(self) -> bool:
        return bool(self.running)

    # ---- one round -----------------------------------------------------------------------

    @torch.inference_mode()
    def step(self) -> list[StepOutput]:
        states = list(self.running.values())
        if not states:
            return []
        decoding = [s for s in states if s.prefilled]
        proposals = self._propose(decoding)
        if self.policy is not None and decoding:
            lengths = self._draft_lengths(decoding, proposals)
            proposals = [p.truncated(int(n)) for p, n in zip(proposals, lengths)]
        draft_of = {s.request.request_id: p for s, p in zip(decoding, proposals)}

        # Flatten: prefill requests send their prompt, decode requests [x_0, x_1..x_ℓ].
        token_chunks, query_lens, logits_rows, num_drafts = [], [], [], []
        offset = 0
        for s in states:
            if s.prefilled:
                draft = draft_of[s.request.request_id]
                chunk = torch.cat([torch.tensor(s.output_ids[-1:]), draft.token_ids])
                logits_rows.append(torch.arange(offset, offset + len(chunk)))
                num_drafts.append(len(draft))
            else:
                chunk = torch.tensor(s.request.prompt_ids)
                logits_rows.append(torch.tensor([offset + len(chunk) - 1]))
                num_drafts.append(0)
            token_chunks.append(chunk)
            query_lens.append(len(chunk))
            offset += len(chunk)
        request_ids = [s.request.request_id for s in states]
        context_lens = [self.runtime.context_len(r) for r in request_ids]
        out = self.runtime.forward(
            request_ids, torch.cat(token_chunks), query_lens, logits_indices=torch.cat(logits_rows),
            capture=self.drafter_needs_hidden,
        )

        result = rejection_sample(self._rejection_batch(states, draft_of, num_drafts, out.logits), backend=self.sampler_backend)
        num_accepted = result.num_accepted.tolist()
        tokens = result.output_token_ids.tolist()

        outputs = []
        now = time.perf_counter()
        for i, s in enumerate(states):
            rid = s.request.request_id
            a = num_accepted[i]
            emitted = tokens[i][: a + 1]
            if self.drafter_needs_hidden:  # positions now verified: the whole prompt, or x_0..x_a
                start = out.query_start[i]
                self.drafter.observe(rid, out.captured[start : start + (a + 1 if s.prefilled else query_lens[i])])
            if s.prefilled:
                self.runtime.truncate(rid, context_lens[i] + 1 + a)
                s.rounds += 1
                s.draft_tokens += num_drafts[i]
                s.accepted_tokens += a
                s.emitted_in_rounds += len(emitted)
            else:
                s.prefilled = True
                s.first_token_time = now
            outputs.append(self._append(s, emitted))
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
        if self.sps_profile is not None:
            sps_table = self.sps_profile.table(upto=len(proposals) * (1 + width))  # [B_max]
        return self.policy.draft_lengths(
            request_ids=[s.request.request_id for s in decoding], num_drafts=num, confidences=confidences, sps_table=sps_table
        )

    def _rejection_batch(self, states, draft_of, num_drafts, logits) -> RejectionBatch:
        drafts = [draft_of[s.request.request_id] for s in states if s.prefilled and len(draft_of[s.request.request_id])]
        draft_ids = torch.cat([d.token_ids for d in drafts]) if drafts else torch.empty(0, dtype=torch.long)
        draft_probs = None
        if drafts and any(d.dense_probs is not None for d in drafts):
            vocab = self.runtime.vocab_size
            draft_probs = DraftProbs(dense=torch.cat([d.dense(vocab) for d in drafts]), sparse_ids=None, sparse_probs=None)
        elif drafts:
            k = max(d.prob_ids.shape[1] for d in drafts)
            ids = torch.cat([torch.nn.functional.pad(d.prob_ids, (0, k - d.prob_ids.shape[1]), value=-1) for d in drafts])
            probs = torch.cat([torch.nn.functional.pad(d.probs, (0, k - d.probs.shape[1]), value=0.0) for d in drafts])
            draft_probs = DraftProbs(dense=None, sparse_ids=ids, sparse_probs=probs)  # [num_draft, k]
        counts = torch.tensor(num_drafts, dtype=torch.long)  # [num_requests]
        # Greedy requests consume no randomness; None keeps their seeded streams untouched.
        generators = [None if s.request.params.is_greedy else s.generator for s in states]
        uniforms, exp_noise = draw_rejection_randoms(counts, self.runtime.vocab_size, generators)
        return RejectionBatch(
            draft_token_ids=draft_ids,
            num_draft_tokens=counts,
            target_logits=logits,
            draft_probs=draft_probs,
            params=[s.request.params for s in states],
            uniforms=uniforms,
            exp_noise=exp_noise,
        )

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
        if s.finish_reason is not None:
            del self.running[req.request_id]
            self._release(req.request_id)
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

