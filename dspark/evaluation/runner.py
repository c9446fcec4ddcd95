"""Run one benchmark's conversations through the speculative engine and record every round.

The engine (dspark/engine/speculative.py) keeps per-request totals only; the offline evaluation
needs each round's (ℓ, a, c_1..c_ℓ). They are read without touching the engine:
  - ℓ and a from the request's own counters, before and after each `engine.step()`
    (a decode round adds ℓ to `draft_tokens` and a to `accepted_tokens`);
  - c_1..c_ℓ from `RecordingDrafter`, a transparent wrapper that remembers each request's latest
    proposal; it also checks that the engine verified exactly what was proposed (scheduler off,
    chain drafts, fixed γ: nothing may be cut).

Conversations are multi-turn (MT-Bench has two user turns): turn t+1 is asked after the model's
own answer to turn t, `[user_1, assistant_1, ..., user_{t+1}]` through the chat template, and
every turn's rounds count. Requests are batched (up to `batch_size` per engine step) but seeded
per (conversation, turn), and the target is batch-invariant, so the numbers do not depend on
the batching.

    run = run_conversations(runtime, drafter, tokenizer, conversations, gamma=7, temperature=1.0,
                            seed=0, max_new_tokens=256)
    run.tau, run.records
"""

from __future__ import annotations

import hashlib
import time
import zlib
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch

from dspark.drafters.base import Drafter, DraftProposal, DraftRequest, NoDrafter
from dspark.engine.speculative import GenerationRequest, RequestState, SpeculativeEngine
from dspark.evaluation.acceptance import RoundRecords
from dspark.model.kv_cache import KVBudgetExceeded
from dspark.model.target_runtime import TargetRuntime
from dspark.sampling.params import SamplingParams


class ChatTokenizer(Protocol):
    """What the runner needs of a tokenizer (dspark.model.tokenizer.Tokenizer has it)."""

    eos_token_ids: frozenset[int]

    def encode_chat(self, messages: list[dict[str, str]]) -> list[int]: ...

    def decode(self, token_ids: list[int]) -> str: ...


@dataclass(frozen=True)
class Conversation:
    key: str  # unique within a run, e.g. "mt-bench/3"
    turns: tuple[str, ...]  # the user messages, asked one after the other


def conversation_messages(turns: Sequence[str], answers: Sequence[str]) -> list[dict[str, str]]:
    """Chat messages for user turn len(answers)+1: every earlier turn followed by the model's answer."""
    if len(answers) >= len(turns):
        raise ValueError(f"{len(answers)} answers for {len(turns)} turns: no turn left to ask")
    messages = []
    for user, assistant in zip(turns, answers):
        messages += [{"role": "user", "content": user}, {"role": "assistant", "content": assistant}]
    return messages + [{"role": "user", "content": turns[len(answers)]}]


def request_seed(seed: int, key: str, turn: int) -> int:
    """A fixed per-request seed: the same request gets the same stream in every run and batch."""
    return zlib.crc32(f"{seed}/{key}/{turn}".encode())


class RecordingDrafter(Drafter):
    """Wraps any drafter: proposes exactly what it proposes and remembers, per request, the
    length and confidences of the latest proposal. Its spec and every lifecycle call are the
    wrapped drafter's."""

    def __init__(self, inner: Drafter):
        self.inner = inner
        self.spec = inner.spec
        self._latest: dict[str, tuple[int, torch.Tensor | None]] = {}  # request -> (len, [len] confidences)

    def add_request(self, request_id: str, token_ids: list[int], params: SamplingParams) -> None:
        self.inner.add_request(request_id, token_ids, params)

    def observe(self, request_id: str, features: torch.Tensor) -> None:
        self.inner.observe(request_id, features)

    def observe_many(self, features: dict[str, torch.Tensor]) -> None:
        self.inner.observe_many(features)

    def context_len(self, request_id: str) -> int:
        return self.inner.context_len(request_id)

    def propose(self, requests: list[DraftRequest]) -> list[DraftProposal]:
        proposals = self.inner.propose(requests)
        for req, p in zip(requests, proposals):
            self._latest[req.request_id] = (len(p), p.confidences)
        return proposals

    def remove_request(self, request_id: str) -> None:
        # the latest proposal is kept: the round that finishes a request is read after the step
        self.inner.remove_request(request_id)

    def remove_requests(self, request_ids: list[str]) -> None:
        self.inner.remove_requests(request_ids)

    def take(self, request_id: str, verified: int) -> torch.Tensor | None:  # [verified] confidences or None
        """The confidences of the request's latest proposal, which the engine verified `verified` of."""
        proposed, confidences = self._latest.pop(request_id, (0, None))
        if proposed != verified:
            raise RuntimeError(
                f"request {request_id!r}: the drafter proposed {proposed} tokens, the engine verified {verified}; "
                "the offline evaluation runs with the scheduler off (every proposed draft verified)"
            )
        return confidences


@dataclass
class BenchmarkRun:
    """Everything one benchmark produced for one drafter, temperature and γ."""

    records: RoundRecords
    requests: int  # requests generated (a conversation of two turns is two requests)
    rounds: int  # Σ decode rounds, from the engine's own counters
    emitted_in_rounds: int  # Σ tokens emitted by decode rounds (accepted + corrected/bonus)
    draft_tokens: int
    accepted_tokens: int
    generated_tokens: int  # Σ output tokens, the prefill's first token of each request included
    output_digest: str  # sha1 of every request's output ids (at temperature 0 equal for every drafter)
    seconds: float
    skipped: list[dict] = field(default_factory=list)  # [{"request": id, "reason": message}] not run (too long)
    outputs: dict[str, list[int]] = field(default_factory=dict)  # request id -> output ids (not cached)

    @property
    def tau(self) -> float:
        """Mean accepted length per round, bonus included: Σ emitted / Σ rounds over all requests."""
        return self.emitted_in_rounds / self.rounds if self.rounds else float("nan")


