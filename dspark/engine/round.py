"""One speculative round over the table of running requests: draft -> schedule -> verify -> emit.

    result = run_round(table, drafter=drafter, verifier=verifier, policy=policy, gamma=γ, counters=counters)

Per request of `table` (prefilled ones decode, the others are prefilled in the same forward):

  draft     the drafter proposes x_1..x_ℓ from p_d (ℓ <= γ, <= remaining - 1)
  schedule  the policy (Algorithm 1 for `dspark`) cuts each proposal to ℓ_r, from confidences and
            the SPS profile only: ℓ_r never depends on the token it admits, which keeps it exact
  verify    one target forward over [x_0, x_1..x_ℓ_r]; the rejection sampler accepts x_1..x_a and
            adds one token (the correction at the first rejection, else the bonus)
  emit      output += [x_1..x_a, new], cut at max_new_tokens and at the first stop token

The round talks to the parts through their contracts only (`Drafter`, `Verifier`) and knows
nothing of where they run or how they fail: for remote parts, dspark/engine/resilience.py hands
it wrappers that turn a failed drafter into empty proposals, and a failed verifier into an
exception raised before anything is emitted. Request lifecycle (admit, finish, free) is the
engine's (dspark/engine/speculative.py).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from dspark.drafters.base import Drafter, DraftProposal, DraftRequest
from dspark.engine.requests import EngineCounters, RequestState, StepOutput
from dspark.engine.verifier import PREFILL_ANCHOR, Verifier, VerifyBatch
from dspark.observability.round_feed import RequestRound
from dspark.sampling import DraftProbs
from dspark.sampling.logprobs import NOT_ASKED, TokenLogprobs
from dspark.scheduling.draft_gate import DraftGate
from dspark.scheduling.policies import Policy
from dspark.scheduling.prefix_scheduler import ScheduleTrace, any_draft_can_pay, empty_schedule_trace

__all__ = ["RoundResult", "emit", "request_rounds", "run_round"]


@dataclass
class RoundResult:
    """What one round did. Lists marked "per decoding request" follow the table's order of its
    prefilled requests; `outputs` and `num_accepted` follow the whole table."""

    outputs: list[StepOutput]  # one per table row: the tokens it emitted this round
    num_accepted: list[int]  # per table row, a_r (0 for a prefill)
    num_draft_tokens: list[int]  # per decoding request: ℓ_r, the drafts verified
    num_decode_accepted: list[int]  # per decoding request: a_r
    num_emitted: list[int]  # per decoding request: a_r + 1 before the max_new_tokens / stop cut
    prefill_tokens: int  # prompt tokens of the requests prefilled in this round
    drafting: bool  # False: the draft gate judged the model's drafting not worth it this round
    proposed: dict[str, DraftProposal]  # per decoding request, before the policy cut it (the round feed shows both)
    admitted: dict[str, DraftProposal]  # per decoding request, what was verified
    schedule_trace: object | None = None  # the policy's trace of this round (only when asked for: watched)

    @property
    def finished(self) -> list[str]:
        return [o.request_id for o in self.outputs if o.finish_reason is not None]


def _no_phase(name: str) -> contextlib.AbstractContextManager:
    return contextlib.nullcontext()


def run_round(
    table: list[RequestState],
    *,
    drafter: Drafter,
    verifier: Verifier,
    policy: Policy | None,
    gamma: int,
    counters: EngineCounters,
    draft_gate: DraftGate | None = None,
    phase: Callable[[str], contextlib.AbstractContextManager] = _no_phase,  # RoundObserver.phase: times and traces
    trace_schedule: bool = False,  # keep the policy's trace (the round feed is watched)
) -> RoundResult:
    """One round for every request of `table` (non-empty). Updates the rows (tokens, per-request
    counters) and `counters`; finished rows keep their `finish_reason`, the caller releases them.
    An exception from the verifier leaves every row as it was: nothing is emitted before verify."""
    spec = drafter.spec
    decoding = [s for s in table if s.prefilled]
    prefilling = [s for s in table if not s.prefilled]

    with phase("draft"):
        # Algorithm 1 would verify no draft whatever was proposed: nothing to draft, not even a lookup
        unpayable = _no_draft_can_pay(policy, verifier, decoding, prefilling)
        drafting = not unpayable and _gate_allows_drafting(draft_gate, verifier, decoding, prefilling, gamma)
        counters.rounds_without_drafting += int(not drafting)
        t_draft = time.perf_counter()
        if drafting:
            proposals = _propose(drafter, decoding, gamma, policy)
        elif spec.free_proposals and not unpayable:  # the gate skips the model, not a lookup that costs nothing
            proposals = _propose(drafter, decoding, gamma, policy, free_only=True)
        else:
            proposals = [DraftProposal.empty() for _ in decoding]
        t_draft = time.perf_counter() - t_draft
    # the gate learns what the model's drafting buys; free lookups would flatter it
    model_drafted = [s for s, p in zip(decoding, proposals) if len(p) and not p.free] if drafting else []
    proposed = {s.request.request_id: p for s, p in zip(decoding, proposals)}

    trace = None
    with phase("schedule"):
        if policy is not None and decoding and not drafting and (policy.gates_drafting or unpayable) and not any(map(len, proposals)):
            # The gate skipped the drafter and no lookup proposed anything: every ℓ_r is 0 without
            # running Algorithm 1 (~0.2 ms a round here; a gated policy keeps no state across rounds).
            if trace_schedule:
                trace = _empty_schedule_trace(verifier, decoding, prefilling)
        elif policy is not None and decoding:
            lengths = _draft_lengths(policy, drafter, verifier, decoding, proposals, prefilling)  # [R]
            proposals = [p.truncated(int(n)) for p, n in zip(proposals, lengths)]
            trace = policy.last_trace if trace_schedule else None
    admitted = {s.request.request_id: p for s, p in zip(decoding, proposals)}

    with phase("verify"):
        verified = verifier.verify(_verify_batch(table, admitted, round_id=counters.steps, vocab_size=verifier.vocab_size,
                                                 capture_hidden_states=spec.needs_hidden_states))
    num_accepted = verified.result.num_accepted.tolist()  # [R]
    tokens = verified.result.output_token_ids.tolist()  # [R, max ℓ + 1], row r valid up to a_r + 1
    round_logprobs = verified.logprobs
    if round_logprobs is None and any(s.request.logprobs is not None for s in table):
        raise RuntimeError("requests of the round asked for logprobs; the verifier returned none")
    counters.steps += 1
    if draft_gate is not None and model_drafted:
        accepted_of = {s.request.request_id: a for s, a in zip(table, num_accepted)}
        ids = [s.request.request_id for s in model_drafted]
        draft_gate.record(num_requests=len(ids), draft_seconds=t_draft,
                          verified=sum(len(admitted[rid]) for rid in ids), accepted=sum(accepted_of[rid] for rid in ids))
    if spec.needs_hidden_states:  # positions now verified: the whole prompt, or x_0..x_a
        _hand_over_features(drafter, table, verified.hidden_states, verified.num_hidden_positions)

    outputs: list[StepOutput] = []
    round_drafts, round_accepted, round_emitted, prefill_tokens = [], [], [], 0
    now = time.perf_counter()
    for i, s in enumerate(table):
        a = num_accepted[i]
        emitted = tokens[i][: a + 1]
        if s.prefilled:
            num_drafts = len(admitted[s.request.request_id])
            round_drafts.append(num_drafts)
            round_accepted.append(a)
            round_emitted.append(len(emitted))
            s.rounds += 1
            s.draft_tokens += num_drafts
            s.accepted_tokens += a
            s.emitted_in_rounds += len(emitted)
            counters.decode_request_rounds += 1
            counters.emitted_in_decode_rounds += len(emitted)
        else:
            s.prefilled = True
            if s.first_token_time is None:  # a rebuild's prefill is not the request's first token
                s.first_token_time = now
            prefill_tokens += len(s.request.prompt_ids)
        logprobs = None
        if s.request.logprobs is not None:
            logprobs = round_logprobs.for_request(i, len(emitted), s.request.logprobs)
        out = emit(s, emitted, logprobs)
        counters.emitted_tokens += len(out.new_token_ids)
        outputs.append(out)
    return RoundResult(outputs=outputs, num_accepted=num_accepted, num_draft_tokens=round_drafts,
                       num_decode_accepted=round_accepted, num_emitted=round_emitted, prefill_tokens=prefill_tokens,
                       drafting=drafting, proposed=proposed, admitted=admitted, schedule_trace=trace)


def emit(s: RequestState, tokens: list[int], logprobs: TokenLogprobs | None = None) -> StepOutput:
    """Append a round's tokens to the request, up to max_new_tokens and through the first stop
    token: the verifier may emit past either (a bonus token after a stop), the user never sees it."""
    req = s.request
    kept = []
    for t in tokens:
        if len(s.output_ids) >= req.max_new_tokens:
            break
        s.output_ids.append(t)
        kept.append(t)
        if t in req.stop_token_ids:
            s.finish_reason = "stop"
            break
    if s.finish_reason is None and len(s.output_ids) >= req.max_new_tokens:
        s.finish_reason = "length"
    return StepOutput(request_id=req.request_id, new_token_ids=kept, finish_reason=s.finish_reason,
                      logprobs=None if logprobs is None else logprobs.head(len(kept)))


# ---- draft ---------------------------------------------------------------------------------

def _no_draft_can_pay(policy: Policy | None, verifier: Verifier, decoding: list[RequestState],
                      prefilling: list[RequestState]) -> bool:
    """True when the policy is Algorithm 1 with the break and not even a certain draft could raise
    Θ this round (prefix_scheduler.any_draft_can_pay): it would verify nothing, so nothing is
    drafted. From the round's sizes and the SPS profile only, never a token: lossless."""
    if policy is None or not policy.skips_unpayable_rounds or not decoding:
        return False
    profile = verifier.sps_profile
    if profile is None:
        return False
    prefill_tokens = sum(len(s.all_token_ids) for s in prefilling)  # a rebuild prefills prompt + output so far
    table = profile.table(upto=prefill_tokens + len(decoding) + 1)  # [P + R + 1]: Θ_0 and the first candidate's bound
    return not any_draft_can_pay(num_requests=len(decoding), sps_table=table, prefill_tokens=prefill_tokens,
                                 prefill_emitted=len(prefilling))


