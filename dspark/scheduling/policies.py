"""Draft-length policies: how many of its drafts each request sends to the verifier this round.

This module owns the policy interface the engine (and later the scheduler service) calls once
per round, the baselines and the DSpark schedulers behind it, and `parse_policy`, which reads
the command-line / config form:

    "none"          ℓ_r = 0: plain autoregressive decoding
    "fixed:K"       ℓ_r = min(K, drafts available)
    "threshold:C"   admit x_{r,j} while a_{r,j} = Π_{i≤j} c_{r,i} ≥ C
    "dspark"        Algorithm 1 with the break (prefix_scheduler.schedule)
    "dspark-async"  stale capacity + dynamic top-K (prefix_scheduler.schedule_async)

What a policy sees, by construction: request ids (to key its own state), how many drafts each
request has, their calibrated confidences and the verifier's SPS table -- never the draft
tokens or their distributions. Confidences still carry information about realisations:
c_{r,j+1} is computed from x_{r,j}. The invariant every policy keeps is that the decision
{ℓ_r ≥ j} uses a_{r,≤j} (which do not depend on x_{r,j}) and other requests' values only:
`fixed`/`none` use no confidence, `threshold` stops at the first position below C (a is
non-increasing, so that is a prefix decided position by position), `dspark` stops at the
first candidate that does not raise Θ (the break), `dspark-async` fixes its capacity from
confidences two rounds old. Hence rejection sampling of the admitted prefix stays exact.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import ClassVar, Protocol

import numpy as np

from dspark.scheduling.prefix_scheduler import ArrayLike, ScheduleTrace, schedule_async, schedule_with_trace, survival_products

POLICY_FORMS = ("none", "fixed:K", "threshold:C", "dspark", "dspark-async")


class Policy(Protocol):
    spec: str  # the string `parse_policy` reads back into an equal policy, e.g. "fixed:3"
    needs_confidences: bool  # True: draft_lengths raises without calibrated confidences
    needs_sps_profile: bool  # True: draft_lengths raises without the verifier's SPS table
    # the most drafts a request ever gets verified in a round (None: up to γ); the engine asks the
    # drafter for no more, so `fixed:1` pays for one draft position, not γ
    max_drafts: int | None
    # True: the engine skips a round's drafting when its last rounds say drafting will not pay
    # (dspark/scheduling/draft_gate.py); the static baselines always draft
    gates_drafting: bool
    # True: Algorithm 1 with the break, which admits nothing on a round where even a certain
    # draft could not raise Θ; the engine then drafts nothing (prefix_scheduler.any_draft_can_pay)
    skips_unpayable_rounds: bool
    # what the last draft_lengths computed on its way (Algorithm 1's Θ per admission, its break),
    # for the round view; None for the policies that compute no Θ
    last_trace: ScheduleTrace | None

    def draft_lengths(
        self,
        *,
        request_ids: Sequence[str],  # [R] this round's requests, in batch order
        num_drafts: ArrayLike,  # [R] int, drafts available per request (≤ γ)
        confidences: ArrayLike | None = None,  # [R, γ] calibrated c_{r,j}; 0 at unavailable positions
        sps_table: ArrayLike | None = None,  # [B_max] SPS(B) at index B-1 (prefix_scheduler docstring)
        prefill_tokens: int = 0,  # P: tokens of requests prefilled in the same forward (count in B)
        prefill_emitted: int = 0,  # E: tokens those prefills emit (count in τ*)
    ) -> np.ndarray:  # [R] int64 ℓ_r, 0 ≤ ℓ_r ≤ num_drafts_r
        """ℓ for this round. Called exactly once per round: stateful policies count rounds.
        Policies that ignore the SPS table ignore the prefill counts too."""
        ...

    def remove_request(self, request_id: str) -> None:
        """Forget a finished or aborted request's state (no-op for stateless policies)."""
        ...


