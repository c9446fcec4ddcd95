"""The hardware-aware prefix scheduler (docs/method.md §5, Algorithm 1) as pure functions.

This module owns the scheduler's math: given the calibrated confidences of this round's drafts
and the verifier's SPS(B) table, how many drafts ℓ_r each request sends to the verifier. It
holds no state; `dspark.scheduling.policies` wraps it (and the baselines) for the engine.

Notation (docs/method.md §2, §4, §5). R requests, up to γ drafts each; c_{r,j} is the
calibrated probability that draft x_{r,j} survives verification given x_{r,<j} survived, and
    a_{r,j} = Π_{i≤j} c_{r,i}                                  (survival of the prefix)
    τ*(ℓ)   = Σ_r (1 + Σ_{j≤ℓ_r} a_{r,j})                       (expected tokens this round)
    B(ℓ)    = Σ_r (1 + ℓ_r)                                     (tokens in the verifier batch)
    Θ(ℓ)    = τ*(ℓ) · SPS(B(ℓ))                                 (expected tokens per second)
Algorithm 1: start at ℓ = 0 (B = R, τ* = R: every request verifies its anchor), sort all
(r, j) with a_{r,j} > 0 by a descending, admit them one at a time while Θ rises and STOP at
the first candidate that does not raise it (the break).

Ties: candidates with equal a are taken in (r, j) ascending order. Because a_{r,j} is
non-increasing in j (c ≤ 1, and fl(a·c) ≤ a), the sorted list meets each request's drafts in
prefix order, so every prefix of it admits a prefix x_{r,1..ℓ_r} of each request.

Invariant (why the output stays lossless). c_{r,j} is computed from x_{r,<j} only (the
confidence head reads h_j and x_{j-1}, docs/method.md §2), so a_{r,j} does not depend on
x_{r,j} while a_{r,j+1} does. With the break, whether (r, j) is admitted is decided by the
candidates ranked above it -- other requests' candidates and r's own earlier positions
(r, <j), never (r, >j) -- plus a_{r,j}: the event {ℓ_r ≥ j} never depends on the realisation of x_{r,j}, i.e. ℓ_r is a
stopping time of the draft sequence, and rejection sampling of the admitted prefix is exact.
A search without the break (the argmax of Θ over all prefix lengths, `schedule_full_search`)
looks at a_{r,j+1} when deciding on x_{r,j} and is biased: docs/method.md §5.4's counterexample
outputs A with probability 0.85 instead of 0.7 (reproduced in tests/scheduling).

Asynchronous variant (`schedule_async`, docs/method.md §5.5): the
capacity K (how many drafts fit) comes from a full search over confidences that are two
rounds old; this round's candidates are ranked by their current a and the top K admitted.
Exactness argument: K is fixed before this round's drafts exist, and the rank of (r, j) in the
current list depends only on a_{r,≤j} and other requests' values (prefix order again), so
{ℓ_r ≥ j} still does not depend on x_{r,j}. Limits: the paper proves only the synchronous
version; the argument needs (i) K computed from information fixed before this round's drafts
are sampled, (ii) requests drafted independently of each other (no cross-request coupling of
samples or confidences within a round), (iii) a tie rule that respects prefix order. It says
nothing about optimality: a stale K can be too large or too small for the current round.

Prefills in the same forward. A round that also prefills new requests verifies P more tokens
and emits E more (one per prefilled request) whatever the drafts: B counts every token of the
forward and τ* every token emitted, so with `prefill_tokens=P, prefill_emitted=E`
    τ*(ℓ) = E + Σ_r (1 + Σ_{j≤ℓ_r} a_{r,j}),   B(ℓ) = P + Σ_r (1 + ℓ_r)
(P = E = 0 is Algorithm 1 as written). The prefills are fixed before the drafts are sampled, so
the invariant above is untouched. They move the batch along the SPS curve: a few prefill tokens
take free slots of the memory-bound part (fewer drafts ride for free), a long prefill makes the
step long anyway (a draft then costs only 1/B of it, and more drafts pay).

The SPS table. `sps_table[B-1]` = SPS(B) for B = 1..B_max, and B_max = len(sps_table) is the
largest admissible batch: the schedulers never build a batch beyond it (no extrapolation
here). Pass `np.asarray(profile.table(upto=R * (1 + γ)))` to extrapolate as `SPSProfile`
does (step time ∝ B beyond the last measured point), or a shorter table to cap the batch
(e.g. a verifier token budget). A table shorter than R (the anchors alone) is a ValueError.

Host-side numpy: ℓ sets the shapes of the verifier batch, so the decision is needed on the
host, where the drafter's confidences arrive anyway. Arrays may be numpy arrays, sequences or
CPU torch tensors (R, γ as given; unavailable positions padded with 0 or masked by
num_drafts); convert the SPS table to a float64 array once (converting a Python list of
thousands of floats costs more than a schedule). Cost: benchmarks/bench_scheduler.py.

Entry points: `schedule` (Algorithm 1, vectorised), `schedule_reference` (plain loops, its
definition), `schedule_full_search` (no break: NOT lossless, for capacities and tests),
`schedule_async`, `admit_top_k`, `throughput_objective`, `brute_force_optimum`, and
`any_draft_can_pay` (whether any draft could be admitted at all, asked before drafting). The `_with_trace`
forms of the first two also return a `ScheduleTrace`: the Θ after each admission and where and
why the admissions stopped, what the scheduler computed anyway (the round view shows it).
Run `python -m pytest tests/scheduling -q` and `python benchmarks/bench_scheduler.py`.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

ArrayLike = Any  # np.ndarray | Sequence | CPU torch.Tensor

_FIRST_WINDOW = 128  # candidates ranked in the first pass of `schedule` (grown x8 while Θ still rises)


@dataclass(frozen=True)
class ScheduleTrace:
    """What Algorithm 1 computed on its way to ℓ: Θ after each admission, where and why it stopped.

    Candidates are ranked as in the module docstring; admitting the k best gives B = base_batch + k."""

    thetas: np.ndarray  # [admitted + 1], [admitted + 2] after a break: Θ_k for k = 0..admitted (+ the declined one)
    base_batch: int  # P + R: B with no draft admitted (prefill tokens and anchors)
    admitted: int  # Σ_r ℓ_r: candidates admitted
    stop: Literal["break", "candidates", "table"]  # the next candidate did not raise Θ | none was left | B_max reached
    break_candidate: tuple[int, int] | None  # (r, j), j 1-based: the candidate the break declined; None unless "break"

    @property
    def batch_size(self) -> int:
        """B of the chosen ℓ."""
        return self.base_batch + self.admitted

    @property
    def theta(self) -> float:
        """Θ of the chosen ℓ: expected tokens per second."""
        return float(self.thetas[self.admitted])


# ---------------------------------------------------------------------------------------------
# Validation at the boundary
# ---------------------------------------------------------------------------------------------


def _as_inputs(confidences: ArrayLike, num_drafts: ArrayLike | None, sps_table: ArrayLike | None, prefill_tokens: int = 0):
    """Validated (c [R, γ] float64, n [R] int64, sps [B_max] float64 or None)."""
    c = np.asarray(confidences, dtype=np.float64)  # [R, γ]
    if c.ndim != 2:
        raise ValueError(f"confidences must have shape [num_requests, gamma], got shape {c.shape}")
    if c.size and not (np.all(c >= 0.0) and np.all(c <= 1.0)):  # also rejects NaN
        bad = c[~((c >= 0.0) & (c <= 1.0))]
        raise ValueError(f"confidences must lie in [0, 1] (pad unavailable positions with 0), got {bad[:5].tolist()}")
    num_requests, gamma = c.shape
    if num_drafts is None:
        n = np.full(num_requests, gamma, dtype=np.int64)  # [R]
    else:
        n_raw = np.asarray(num_drafts)
        if n_raw.shape != (num_requests,):
            raise ValueError(f"num_drafts must have shape [{num_requests}] (one per request), got shape {n_raw.shape}")
        if n_raw.size and not np.issubdtype(n_raw.dtype, np.integer):
            raise ValueError(f"num_drafts must be integers, got dtype {n_raw.dtype}")
        n = n_raw.astype(np.int64)  # [R]
        if n.size and (n.min() < 0 or n.max() > gamma):
            raise ValueError(f"num_drafts must lie in [0, gamma={gamma}], got min {n.min()} max {n.max()}")
    if sps_table is None:
        return c, n, None
    sps = np.asarray(sps_table, dtype=np.float64)  # [B_max], sps[B-1] = SPS(B)
    if sps.ndim != 1 or sps.size == 0:
        raise ValueError(f"sps_table must be a non-empty 1-D table (sps[B-1] = SPS(B)), got shape {sps.shape}")
    if not (np.all(np.isfinite(sps)) and np.all(sps > 0.0)):
        raise ValueError(f"sps_table must be finite and positive, got min {np.nanmin(sps)}")
    if sps.size < num_requests + prefill_tokens:
        raise ValueError(
            f"sps_table covers B up to {sps.size}, but the {num_requests} anchors and {prefill_tokens} prefill tokens alone "
            f"need B = {num_requests + prefill_tokens}; pass a longer table, e.g. profile.table(upto=P + R * (1 + gamma))"
        )
    return c, n, sps


def _check_prefill(prefill_tokens: int, prefill_emitted: int) -> None:
    for name, value in (("prefill_tokens", prefill_tokens), ("prefill_emitted", prefill_emitted)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
            raise ValueError(f"{name} must be an integer >= 0, got {value!r}")
    if prefill_emitted > prefill_tokens:
        raise ValueError(f"prefill_emitted ({prefill_emitted}) cannot exceed prefill_tokens ({prefill_tokens}): one token per prefill at most")


def survival_products(*, confidences: ArrayLike, num_drafts: ArrayLike | None = None) -> np.ndarray:
    """a_{r,j} = Π_{i≤j} c_{r,i} (docs/method.md §4, §5.1), zero at positions j ≥ num_drafts[r]. -> [R, γ] float64."""
    c, n, _ = _as_inputs(confidences, num_drafts, None)
    return _survival(c, n)


def _survival(c: np.ndarray, n: np.ndarray) -> np.ndarray:
    a = np.cumprod(c, axis=1)  # [R, γ], left to right: the same roundings as the reference loop
    a[np.arange(c.shape[1]) >= n[:, None]] = 0.0  # [R, γ] mask of unavailable positions
    return a


def any_draft_can_pay(*, num_requests: int, sps_table: ArrayLike, prefill_tokens: int = 0, prefill_emitted: int = 0) -> bool:
    """Whether Algorithm 1 (with the break) could admit any draft this round, whatever the drafts.

    Its first candidate has a ≤ 1, so Θ_1 = (τ*_0 + a) · SPS(B_0 + 1) ≤ (τ*_0 + 1) · SPS(B_0 + 1)
    with B_0 = P + R, τ*_0 = E + R; when even that bound does not exceed Θ_0 = τ*_0 · SPS(B_0)
    (or B_0 + 1 is beyond the table), the break stops at the first candidate and ℓ = 0 for every
    request. The engine then skips drafting altogether (no model forward, no lookups): on a
    verifier whose step grows in steps of several tokens (compact fp32 weights on a CPU: B = 5
    costs 1.4-1.7x B = 4) that is every round from a few concurrent requests on, where drafts
    could only cost. It reads R, P, E and the table only, never a draft: lossless."""
    _check_prefill(prefill_tokens, prefill_emitted)
    sps = np.asarray(sps_table, dtype=np.float64)  # [B_max]
    batch, tau = num_requests + prefill_tokens, float(num_requests + prefill_emitted)
    if num_requests == 0 or batch + 1 > sps.size:
        return False
    return (tau + 1.0) * float(sps[batch]) > tau * float(sps[batch - 1])


# ---------------------------------------------------------------------------------------------
# The reference: Algorithm 1 as written, plain Python loops
# ---------------------------------------------------------------------------------------------


def schedule_reference(
    *,
    confidences: ArrayLike,  # [R, γ] calibrated c_{r,j} in [0, 1]
    sps_table: ArrayLike,  # [B_max] SPS(B) at index B-1
    num_drafts: ArrayLike | None = None,  # [R] drafts available per request (default γ)
    stop_at_first_decline: bool = True,  # False: full search (argmax over all prefixes), NOT lossless
    prefill_tokens: int = 0,  # P: tokens of requests prefilled in the same forward
    prefill_emitted: int = 0,  # E: tokens those prefills emit
) -> np.ndarray:
    """Algorithm 1, one candidate at a time: the definition `schedule` is tested against.

    Returns ℓ [R] int64. With stop_at_first_decline=False it keeps scanning after Θ stops rising
    and returns the best prefix of the sorted list (first one on ties): the "full search".
    """
    return schedule_reference_with_trace(confidences=confidences, sps_table=sps_table, num_drafts=num_drafts,
                                         stop_at_first_decline=stop_at_first_decline, prefill_tokens=prefill_tokens,
                                         prefill_emitted=prefill_emitted)[0]


def schedule_reference_with_trace(
    *,
    confidences: ArrayLike,  # [R, γ]
    sps_table: ArrayLike,  # [B_max]
    num_drafts: ArrayLike | None = None,  # [R]
    stop_at_first_decline: bool = True,
    prefill_tokens: int = 0,
    prefill_emitted: int = 0,
) -> tuple[np.ndarray, ScheduleTrace]:
    """`schedule_reference` and its ScheduleTrace (the full search scans on: its trace has every Θ, no break)."""
    _check_prefill(prefill_tokens, prefill_emitted)
    c, n, sps = _as_inputs(confidences, num_drafts, sps_table, prefill_tokens)
    num_requests = c.shape[0]
    rows = c.tolist()
    table = sps.tolist()
    candidates = []  # (a, r, j) with j 1-based
    for r in range(num_requests):
        a = 1.0
        for j in range(int(n[r])):
            a = a * rows[r][j]
            if a > 0.0:
                candidates.append((a, r, j + 1))
    candidates.sort(key=lambda t: (-t[0], t[1], t[2]))

    ell = [0] * num_requests
    batch, tau = num_requests + prefill_tokens, float(num_requests + prefill_emitted)
    best = tau * table[batch - 1] if batch else 0.0
    best_count = 0
    thetas, stop, declined = [best], "candidates", None
    for count, (a, r, j) in enumerate(candidates, start=1):
        if batch + 1 > len(table):  # beyond the table: not admissible
            stop = "table"
            break
        tau = tau + a
        batch += 1
        theta = tau * table[batch - 1]
        thetas.append(theta)
        if theta > best:
            best, best_count = theta, count
        elif stop_at_first_decline:
            stop, declined = "break", (r, j)
            break
    for _, r, j in candidates[:best_count]:
        assert ell[r] == j - 1, "the sorted list must meet each request's drafts in prefix order"
        ell[r] = j
    trace = ScheduleTrace(thetas=np.array(thetas, dtype=np.float64), base_batch=num_requests + prefill_tokens,
                          admitted=best_count, stop=stop, break_candidate=declined)
    return np.array(ell, dtype=np.int64), trace


# ---------------------------------------------------------------------------------------------
# The vectorised fast path
# ---------------------------------------------------------------------------------------------


def _ranked(flat: np.ndarray, num_positive: int, m: int) -> np.ndarray:
    """Flat indices of the m best candidates, ranked by a descending then index ascending. -> [m].

    With m < num_positive, a partition finds the m-th largest value v and only the candidates
    with a ≥ v (all of them: ties at v included) are sorted; the stable sort over ascending
    indices applies the (r, j) ascending tie rule, so this is the first m of the global order.
    """
    if m == 0:
        return np.zeros(0, dtype=np.int64)
    if m < num_positive:
        v = np.partition(flat, flat.size - m)[flat.size - m]  # m-th largest, > 0
        idx = np.flatnonzero(flat >= v)  # [≥ m] ascending
    else:
        idx = np.flatnonzero(flat > 0.0)  # [num_positive] ascending
    # The bit patterns of non-negative float64s order as the values do, and equal values have
    # equal bits: a stable int64 sort of -bits is the same ranking, about 2x faster than on floats.
    keys = -flat[idx].view(np.int64)  # [len(idx)]
    return idx[np.argsort(keys, kind="stable")][:m]  # [m]


def _thetas(a_sorted: np.ndarray, num_requests: int, sps: np.ndarray, prefill_tokens: int = 0, prefill_emitted: int = 0) -> np.ndarray:
    """Θ_k for k = 0..m admitted candidates of the sorted list. -> [m + 1]."""
    tau = np.cumsum(np.concatenate(([float(num_requests + prefill_emitted)], a_sorted)))  # [m + 1] sequential sums, as the loop
    base = num_requests + prefill_tokens  # B with no draft admitted
    return tau * sps[base - 1 : base + a_sorted.size]  # [m + 1]


def _lengths(order: np.ndarray, num_requests: int, gamma: int) -> np.ndarray:
    """ℓ [R] from the admitted flat indices: by prefix order, ℓ_r = how many of r's were admitted."""
    return np.bincount(order // gamma, minlength=num_requests).astype(np.int64)


def schedule(
    *,
    confidences: ArrayLike,  # [R, γ] calibrated c_{r,j} in [0, 1]
    sps_table: ArrayLike,  # [B_max] SPS(B) at index B-1; B never exceeds B_max
    num_drafts: ArrayLike | None = None,  # [R] drafts available per request (default γ)
    prefill_tokens: int = 0,  # P: tokens of requests prefilled in the same forward
    prefill_emitted: int = 0,  # E: tokens those prefills emit
) -> np.ndarray:
    """Algorithm 1 (with the break), vectorised; equals `schedule_reference` exactly. -> ℓ [R] int64.

    Cumulative products give a; the candidates are ranked once (a descending, (r, j) ascending);
    cumulative sums of the ranked a give τ* for every prefix length k, Θ_k = τ*_k · SPS(P + R + k);
    the number admitted is the first k where Θ_{k+1} ≤ Θ_k (the break). Only a window of the
    best candidates is ranked at first (a partition, not a full sort); the window grows x8 while
    Θ is still rising at its end, so the result is that of one global sort.
    """
    return schedule_with_trace(confidences=confidences, sps_table=sps_table, num_drafts=num_drafts,
                               prefill_tokens=prefill_tokens, prefill_emitted=prefill_emitted)[0]


def schedule_with_trace(
    *,
    confidences: ArrayLike,  # [R, γ]
    sps_table: ArrayLike,  # [B_max]
    num_drafts: ArrayLike | None = None,  # [R]
    prefill_tokens: int = 0,
    prefill_emitted: int = 0,
) -> tuple[np.ndarray, ScheduleTrace]:
    """`schedule` and its ScheduleTrace (a view of the Θ it computed: no extra work); both equal
    `schedule_reference_with_trace` exactly."""
    _check_prefill(prefill_tokens, prefill_emitted)
    c, n, sps = _as_inputs(confidences, num_drafts, sps_table, prefill_tokens)
    num_requests, gamma = c.shape
    base = num_requests + prefill_tokens

    def trace(thetas: np.ndarray, admitted: int, stop: str, declined: int | None = None) -> ScheduleTrace:
        candidate = None if declined is None else (int(declined) // gamma, int(declined) % gamma + 1)
        return ScheduleTrace(thetas=thetas, base_batch=base, admitted=admitted, stop=stop, break_candidate=candidate)

    if num_requests == 0 or gamma == 0:
        return np.zeros(num_requests, dtype=np.int64), empty_schedule_trace(
            num_requests=num_requests, sps_table=sps, prefill_tokens=prefill_tokens, prefill_emitted=prefill_emitted)
    flat = _survival(c, n).ravel()  # [R·γ]
    num_positive = int(np.count_nonzero(flat))
    limit = min(num_positive, sps.size - base)  # candidates that fit in the table
    m = min(limit, _FIRST_WINDOW)
    while True:
        order = _ranked(flat, num_positive, m)  # [m]
        thetas = _thetas(flat[order], num_requests, sps, prefill_tokens, prefill_emitted)  # [m + 1]
        rises = np.diff(thetas) > 0.0  # [m]: Θ_{k+1} > Θ_k
        if not rises.all():
            count = int(np.argmin(rises))  # first decline
            return _lengths(order[:count], num_requests, gamma), trace(thetas[: count + 2], count, "break", order[count])
        if m == limit:
            return _lengths(order, num_requests, gamma), trace(thetas, m, "table" if limit < num_positive else "candidates")
        m = min(limit, 8 * m)


def empty_schedule_trace(*, num_requests: int, sps_table: ArrayLike, prefill_tokens: int = 0,
                         prefill_emitted: int = 0) -> ScheduleTrace:
    """The trace of a round with no candidate (every ℓ_r = 0): Θ_0 = (R + E)·SPS(R + P) only, as
    `schedule_with_trace` gives it without being called (the engine's rounds the draft gate skipped)."""
    sps = np.asarray(sps_table, dtype=np.float64)  # [B_max], sps[B-1] = SPS(B)
    base = num_requests + prefill_tokens
    theta0 = np.array([float(num_requests + prefill_emitted) * sps[min(base, sps.size) - 1] if base else 0.0])  # [1]
    return ScheduleTrace(thetas=theta0, base_batch=base, admitted=0, stop="candidates", break_candidate=None)


def schedule_full_search(
    *,
    confidences: ArrayLike,  # [R, γ]
    sps_table: ArrayLike,  # [B_max]
    num_drafts: ArrayLike | None = None,  # [R]
    prefill_tokens: int = 0,  # P: tokens of requests prefilled in the same forward
    prefill_emitted: int = 0,  # E: tokens those prefills emit
) -> np.ndarray:
    """The argmax of Θ over ALL prefix lengths of the sorted list (no break). -> ℓ [R] int64.

    NOT lossless when fed this round's confidences (see the module docstring); it is the
    capacity search of the async variant on stale confidences, and the biased baseline of the
    counterexample test. Equals `schedule_reference(stop_at_first_decline=False)` exactly and
    `brute_force_optimum` in value (for a fixed B the best ℓ is the top B - R candidates).
    """
    _check_prefill(prefill_tokens, prefill_emitted)
    c, n, sps = _as_inputs(confidences, num_drafts, sps_table, prefill_tokens)
    num_requests, gamma = c.shape
    if num_requests == 0 or gamma == 0:
        return np.zeros(num_requests, dtype=np.int64)
    order, count = _full_search(_survival(c, n), sps, prefill_tokens, prefill_emitted)
    return _lengths(order[:count], num_requests, gamma)


def _full_search(a: np.ndarray, sps: np.ndarray, prefill_tokens: int = 0, prefill_emitted: int = 0) -> tuple[np.ndarray, int]:
    """(ranked flat indices [m], argmax_k Θ_k): the best prefix length of the sorted list."""
    num_requests = a.shape[0]
    flat = a.ravel()  # [R·γ]
    num_positive = int(np.count_nonzero(flat))
    order = _ranked(flat, num_positive, min(num_positive, sps.size - num_requests - prefill_tokens))  # [m]
    thetas = _thetas(flat[order], num_requests, sps, prefill_tokens, prefill_emitted)  # [m + 1]
    return order, int(np.argmax(thetas))  # first maximum on ties


# ---------------------------------------------------------------------------------------------
# The asynchronous production variant
# ---------------------------------------------------------------------------------------------


def full_search_capacity(
    *,
    confidences: ArrayLike,  # [R, γ'] confidences two rounds old, rows aligned with this round's requests
    sps_table: ArrayLike,  # [B_max]
    num_drafts: ArrayLike | None = None,  # [R] drafts they had (0 for a request with no such round)
    prefill_tokens: int = 0,  # P: tokens of requests prefilled in the same forward
    prefill_emitted: int = 0,  # E: tokens those prefills emit
) -> int:
    """K = how many draft tokens fit, by a full search (no break) over stale confidences.

    The break is not needed here: these confidences cannot depend on this round's drafts."""
    _check_prefill(prefill_tokens, prefill_emitted)
    c, n, sps = _as_inputs(confidences, num_drafts, sps_table, prefill_tokens)
    if c.shape[0] == 0 or c.shape[1] == 0:
        return 0
    return _full_search(_survival(c, n), sps, prefill_tokens, prefill_emitted)[1]


def admit_top_k(
    *,
    confidences: ArrayLike,  # [R, γ] this round's calibrated confidences
    capacity: int,  # K, fixed before this round's drafts were sampled
    num_drafts: ArrayLike | None = None,  # [R]
) -> np.ndarray:
    """Dynamic top-K: the K best candidates by current a (ties (r, j) ascending). -> ℓ [R] int64.

    Fewer than K when fewer candidates have a > 0."""
    if isinstance(capacity, bool) or not isinstance(capacity, (int, np.integer)) or capacity < 0:
        raise ValueError(f"capacity must be an integer >= 0, got {capacity!r}")
    c, n, _ = _as_inputs(confidences, num_drafts, None)
    num_requests, gamma = c.shape
    if num_requests == 0 or gamma == 0:
        return np.zeros(num_requests, dtype=np.int64)
    flat = _survival(c, n).ravel()  # [R·γ]
    num_positive = int(np.count_nonzero(flat))
    return _lengths(_ranked(flat, num_positive, min(int(capacity), num_positive)), num_requests, gamma)


def schedule_async(
    *,
    confidences: ArrayLike,  # [R, γ] this round's calibrated confidences
    stale_confidences: ArrayLike,  # [R, γ'] the same requests' confidences two rounds earlier
    sps_table: ArrayLike,  # [B_max]
    num_drafts: ArrayLike | None = None,  # [R]
    stale_num_drafts: ArrayLike | None = None,  # [R] (0 for a request that has no round that old)
    prefill_tokens: int = 0,  # P: tokens of requests prefilled in the same forward
    prefill_emitted: int = 0,  # E: tokens those prefills emit
) -> np.ndarray:
    """The async variant: K from the stale full search, then dynamic top-K now. -> ℓ [R] int64.

    K is capped so that B = P + R + K stays within the table (P and R are known before drafting);
    the stale search sees this round's prefills (known before its drafts are sampled)."""
    _check_prefill(prefill_tokens, prefill_emitted)
    c, n, sps = _as_inputs(confidences, num_drafts, sps_table, prefill_tokens)
    stale = np.asarray(stale_confidences, dtype=np.float64)
    if stale.ndim != 2 or stale.shape[0] != c.shape[0]:
        raise ValueError(
            f"stale_confidences must have shape [{c.shape[0]}, gamma'] (rows aligned with this round's requests), "
            f"got shape {stale.shape}"
        )
    k = full_search_capacity(confidences=stale, sps_table=sps, num_drafts=stale_num_drafts,
                             prefill_tokens=prefill_tokens, prefill_emitted=prefill_emitted)
    return admit_top_k(confidences=c, capacity=min(k, sps.size - c.shape[0] - prefill_tokens), num_drafts=n)


# ---------------------------------------------------------------------------------------------
# The objective and its brute-force optimum (tests, diagnostics)
# ---------------------------------------------------------------------------------------------


def throughput_objective(
    *,
    confidences: ArrayLike,  # [R, γ]
    draft_lengths: ArrayLike,  # [R] ℓ
    sps_table: ArrayLike,  # [B_max]
    num_drafts: ArrayLike | None = None,  # [R]
    prefill_tokens: int = 0,  # P: tokens of requests prefilled in the same forward
    prefill_emitted: int = 0,  # E: tokens those prefills emit
) -> float:
    """Θ(ℓ) = (E + Σ_r (1 + Σ_{j≤ℓ_r} a_{r,j})) · SPS(P + Σ_r (1 + ℓ_r)), expected tokens per second."""
    _check_prefill(prefill_tokens, prefill_emitted)
    c, n, sps = _as_inputs(confidences, num_drafts, sps_table, prefill_tokens)
    ell = np.asarray(draft_lengths, dtype=np.int64)  # [R]
    if ell.shape != n.shape or np.any(ell < 0) or np.any(ell > n):
        raise ValueError(f"draft_lengths must have shape {n.shape} with 0 <= ℓ_r <= num_drafts_r, got {ell.tolist()}")
    batch = int(ell.sum()) + c.shape[0] + prefill_tokens
    if batch > sps.size:
        raise ValueError(f"draft_lengths give B = {batch}, beyond the sps_table (B_max = {sps.size})")
    a = _survival(c, n)  # [R, γ]
    taken = np.arange(c.shape[1]) < ell[:, None]  # [R, γ]
    return float((c.shape[0] + prefill_emitted + a[taken].sum()) * sps[batch - 1])


def brute_force_optimum(
    *,
    confidences: ArrayLike,  # [R, γ], tiny
    sps_table: ArrayLike,  # [B_max]
    num_drafts: ArrayLike | None = None,  # [R]
    prefill_tokens: int = 0,  # P: tokens of requests prefilled in the same forward
    prefill_emitted: int = 0,  # E: tokens those prefills emit
) -> tuple[np.ndarray, float]:
    """(ℓ, Θ(ℓ)) maximising Θ over every prefix vector 0 ≤ ℓ_r ≤ num_drafts_r with B ≤ B_max.

    Π_r (1 + num_drafts_r) evaluations: for R, γ of a few only. First maximum on ties."""
    _check_prefill(prefill_tokens, prefill_emitted)
    c, n, sps = _as_inputs(confidences, num_drafts, sps_table, prefill_tokens)
    best_ell, best = None, -1.0
    for ell in itertools.product(*(range(int(k) + 1) for k in n)):
        if sum(ell) + c.shape[0] + prefill_tokens > sps.size:
            continue
        theta = throughput_objective(confidences=c, draft_lengths=ell, sps_table=sps, num_drafts=n,
                                     prefill_tokens=prefill_tokens, prefill_emitted=prefill_emitted)
        if theta > best:
            best_ell, best = ell, theta
    return np.array(best_ell, dtype=np.int64), best
