"""The target side of a speculative round: the `Verifier` contract and its in-process implementation.

A verifier owns, per request, the target's KV cache, the prompt (prefilled in the request's first
round) and the random stream its rejection sampling draws from (seeded from `params.seed`: the
randomness lives where the sampling happens). One `verify(batch)` call is one round:

    forward over [x_0, x_1..x_ℓ] of every decoding request and the whole prompt of every request in
    its first round (one flattened batch) -> exact rejection sampling against the very rows p_d
    the drafts were sampled from -> KV truncated to prompt + accepted prefix -> emitted tokens and,
    on request, the captured target hidden states of the newly verified positions and the
    log-probabilities of the emitted tokens (dspark/sampling/logprobs.py: read from the same rows).

Invariant per request, between rounds: its KV cache holds every token the target has verified
(prompt + output[:-1]); the last emitted token (the next anchor x_0) has no K/V yet.

`LocalVerifier(runtime)` runs that on a TargetRuntime in this process (the embedded mode and the
verifier service); `services.verifier.client.RemoteVerifier` is the same contract over gRPC. The
scheduler side (`dspark.engine.speculative.SpeculativeEngine`) only ever talks to this contract.
`VerifyBatch` / `VerifyResult` mirror the `dspark.v1.VerifyBatch` / `VerifyResult` messages.
"""

from __future__ import annotations

import importlib.util
import os
import time
from dataclasses import dataclass
from typing import Protocol

import torch

from dspark.model.kv_cache import KVBudgetExceeded
from dspark.model.target_runtime import TargetRuntime
from dspark.profiling.sps import SPSProfile
from dspark.sampling import (
    DraftProbs,
    RejectionBatch,
    RejectionResult,
    draw_rejection_randoms,
    draw_uniforms,
    rejection_sample,
)
from dspark.sampling.logprobs import MAX_LOGPROBS, NOT_ASKED, RoundLogprobs, round_logprobs
from dspark.sampling.params import SamplingParams
from dspark.serving_config import SAMPLER_BACKENDS

__all__ = ["KVBudgetExceeded", "LocalVerifier", "Verifier", "VerifyBatch", "VerifyResult", "resolve_sampler_backend"]

PREFILL_ANCHOR = -1  # anchor_token_ids value of a request's first round: prefill its prompt, no drafts


@dataclass
class VerifyBatch:
    """One verification round as the scheduler sends it (the draft side of a RejectionBatch).

    Request r owns draft tokens [cu_r, cu_r + l_r), cu_r = sum of l_j for j < r, exactly as in
    RejectionBatch; the verifier adds target logits and random numbers to build one.
    """

    round_id: int
    request_ids: list[str]  # [num_requests]
    anchor_token_ids: torch.Tensor  # [num_requests] int64 x_0; -1 = first round (prefill, no drafts)
    num_draft_tokens: torch.Tensor  # [num_requests] int64, l_r >= 0
    draft_token_ids: torch.Tensor  # [num_draft_tokens] int64
    draft_probs: DraftProbs | None  # [num_draft_tokens] rows; None only if no request has drafts
    capture_hidden_states: bool = False
    # [num_requests] int64 alternatives wanted per emitted token, -1 = no log-probabilities (0: the
    # emitted token's only); None: no request of the round asks
    num_logprobs: torch.Tensor | None = None


@dataclass
class VerifyResult:
    """A verification round's outcome: the RejectionResult plus the verified positions' features."""

    round_id: int
    request_ids: list[str]  # [num_requests]
    result: RejectionResult
    hidden_states: torch.Tensor | None = None  # [sum n_r, num_capture_layers, hidden]
    num_hidden_positions: torch.Tensor | None = None  # [num_requests] int64 n_r, None iff hidden_states is
    logprobs: RoundLogprobs | None = None  # the emitted tokens' log-probabilities; None unless a request asked