def _num_drafts(request_ids: Sequence[str], num_drafts: ArrayLike) -> np.ndarray:
    n_raw = np.asarray(num_drafts)
    if n_raw.shape != (len(request_ids),):
        raise ValueError(f"num_drafts must have shape [{len(request_ids)}] (one per request id), got shape {n_raw.shape}")
    if n_raw.size and (not np.issubdtype(n_raw.dtype, np.integer) or n_raw.min() < 0):
        raise ValueError(f"num_drafts must be integers >= 0, got {n_raw.tolist()[:8]}")
    return n_raw.astype(np.int64)  # [R]


def _require(confidences: ArrayLike | None, sps_table: ArrayLike | None, spec: str, *, sps: bool) -> None:
    if confidences is None:
        raise ValueError(
            f"policy {spec!r} needs calibrated confidences [R, gamma], got None (use 'fixed:K' for drafters without them)"
        )
    if sps and sps_table is None:
        raise ValueError(f"policy {spec!r} needs the SPS table (sps[B-1] = SPS(B)), got None")


@dataclass(frozen=True)
class NonePolicy:
    """ℓ_r = 0: every round verifies the anchor only (plain decoding)."""

    spec: str = "none"
    needs_confidences: bool = False
    needs_sps_profile: bool = False
    max_drafts: int | None = 0
    gates_drafting: bool = False
    skips_unpayable_rounds: bool = False
    last_trace: ClassVar[None] = None

    def draft_lengths(self, *, request_ids, num_drafts, confidences=None, sps_table=None,
                      prefill_tokens=0, prefill_emitted=0) -> np.ndarray:
        return np.zeros(len(_num_drafts(request_ids, num_drafts)), dtype=np.int64)  # [R]

    def remove_request(self, request_id: str) -> None:
        pass


@dataclass(frozen=True)
class FixedPolicy:
    """ℓ_r = min(K, drafts available): the classic fixed speculation length. Ignores the SPS
    table, so B = Σ(1 + ℓ_r) may exceed it."""

    k: int
    needs_confidences: bool = False
    needs_sps_profile: bool = False
    gates_drafting: bool = False
    skips_unpayable_rounds: bool = False
    last_trace: ClassVar[None] = None

    def __post_init__(self) -> None:
        if isinstance(self.k, bool) or not isinstance(self.k, int) or self.k < 0:
            raise ValueError(f"fixed:K needs an integer K >= 0, got {self.k!r}")

    @property
    def spec(self) -> str:
        return f"fixed:{self.k}"

    @property
    def max_drafts(self) -> int:
        return self.k

    def draft_lengths(self, *, request_ids, num_drafts, confidences=None, sps_table=None,
                      prefill_tokens=0, prefill_emitted=0) -> np.ndarray:
        return np.minimum(_num_drafts(request_ids, num_drafts), self.k)  # [R]

    def remove_request(self, request_id: str) -> None:
        pass


@dataclass(frozen=True)
class ThresholdPolicy:
    """Admit x_{r,j} while its cumulative survival a_{r,j} = Π_{i≤j} c_{r,i} ≥ C.

    Thresholds a, not c: a_{r,j} is the calibrated probability that x_{r,j} is accepted at all
    (STS calibrates exactly this product, docs/method.md §4), so C bounds the expected
    waste per admitted token; it is non-increasing in j, so the admitted set is a prefix and
    position j is decided from a_{r,j} alone (lossless). Thresholding c would keep admitting
    after a long chain of middling confidences whose joint survival is tiny. Ignores the SPS
    table (B may exceed it); C = 0 admits every available draft.
    """

    threshold: float
    needs_confidences: bool = True
    needs_sps_profile: bool = False
    max_drafts: int | None = None
    gates_drafting: bool = False
    skips_unpayable_rounds: bool = False
    last_trace: ClassVar[None] = None

    def __post_init__(self) -> None:
        if not 0.0 <= self.threshold <= 1.0:  # also rejects NaN
            raise ValueError(f"threshold:C needs 0 <= C <= 1, got {self.threshold!r}")

    @property
    def spec(self) -> str:
        return f"threshold:{self.threshold!r}"

    def draft_lengths(self, *, request_ids, num_drafts, confidences=None, sps_table=None,
                      prefill_tokens=0, prefill_emitted=0) -> np.ndarray:
        n = _num_drafts(request_ids, num_drafts)  # [R]
        _require(confidences, sps_table, self.spec, sps=False)
        a = survival_products(confidences=confidences, num_drafts=n)  # [R, γ], 0 where unavailable
        admitted = (a >= self.threshold) & (np.arange(a.shape[1]) < n[:, None])  # [R, γ], a prefix per row
        return admitted.sum(axis=1).astype(np.int64)  # [R]

    def remove_request(self, request_id: str) -> None:
        pass