def _gate_allows_drafting(gate: DraftGate | None, verifier: Verifier, decoding: list[RequestState],
                          prefilling: list[RequestState], gamma: int) -> bool:
    """The draft gate's decision for this round, from earlier rounds only (draft_gate.py)."""
    if gate is None or not decoding:
        return True
    profile = verifier.sps_profile  # read only when needed: a remote verifier fetches it (one RPC, once)
    if profile is None:
        return True
    prefill_tokens = sum(len(s.all_token_ids) for s in prefilling)  # a rebuild prefills prompt + output so far
    table = profile.table(upto=prefill_tokens + len(decoding) * (1 + max(gamma, 1)))  # [B_max]
    return gate.should_draft(num_requests=len(decoding), sps_table=table, prefill_tokens=prefill_tokens)


def _propose(drafter: Drafter, decoding: list[RequestState], gamma: int, policy: Policy | None, *,
             free_only: bool = False) -> list[DraftProposal]:
    """One proposal per decoding request (empty ones when γ = 0)."""
    if not decoding or gamma == 0:
        return [DraftProposal.empty() for _ in decoding]
    cap = gamma if policy is None or policy.max_drafts is None else policy.max_drafts
    reqs = [
        DraftRequest(
            request_id=s.request.request_id,
            token_ids=s.all_token_ids,
            num_prompt_tokens=len(s.request.prompt_ids),
            params=s.request.params,
            # at most remaining-1 drafts: a round emits ℓ+1 tokens and must not pass max_new_tokens
            max_draft_tokens=max(0, min(gamma, s.remaining - 1, cap)),
            generator=s.generator,
            free_only=free_only,
        )
        for s in decoding
    ]
    proposals = drafter.propose(reqs)
    if len(proposals) != len(reqs):
        raise RuntimeError(f"drafter {drafter.spec.name!r} returned {len(proposals)} proposals for {len(reqs)} requests")
    for req, p in zip(reqs, proposals):
        if len(p) > req.max_draft_tokens:
            raise RuntimeError(f"drafter {drafter.spec.name!r} proposed {len(p)} > {req.max_draft_tokens} tokens")
    return proposals