class Verifier(Protocol):
    """What the scheduler side needs from the target, in process or over gRPC.

    Fixed at start: vocab_size, max_model_len, capture_layers (target layers whose outputs the
    hidden states hold), hidden_size, kv_budget_tokens (the whole KV budget). `sps_profile` is the
    measured SPS(B) curve (None until profiled); it is settable so that a caller may install one.
    """

    vocab_size: int
    max_model_len: int
    capture_layers: tuple[int, ...]
    hidden_size: int
    kv_budget_tokens: int
    sps_profile: SPSProfile | None
    sampler_backend: str  # the rejection sampler it runs: "torch" | "triton"
    # False for a verifier in another process: its calls can fail for reasons that are not the
    # request's (PartFailure), and the engine handles that (dspark/engine/resilience.py)
    in_process: bool
    runtime: TargetRuntime | None  # the target, when it runs in this process

    @property
    def free_kv_tokens(self) -> int: ...

    def add_request(self, request_id: str, prompt_ids: list[int], params: SamplingParams, num_kv_tokens: int) -> None:
        """Register a request and reserve `num_kv_tokens` of KV (prompt + max_new_tokens); raises
        KVBudgetExceeded when that does not fit now, ValueError for a request it can never serve."""
        ...

    def remove_request(self, request_ids: list[str]) -> int:
        """Free requests (unknown ids are ignored); returns how many were known."""
        ...

    def verify(self, batch: VerifyBatch) -> VerifyResult:
        """One round over the batch's requests (see the module docstring)."""
        ...


def resolve_sampler_backend(backend: str, device: torch.device | str = "cpu") -> str:
    """"auto" -> the fused Triton kernel when the logits live on a CUDA device, else the torch
    reference (compiled Triton cannot read CPU tensors, even on a machine that has a GPU).

    "triton" for logits on another device is refused here, at start-up, rather than at the first
    round: only Triton's interpreter (TRITON_INTERPRET=1, for tests) runs the kernel on the CPU."""
    if backend not in SAMPLER_BACKENDS:
        raise ValueError(f"sampler_backend must be one of {', '.join(map(repr, SAMPLER_BACKENDS))}, got {backend!r}")
    on_cuda = torch.device(device).type == "cuda" and torch.cuda.is_available()
    if backend == "auto":
        return "triton" if on_cuda else "torch"
    if backend == "triton":
        if importlib.util.find_spec("triton") is None:
            raise ValueError("sampler_backend 'triton' needs the triton package, which is not installed; "
                             "use 'auto' or 'torch' (the torch reference)")
        if not on_cuda and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError(f"sampler_backend 'triton' runs the fused kernel on CUDA tensors, but the target's logits "
                             f"live on {torch.device(device)}: use 'auto' or 'torch' (the torch reference), or set "
                             "TRITON_INTERPRET=1 to run the kernel in Triton's interpreter (tests only: it is slow)")
    return backend


@dataclass
class _VerifierRequest:
    prompt_ids: torch.Tensor  # [num_prompt_tokens] int64
    params: SamplingParams
    generator: torch.Generator  # the request's rejection-sampling stream
    prefilled: bool = False