@dataclass
class DSparkPolicy:
    """Algorithm 1 with the break (synchronous): maximise Θ = τ*·SPS(B) greedily, stop at the
    first candidate that does not raise it. B never exceeds the SPS table. Keeps the trace of its
    last schedule (`last_trace`: the Θ it computed anyway, no extra work)."""

    spec: str = "dspark"
    needs_confidences: bool = True
    needs_sps_profile: bool = True
    max_drafts: int | None = None
    gates_drafting: bool = True
    skips_unpayable_rounds: bool = True
    last_trace: ScheduleTrace | None = field(default=None, repr=False, compare=False)

    def draft_lengths(self, *, request_ids, num_drafts, confidences=None, sps_table=None,
                      prefill_tokens=0, prefill_emitted=0) -> np.ndarray:
        n = _num_drafts(request_ids, num_drafts)
        _require(confidences, sps_table, self.spec, sps=True)
        ell, self.last_trace = schedule_with_trace(confidences=confidences, sps_table=sps_table, num_drafts=n,
                                                   prefill_tokens=prefill_tokens, prefill_emitted=prefill_emitted)
        return ell  # [R]

    def remove_request(self, request_id: str) -> None:
        pass


@dataclass
class DSparkAsyncPolicy:
    """The asynchronous production variant: capacity K from each current request's confidences
    of two rounds earlier (full search), then this round's top K candidates by current a.

    State: per request id, its last two rounds (round index, confidences of its available
    drafts), and the same for the population (the per-position mean over a round's requests).
    Round t uses, per request, the newest row from a round ≤ t - 2 (a request that skipped
    rounds uses an older one: still fixed before this round's drafts). A request with no such
    row (new in the last two rounds) borrows the population's newest row from a round ≤ t - 2,
    so that joining a busy server does not cost it two draftless rounds; it is as old as the
    other rows, hence fixed before this round's drafts too (lossless). Only the engine's first
    two rounds, with no history at all, admit no drafts. Call `remove_request` when a request ends.
    """

    spec: str = "dspark-async"
    needs_confidences: bool = True
    needs_sps_profile: bool = True
    max_drafts: int | None = None
    # not gated: its capacity comes from confidences of two rounds earlier, which a round
    # without drafting does not produce, so a gate would starve it of the very rounds it reads
    gates_drafting: bool = False
    skips_unpayable_rounds: bool = False
    last_trace: ClassVar[None] = None  # (its capacity search is over stale confidences: no Θ of this round)
    round_index: int = 0  # rounds scheduled so far
    _history: dict[str, deque] = field(default_factory=dict, repr=False)  # id -> deque[(round, c [n_r])], maxlen 2
    _population: deque = field(default_factory=lambda: deque(maxlen=2), repr=False)  # deque[(round, mean c [n])]

    def draft_lengths(self, *, request_ids, num_drafts, confidences=None, sps_table=None,
                      prefill_tokens=0, prefill_emitted=0) -> np.ndarray:
        n = _num_drafts(request_ids, num_drafts)  # [R]
        _require(confidences, sps_table, self.spec, sps=True)
        if len(set(request_ids)) != len(request_ids):
            raise ValueError(f"request_ids must be unique within a round, got {list(request_ids)}")
        c = np.asarray(confidences, dtype=np.float64)  # [R, γ], validated by schedule_async
        t = self.round_index
        borrowed = _newest_at_most(self._population, t - 2)  # [n] or empty
        stale_rows = [self._stale_row(rid, t, borrowed) for rid in request_ids]  # [R] of [n'_r]
        stale_n = np.array([len(row) for row in stale_rows], dtype=np.int64)  # [R]
        stale = np.zeros((len(request_ids), int(stale_n.max(initial=0))))  # [R, γ']
        for r, row in enumerate(stale_rows):
            stale[r, : len(row)] = row
        ell = schedule_async(
            confidences=c, stale_confidences=stale, sps_table=sps_table, num_drafts=n, stale_num_drafts=stale_n,
            prefill_tokens=prefill_tokens, prefill_emitted=prefill_emitted,
        )
        for r, rid in enumerate(request_ids):  # recorded only once the round's inputs passed validation
            self._history.setdefault(rid, deque(maxlen=2)).append((t, c[r, : n[r]].copy()))
        mean = _mean_row(c, n)  # [max n]
        if mean.size:
            self._population.append((t, mean))
        self.round_index = t + 1
        return ell

    def _stale_row(self, request_id: str, t: int, borrowed: np.ndarray) -> np.ndarray:
        """The request's newest confidences from a round ≤ t - 2, else the borrowed population row."""
        own = self._history.get(request_id, ())
        return _newest_at_most(own, t - 2) if _has_row_at_most(own, t - 2) else borrowed

    def remove_request(self, request_id: str) -> None:
        self._history.pop(request_id, None)