def run_conversations(
    runtime: TargetRuntime,
    drafter: Drafter | None,
    tokenizer: ChatTokenizer,
    conversations: Sequence[Conversation],
    *,
    gamma: int,
    temperature: float,
    seed: int,
    max_new_tokens: int,
    batch_size: int = 8,
    on_request_done: Callable[[], None] | None = None,
) -> BenchmarkRun:
    """Generate every turn of every conversation with chain drafts of γ tokens; record each round."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    recorder = RecordingDrafter(drafter if drafter is not None else NoDrafter())
    engine = SpeculativeEngine(runtime, recorder, num_speculative_tokens=gamma)
    with_confidences = recorder.spec.provides_confidences
    rounds: list[tuple[int, int, np.ndarray | None]] = []
    finished: dict[str, RequestState] = {}
    skipped: list[dict] = []
    answers: dict[str, list[str]] = {c.key: [] for c in conversations}
    if len(answers) != len(conversations):
        raise ValueError("conversation keys must be unique")
    t0 = time.perf_counter()
    alive = list(conversations)
    for turn in range(max((len(c.turns) for c in conversations), default=0)):
        requests = []
        for c in alive:
            if turn < len(c.turns):
                prompt = tokenizer.encode_chat(conversation_messages(c.turns[: turn + 1], answers[c.key]))
                params = SamplingParams(temperature=temperature, seed=request_seed(seed, c.key, turn))
                requests.append(GenerationRequest(f"{c.key}#{turn + 1}", prompt, max_new_tokens, params,
                                                  stop_token_ids=tokenizer.eos_token_ids))
        states, not_run = _run_requests(engine, recorder, requests, batch_size=batch_size, rounds=rounds,
                                        with_confidences=with_confidences, on_request_done=on_request_done)
        finished.update(states)
        skipped += not_run
        dropped = {s["request"].rsplit("#", 1)[0] for s in not_run}  # a later turn needs this one's answer
        alive = [c for c in alive if c.key not in dropped]
        for c in alive:
            state = states.get(f"{c.key}#{turn + 1}")
            if state is not None:
                answers[c.key].append(tokenizer.decode(state.output_ids))
    records = RoundRecords(
        num_drafts=np.array([r[0] for r in rounds], dtype=np.int64),
        num_accepted=np.array([r[1] for r in rounds], dtype=np.int64),
        confidences=np.stack([r[2] for r in rounds]) if with_confidences and rounds else
        (np.zeros((0, gamma)) if with_confidences else None),
    )
    digest = hashlib.sha1()
    for rid in sorted(finished):
        digest.update(f"{rid}:{finished[rid].output_ids}\n".encode())
    return BenchmarkRun(
        records=records,
        requests=len(finished),
        rounds=sum(s.rounds for s in finished.values()),
        emitted_in_rounds=sum(s.emitted_in_rounds for s in finished.values()),
        draft_tokens=sum(s.draft_tokens for s in finished.values()),
        accepted_tokens=sum(s.accepted_tokens for s in finished.values()),
        generated_tokens=sum(len(s.output_ids) for s in finished.values()),
        output_digest=digest.hexdigest(),
        seconds=time.perf_counter() - t0,
        skipped=skipped,
        outputs={rid: list(s.output_ids) for rid, s in finished.items()},
    )


def _run_requests(
    engine: SpeculativeEngine,
    recorder: RecordingDrafter,
    requests: list[GenerationRequest],
    *,
    batch_size: int,
    rounds: list[tuple[int, int, np.ndarray | None]],  # appended to: (ℓ, a, [γ] confidences or None)
    with_confidences: bool,
    on_request_done: Callable[[], None] | None,
) -> tuple[dict[str, RequestState], list[dict]]:
    """Continuous batching: keep up to `batch_size` requests running, admit as others finish."""
    pending = deque(requests)
    states: dict[str, RequestState] = {}
    skipped: list[dict] = []
    while pending or engine.has_unfinished:
        while pending and len(engine.running) < batch_size:
            request = pending[0]
            try:
                engine.add_request(request)
            except KVBudgetExceeded:
                if not engine.running:
                    raise
                break  # retry once running requests have freed their KV
            except ValueError as e:  # e.g. prompt + max_new_tokens beyond the context window
                pending.popleft()
                skipped.append({"request": request.request_id, "reason": str(e)})
                if on_request_done is not None:
                    on_request_done()
                continue
            pending.popleft()
            states[request.request_id] = engine.running[request.request_id]
        before = {rid: (s.rounds, s.draft_tokens, s.accepted_tokens) for rid, s in engine.running.items()}
        outputs = engine.step()
        for rid, (num_rounds, drafts, accepted) in before.items():
            state = states[rid]
            if state.rounds == num_rounds:  # the prefill step: no round
                continue
            verified, num_accepted = state.draft_tokens - drafts, state.accepted_tokens - accepted
            confidences = recorder.take(rid, verified)
            row = None
            if with_confidences:
                row = np.full(engine.gamma, np.nan)  # [γ], NaN past ℓ
                if confidences is not None:
                    row[:verified] = confidences.double().numpy()
            rounds.append((verified, num_accepted, row))
        if on_request_done is not None:
            for out in outputs:
                if out.finish_reason is not None:
                    on_request_done()
    return states, skipped


__all__ = ["BenchmarkRun", "ChatTokenizer", "Conversation", "RecordingDrafter", "conversation_messages", "request_seed",
           "run_conversations"]