# ---- schedule ------------------------------------------------------------------------------

def _draft_lengths(policy: Policy, drafter: Drafter, verifier: Verifier, decoding: list[RequestState],
                   proposals: list[DraftProposal], prefilling: list[RequestState]) -> np.ndarray:
    """ℓ_r per request from the policy, which sees the drafts' calibrated confidences and the SPS
    profile, never the tokens (exactness). The prefills of this round ride in the same forward:
    their tokens count in the batch size B, their first tokens in τ*."""
    num = np.array([len(p) for p in proposals], dtype=np.int64)  # [R]
    width = max(int(num.max(initial=0)), 1)
    confidences = np.zeros((len(proposals), width))  # [R, γ], 0 where no draft
    for r, p in enumerate(proposals):
        if len(p) and p.confidences is not None:
            confidences[r, : len(p)] = p.confidences.double().numpy()
        elif len(p) and policy.needs_confidences:
            raise RuntimeError(f"policy {policy.spec!r} needs confidences; drafter {drafter.spec.name!r} gives none")
    prefill_tokens = sum(len(s.all_token_ids) for s in prefilling)  # a rebuild prefills prompt + output so far
    sps_table = None
    profile = verifier.sps_profile
    if profile is not None:
        sps_table = profile.table(upto=prefill_tokens + len(proposals) * (1 + width))  # [B_max]
    return policy.draft_lengths(
        request_ids=[s.request.request_id for s in decoding], num_drafts=num, confidences=confidences, sps_table=sps_table,
        prefill_tokens=prefill_tokens, prefill_emitted=len(prefilling),
    )