def _newest_at_most(rows, last_round: int) -> np.ndarray:
    """The newest row of `rows` (deque of (round, row)) from a round ≤ last_round, or an empty row."""
    for round_index, row in reversed(rows):
        if round_index <= last_round:
            return row
    return np.zeros(0)


def _has_row_at_most(rows, last_round: int) -> bool:
    return any(round_index <= last_round for round_index, _ in rows)


def _mean_row(c: np.ndarray, n: np.ndarray) -> np.ndarray:
    """Per-position mean of c [R, γ] over the requests that had a draft there. -> [max n]."""
    width = int(n.max(initial=0))
    if width == 0:
        return np.zeros(0)
    present = np.arange(width) < n[:, None]  # [R, width]
    return (c[:, :width] * present).sum(axis=0) / present.sum(axis=0)  # [width], every position has ≥ 1 request


def parse_policy(spec: str) -> Policy:
    """A fresh policy object from its spec: "none", "fixed:K", "threshold:C", "dspark" or "dspark-async"."""
    if not isinstance(spec, str):
        raise TypeError(f"a policy is given as a string, one of {', '.join(POLICY_FORMS)}; got {spec!r}")
    name, sep, arg = spec.strip().partition(":")
    name = name.strip().lower()
    arg = arg.strip()
    if name in ("none", "dspark", "dspark-async"):
        if sep:
            raise ValueError(f"policy {name!r} takes no argument, got {spec!r}")
        return {"none": NonePolicy, "dspark": DSparkPolicy, "dspark-async": DSparkAsyncPolicy}[name]()
    if name == "fixed":
        try:
            k = int(arg)
        except ValueError:
            raise ValueError(f"fixed:K needs an integer K >= 0 (e.g. 'fixed:3'), got {spec!r}") from None
        return FixedPolicy(k)
    if name == "threshold":
        try:
            threshold = float(arg)
        except ValueError:
            raise ValueError(f"threshold:C needs a number 0 <= C <= 1 (e.g. 'threshold:0.5'), got {spec!r}") from None
        return ThresholdPolicy(threshold)
    raise ValueError(f"unknown policy {spec!r}; expected one of {', '.join(POLICY_FORMS)}")