class LocalVerifier(Verifier):
    """The Verifier contract on a TargetRuntime in this process. Not thread-safe: one caller at a
    time (the engine thread, or the verifier service under its lock)."""

    in_process = True

    def __init__(self, runtime: TargetRuntime, *, sampler_backend: str = "auto"):
        self.runtime = runtime
        self.device: torch.device = runtime.device  # the forward's and the sampler's; the engine's side stays on the host
        self.sampler_backend = resolve_sampler_backend(sampler_backend, self.device)  # logits live beside the KV
        self.vocab_size: int = runtime.vocab_size
        self.max_model_len: int = runtime.max_model_len
        self.capture_layers: tuple[int, ...] = tuple(runtime.capture_layers)
        self.hidden_size: int = runtime.config.hidden_size
        self.kv_budget_tokens: int = runtime.kv.budget_tokens
        self.sps_profile: SPSProfile | None = None  # measured at service start-up (dspark.profiling.sps)
        self._requests: dict[str, _VerifierRequest] = {}
        self._seed_source = torch.Generator().manual_seed(int(time.time_ns() % 2**63))

    @property
    def free_kv_tokens(self) -> int:
        return self.runtime.kv.free_tokens

    @property
    def num_requests(self) -> int:
        return len(self._requests)

    def has_request(self, request_id: str) -> bool:
        return request_id in self._requests

    # ---- requests ------------------------------------------------------------------------

    def add_request(self, request_id: str, prompt_ids: list[int], params: SamplingParams, num_kv_tokens: int) -> None:
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already registered with the verifier")
        if not prompt_ids:
            raise ValueError("the prompt is empty; at least one token is needed")
        bad = [t for t in prompt_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prompt token ids must be in [0, {self.vocab_size}), got {bad[:5]}")
        if num_kv_tokens <= len(prompt_ids):
            raise ValueError(
                f"num_kv_tokens must exceed the prompt length {len(prompt_ids)} (prompt + max_new_tokens), got {num_kv_tokens}"
            )
        self.runtime.add_request(request_id, num_kv_tokens)  # ValueError past the context window, KVBudgetExceeded
        seed = params.seed
        if seed is None:
            seed = int(torch.randint(0, 2**62, (1,), generator=self._seed_source))
        self._requests[request_id] = _VerifierRequest(
            prompt_ids=torch.tensor(prompt_ids, dtype=torch.long), params=params,
            # on the forward's device, so its draws need no copy; a seed gives the same stream on
            # every run on the same kind of device (CPU and CUDA generators differ)
            generator=torch.Generator(device=self.device).manual_seed(seed),
        )

    def remove_request(self, request_ids: list[str]) -> int:
        removed = 0
        for rid in request_ids:
            if self._requests.pop(rid, None) is not None:
                removed += 1
            self.runtime.free_request(rid)  # also frees a cache reserved outside this verifier (SPS profiling)
        return removed

    # ---- one round -----------------------------------------------------------------------

    @torch.inference_mode()
    def verify(self, batch: VerifyBatch) -> VerifyResult:
        states = self._check(batch)
        lens = batch.num_draft_tokens.tolist()  # host: sizes the per-request chunks below

        # Flatten: first rounds send their prompt, decode rounds [x_0, x_1..x_ℓ].
        token_chunks, query_lens, logits_rows = [], [], []
        offset = draft_offset = 0
        for i, (s, n) in enumerate(zip(states, lens)):
            if s.prefilled:
                chunk = torch.cat([batch.anchor_token_ids[i : i + 1], batch.draft_token_ids[draft_offset : draft_offset + n]])  # [1 + l_r]
                logits_rows.append(torch.arange(offset, offset + len(chunk)))
            else:
                chunk = s.prompt_ids  # [num_prompt_tokens]
                logits_rows.append(torch.tensor([offset + len(chunk) - 1]))
            token_chunks.append(chunk)
            query_lens.append(len(chunk))
            offset += len(chunk)
            draft_offset += n
        context_lens = [self.runtime.context_len(r) for r in batch.request_ids]
        out = self.runtime.forward(
            batch.request_ids, torch.cat(token_chunks), query_lens, logits_indices=torch.cat(logits_rows),
            capture=batch.capture_hidden_states,
        )
        try:
            # Greedy requests consume no randomness; None keeps their seeded streams untouched.
            generators = [None if s.params.is_greedy else s.generator for s in states]
            greedy = [s.params.is_greedy for s in states]
            device = self.device
            if device.type == "cpu":  # exponentials drawn by the sampler, on each request's support only
                uniforms, exp_noise = draw_uniforms(batch.num_draft_tokens, generators, device=device, greedy=greedy), None
            else:  # a whole vocabulary each, drawn here: finding supports would sync the host with the device
                uniforms, exp_noise = draw_rejection_randoms(batch.num_draft_tokens, self.vocab_size, generators,
                                                             device=device, greedy=greedy)
            draft_probs = batch.draft_probs
            result = rejection_sample(RejectionBatch(
                draft_token_ids=batch.draft_token_ids.to(device, non_blocking=True),
                num_draft_tokens=batch.num_draft_tokens.to(device, non_blocking=True),
                target_logits=out.logits,  # [num_draft_tokens + num_requests, vocab]
                draft_probs=None if draft_probs is None else draft_probs.to(device, non_blocking=True),
                params=[s.params for s in states],
                uniforms=uniforms,
                exp_noise=exp_noise,
                noise_generators=generators,
            ), backend=self.sampler_backend)
            if device.type != "cpu":  # the round's result is host data, as over gRPC: one copy back
                result = RejectionResult(output_token_ids=result.output_token_ids.cpu(), num_accepted=result.num_accepted.cpu())
        except BaseException:  # e.g. invalid draft rows: undo the forward's K/V so the request can go on
            for rid, length in zip(batch.request_ids, context_lens):
                self.runtime.truncate(rid, length)
            raise
        logprobs = None
        if batch.num_logprobs is not None:
            logprobs = round_logprobs(out.logits, output_token_ids=result.output_token_ids, num_accepted=result.num_accepted,
                                      num_draft_tokens=batch.num_draft_tokens, num_logprobs=batch.num_logprobs)

        num_accepted = result.num_accepted.tolist()
        hidden_pieces, hidden_counts = [], []
        for i, (rid, s) in enumerate(zip(batch.request_ids, states)):
            a = num_accepted[i]
            if s.prefilled:  # keep x_0 and the accepted drafts x_1..x_a, drop the rejected ones
                verified = 1 + a
                self.runtime.truncate(rid, context_lens[i] + verified)
            else:  # the whole prompt is verified; the sampled first token has no K/V yet
                verified = query_lens[i]
                s.prefilled = True
            if batch.capture_hidden_states:
                start = out.query_start[i]
                hidden_pieces.append(out.captured[start : start + verified])  # [verified, m, hidden] on the device
                hidden_counts.append(verified)
        hidden = num_hidden = None
        if batch.capture_hidden_states:
            hidden = torch.cat(hidden_pieces).cpu()  # [sum n_r, num_capture_layers, hidden] (the drafter moves it where it runs)
            num_hidden = torch.tensor(hidden_counts, dtype=torch.long)  # [num_requests]
        return VerifyResult(round_id=batch.round_id, request_ids=list(batch.request_ids), result=result,
                            hidden_states=hidden, num_hidden_positions=num_hidden, logprobs=logprobs)

    def _check(self, batch: VerifyBatch) -> list[_VerifierRequest]:
        """ValueError for a batch that does not match the verifier's state (checked before any change)."""
        r = len(batch.request_ids)
        if r == 0:
            raise ValueError("a verification round needs at least one request")
        if len(set(batch.request_ids)) != r:
            raise ValueError(f"a request may appear only once per round, got {batch.request_ids}")
        for name in ("anchor_token_ids", "num_draft_tokens"):
            t = getattr(batch, name)
            if tuple(t.shape) != (r,):
                raise ValueError(f"{name} must hold one entry per request [{r}], got shape {list(t.shape)}")
        if batch.num_logprobs is not None:
            k = batch.num_logprobs
            if tuple(k.shape) != (r,) or k.is_floating_point():
                raise ValueError(f"num_logprobs must be integer [num_requests] = [{r}], got {k.dtype} {list(k.shape)}")
            if k.numel() and not (int(k.min()) >= NOT_ASKED and int(k.max()) <= MAX_LOGPROBS):
                raise ValueError(f"num_logprobs must be in [0, {MAX_LOGPROBS}] or {NOT_ASKED} (none), got {k.tolist()}")
        total = int(batch.num_draft_tokens.sum())
        if tuple(batch.draft_token_ids.shape) != (total,):
            raise ValueError(f"draft_token_ids must hold sum(num_draft_tokens) = {total} ids, got shape {list(batch.draft_token_ids.shape)}")
        unknown = [rid for rid in batch.request_ids if rid not in self._requests]
        if unknown:
            raise ValueError(f"requests {unknown[:5]} are not registered with the verifier (add_request first)")
        states = [self._requests[rid] for rid in batch.request_ids]
        for rid, s, anchor, n in zip(batch.request_ids, states, batch.anchor_token_ids.tolist(), batch.num_draft_tokens.tolist()):
            if s.prefilled and anchor == PREFILL_ANCHOR:
                raise ValueError(f"request {rid!r} is already prefilled: its round needs the anchor x_0, got {PREFILL_ANCHOR}")
            if not s.prefilled and anchor != PREFILL_ANCHOR:
                raise ValueError(f"request {rid!r} has not been prefilled: its first round needs anchor {PREFILL_ANCHOR}, got {anchor}")
            if not s.prefilled and n:
                raise ValueError(f"request {rid!r}: a first round prefills the prompt and takes no drafts, got {n}")
            if s.prefilled and not 0 <= anchor < self.vocab_size:
                raise ValueError(f"request {rid!r}: anchor {anchor} out of range [0, {self.vocab_size})")
        return states