def _empty_schedule_trace(verifier: Verifier, decoding: list[RequestState],
                          prefilling: list[RequestState]) -> ScheduleTrace | None:
    """The round feed's schedule of a round with no draft: what Algorithm 1 would have traced."""
    profile = verifier.sps_profile
    if profile is None:
        return None
    prefill_tokens = sum(len(s.all_token_ids) for s in prefilling)
    return empty_schedule_trace(num_requests=len(decoding), sps_table=profile.table(upto=prefill_tokens + len(decoding)),
                                prefill_tokens=prefill_tokens, prefill_emitted=len(prefilling))


# ---- verify --------------------------------------------------------------------------------

def _verify_batch(table: list[RequestState], admitted: dict[str, DraftProposal], *, round_id: int, vocab_size: int,
                  capture_hidden_states: bool) -> VerifyBatch:
    """The draft side of the round: anchors, drafts and the exact rows they were sampled from."""
    anchors, num_drafts, drafts = [], [], []
    for s in table:
        if s.prefilled:
            d = admitted[s.request.request_id]
            anchors.append(s.output_ids[-1])
            num_drafts.append(len(d))
            if len(d):
                drafts.append(d)
        else:
            anchors.append(PREFILL_ANCHOR)
            num_drafts.append(0)
    draft_ids = torch.cat([d.token_ids for d in drafts]) if drafts else torch.empty(0, dtype=torch.long)  # [Σ ℓ_r]
    wanted = [NOT_ASKED if s.request.logprobs is None else s.request.logprobs for s in table]
    return VerifyBatch(
        round_id=round_id,
        request_ids=[s.request.request_id for s in table],
        anchor_token_ids=torch.tensor(anchors, dtype=torch.long),  # [R]
        num_draft_tokens=torch.tensor(num_drafts, dtype=torch.long),  # [R]
        draft_token_ids=draft_ids,
        draft_probs=_draft_probs(drafts, vocab_size),
        capture_hidden_states=capture_hidden_states,
        num_logprobs=torch.tensor(wanted, dtype=torch.long) if any(k != NOT_ASKED for k in wanted) else None,  # [R]
    )


def _draft_probs(drafts: list[DraftProposal], vocab_size: int) -> DraftProbs | None:
    """All requests' rows in one DraftProbs: dense if any proposal is dense (one layout per batch),
    else sparse rows padded to the widest k (padding id -1, probability 0)."""
    if not drafts:
        return None
    if any(d.dense_probs is not None for d in drafts):
        return DraftProbs(dense=torch.cat([d.dense(vocab_size) for d in drafts]))  # [Σ ℓ_r, vocab]
    k = max(d.prob_ids.shape[1] for d in drafts)
    ids = torch.cat([torch.nn.functional.pad(d.prob_ids, (0, k - d.prob_ids.shape[1]), value=-1) for d in drafts])  # [Σ ℓ_r, k]
    probs = torch.cat([torch.nn.functional.pad(d.probs, (0, k - d.probs.shape[1]), value=0.0) for d in drafts])  # [Σ ℓ_r, k]
    return DraftProbs(sparse_ids=ids, sparse_probs=probs)


def _hand_over_features(drafter: Drafter, table: list[RequestState], hidden: torch.Tensor | None,
                        counts: torch.Tensor | None) -> None:
    """Give the drafter the target's hidden states of each request's newly verified positions
    (hidden [Σ n_r, num_capture_layers, hidden_size], counts [R] = n_r)."""
    if hidden is None or counts is None:
        raise RuntimeError("the drafter reads target hidden states, the verifier returned none")
    pieces = torch.split(hidden, counts.tolist())  # per request [n_r, num_capture_layers, hidden_size]
    drafter.observe_many({s.request.request_id: f for s, f in zip(table, pieces)})


# ---- the round feed's view -----------------------------------------------------------------

def request_rounds(result: RoundResult) -> list[RequestRound]:
    """Each request's part of the round, for the round feed (dspark/observability/round_feed.py)."""
    rounds = []
    for out, a in zip(result.outputs, result.num_accepted):
        p = result.proposed.get(out.request_id)  # None: prefilled this round
        rounds.append(RequestRound(
            request_id=out.request_id, prefill=p is None, drafted=p.token_ids.tolist() if p is not None else [],
            confidences=p.confidences.tolist() if p is not None and p.confidences is not None else [],
            admitted=len(result.admitted[out.request_id]) if p is not None else 0, accepted=a if p is not None else 0,
            emitted=list(out.new_token_ids), finish_reason=out.finish_reason))
    return rounds
