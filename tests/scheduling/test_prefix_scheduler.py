"""The prefix scheduler: fast path == reference, optimality where it holds, the table cap, the
async variant, and losslessness (the paper's counterexample, simulated round by round).

Random cases are seeded. "Exactly equal" means the same ℓ vector: the vectorised pass does the
same floating-point operations in the same order as the reference loop (left-to-right cumprod,
sequential cumsum), so even ties and near-ties must come out identical.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import binomtest, chisquare

from dspark.scheduling.prefix_scheduler import (
    admit_top_k,
    any_draft_can_pay,
    brute_force_optimum,
    empty_schedule_trace,
    full_search_capacity,
    schedule,
    schedule_async,
    schedule_full_search,
    schedule_reference,
    schedule_reference_with_trace,
    schedule_with_trace,
    survival_products,
    throughput_objective,
)

# ---------------------------------------------------------------------------------------------
# Random inputs
# ---------------------------------------------------------------------------------------------

CONFIDENCE_KINDS = ("uniform", "high", "ties", "zeros")
SPS_KINDS = ("roofline", "linear", "step", "flat", "noisy")


def random_confidences(rng: np.random.Generator, num_requests: int, gamma: int, kind: str) -> np.ndarray:  # [R, γ]
    shape = (num_requests, gamma)
    if kind == "uniform":
        return rng.random(shape)
    if kind == "high":  # realistic: most confidences near 1
        return 1.0 - rng.random(shape) ** 3 * 0.6
    if kind == "ties":  # dyadic values: products are exact, so equal a's (ties) are common
        return rng.choice([0.0, 0.5, 0.75, 1.0, 1.0], size=shape)
    if kind == "zeros":
        return np.where(rng.random(shape) < 0.3, 0.0, rng.random(shape))
    raise AssertionError(kind)


def random_num_drafts(rng: np.random.Generator, num_requests: int, gamma: int) -> np.ndarray | None:  # [R]
    return None if rng.random() < 0.4 else rng.integers(0, gamma + 1, num_requests)


def random_sps_table(rng: np.random.Generator, b_max: int, kind: str) -> np.ndarray:  # [b_max]
    b = np.arange(1, b_max + 1, dtype=np.float64)  # [b_max]
    if kind == "roofline":  # memory-bound until the knee, then compute-bound
        step_time = np.maximum(1.0, b / rng.uniform(1, 64))
    elif kind == "linear":
        step_time = 1.0 + rng.uniform(0.001, 0.5) * b
    elif kind == "step":  # what real profiles look like: plateaus and jumps
        step_time = 1.0 + np.floor(b / rng.integers(1, 16)) * rng.uniform(0.05, 1.0)
    elif kind == "flat":  # Θ rises with every admission: everything that fits is admitted
        step_time = np.ones_like(b)
    elif kind == "noisy":  # not even monotone
        step_time = rng.uniform(0.5, 2.0, b_max)
    else:
        raise AssertionError(kind)
    return 1.0 / step_time


def random_case(rng: np.random.Generator, num_requests: int, gamma: int) -> dict:
    full = num_requests * (1 + gamma)
    b_max = full if rng.random() < 0.6 else int(rng.integers(num_requests, full + 1))  # sometimes the table caps B
    return {
        "confidences": random_confidences(rng, num_requests, gamma, str(rng.choice(CONFIDENCE_KINDS))),
        "num_drafts": random_num_drafts(rng, num_requests, gamma),
        "sps_table": random_sps_table(rng, b_max, str(rng.choice(SPS_KINDS))),
    }


def sizes(rng: np.random.Generator, count: int) -> list[tuple[int, int]]:
    """(R, γ): the corners (R = 1, γ = 1), many small cases, a few up to R = 512, γ = 16."""
    fixed = [(1, 1), (1, 16), (512, 1), (512, 16), (128, 7), (2, 2)]
    small = [(int(rng.integers(1, 9)), int(rng.integers(1, 9))) for _ in range(count)]
    large = [(int(rng.choice([32, 128, 256, 512])), int(rng.integers(1, 17))) for _ in range(count // 20)]
    return fixed + small + large


# ---------------------------------------------------------------------------------------------
# Vectorised == reference
# ---------------------------------------------------------------------------------------------


def test_vectorised_schedule_equals_the_reference_exactly_on_random_inputs():
    rng = np.random.default_rng(0)
    admitted_somewhere = 0
    for num_requests, gamma in sizes(rng, 600):
        case = random_case(rng, num_requests, gamma)
        fast = schedule(**case)
        ref = schedule_reference(**case)
        assert fast.dtype == np.int64 and fast.shape == (num_requests,)
        np.testing.assert_array_equal(fast, ref, err_msg=f"R={num_requests} gamma={gamma}")
        admitted_somewhere += int(fast.sum() > 0)
    assert admitted_somewhere > 100  # not vacuous: most cases admit drafts


def test_vectorised_full_search_equals_the_reference_without_the_break():
    rng = np.random.default_rng(1)
    for num_requests, gamma in sizes(rng, 300):
        case = random_case(rng, num_requests, gamma)
        np.testing.assert_array_equal(
            schedule_full_search(**case), schedule_reference(**case, stop_at_first_decline=False)
        )


def assert_same_trace(fast, ref, msg: str = "") -> None:
    np.testing.assert_array_equal(fast.thetas, ref.thetas, err_msg=msg)  # the same float operations: bit for bit
    assert (fast.base_batch, fast.admitted, fast.stop, fast.break_candidate) == (
        ref.base_batch, ref.admitted, ref.stop, ref.break_candidate), msg


def test_the_vectorised_trace_equals_the_reference_trace_and_describes_the_chosen_lengths():
    rng = np.random.default_rng(3)
    stops = set()
    for num_requests, gamma in sizes(rng, 300):
        case = random_case(rng, num_requests, gamma)
        if rng.random() < 0.3:
            case = with_prefills(rng, case)
        (fast_ell, fast), (ref_ell, ref) = schedule_with_trace(**case), schedule_reference_with_trace(**case)
        msg = f"R={num_requests} gamma={gamma}"
        np.testing.assert_array_equal(fast_ell, ref_ell, err_msg=msg)
        assert_same_trace(fast, ref, msg)
        stops.add(fast.stop)
        # the trace is the chosen ℓ's: Σℓ admitted, B = P + R + Σℓ, Θ = τ*·SPS(B) of that ℓ
        assert fast.admitted == int(fast_ell.sum()) and fast.batch_size == case.get("prefill_tokens", 0) + num_requests + fast.admitted
        assert fast.theta == pytest.approx(throughput_objective(draft_lengths=fast_ell, **case), rel=1e-12)
        assert len(fast.thetas) == fast.admitted + 1 + (fast.stop == "break")
        assert np.all(np.diff(fast.thetas[: fast.admitted + 1]) > 0)  # Θ rose with every admission
        if fast.stop == "break":  # the declined candidate: the next draft of its request, and Θ did not rise
            r, j = fast.break_candidate
            assert j == fast_ell[r] + 1 and fast.thetas[-1] <= fast.thetas[-2]
    assert stops == {"break", "candidates", "table"}  # every way of stopping was seen


def test_the_trace_of_a_large_batch_past_the_first_window_equals_the_reference():
    rng = np.random.default_rng(4)
    c = random_confidences(rng, 512, 16, "high")
    table = random_sps_table(rng, 512 * 17, "roofline")
    assert_same_trace(schedule_with_trace(confidences=c, sps_table=table)[1],
                      schedule_reference_with_trace(confidences=c, sps_table=table)[1])


@pytest.mark.parametrize("sps_kind", SPS_KINDS)
def test_large_batches_past_the_first_ranking_window_match_the_reference(sps_kind):
    # R = 512, γ = 16: 8192 candidates, far more than the first window `schedule` ranks.
    rng = np.random.default_rng(2)
    c = random_confidences(rng, 512, 16, "high")
    table = random_sps_table(rng, 512 * 17, sps_kind)
    np.testing.assert_array_equal(schedule(confidences=c, sps_table=table), schedule_reference(confidences=c, sps_table=table))
    if sps_kind == "flat":
        assert schedule(confidences=c, sps_table=table).sum() == np.count_nonzero(c)  # everything positive fits


def test_ties_are_taken_in_request_then_position_order():
    # All a = 1: room for 3 drafts goes to request 0's prefix first, then request 1's.
    c = np.ones((2, 3))
    table = np.ones(5)  # B ≤ 5 = 2 anchors + 3 drafts; flat SPS: every admission raises Θ
    np.testing.assert_array_equal(schedule(confidences=c, sps_table=table), [3, 0])
    np.testing.assert_array_equal(schedule_reference(confidences=c, sps_table=table), [3, 0])
    np.testing.assert_array_equal(admit_top_k(confidences=c, capacity=4), [3, 1])


def test_zero_confidence_positions_and_requests_without_drafts_are_never_admitted():
    c = np.array([[0.9, 0.0, 0.9], [0.9, 0.9, 0.9], [1.0, 1.0, 1.0]])
    table = np.ones(9)  # flat: admit every candidate with a > 0
    np.testing.assert_array_equal(schedule(confidences=c, sps_table=table, num_drafts=[3, 0, 2]), [1, 0, 2])


def test_degenerate_shapes():
    table = np.ones(4)
    assert schedule(confidences=np.zeros((0, 3)), sps_table=table).shape == (0,)
    np.testing.assert_array_equal(schedule(confidences=np.zeros((2, 0)), sps_table=table), [0, 0])
    np.testing.assert_array_equal(schedule(confidences=np.zeros((2, 3)), sps_table=table), [0, 0])


def test_accepts_cpu_torch_tensors_and_lists():
    c = torch.tensor([[0.9, 0.8], [0.7, 0.1]], dtype=torch.float32)
    table = [1.0, 0.9, 0.85, 0.8, 0.5, 0.3]
    expected = schedule_reference(confidences=c.numpy(), sps_table=np.array(table))
    np.testing.assert_array_equal(schedule(confidences=c, sps_table=table, num_drafts=torch.tensor([2, 2])), expected)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"confidences": [0.5, 0.5]}, "shape \\[num_requests, gamma\\]"),
        ({"confidences": [[0.5, 1.5]]}, "\\[0, 1\\]"),
        ({"confidences": [[0.5, float("nan")]]}, "\\[0, 1\\]"),
        ({"confidences": [[0.5, 0.5]], "num_drafts": [1, 1]}, "num_drafts must have shape \\[1\\]"),
        ({"confidences": [[0.5, 0.5]], "num_drafts": [3]}, "\\[0, gamma=2\\]"),
        ({"confidences": [[0.5, 0.5]], "num_drafts": [1.0]}, "integers"),
        ({"confidences": [[0.5]] * 3, "sps_table": [1.0, 1.0]}, "alone need B = 3"),
        ({"confidences": [[0.5]], "sps_table": [1.0, 0.0]}, "finite and positive"),
        ({"confidences": [[0.5]], "sps_table": []}, "non-empty"),
    ],
)
def test_invalid_inputs_raise_value_errors_that_say_what_was_got(kwargs, message):
    kwargs = {"sps_table": [1.0, 0.9, 0.8], **kwargs}
    for fn in (schedule, schedule_reference, schedule_full_search):
        with pytest.raises(ValueError, match=message):
            fn(**kwargs)


# ---------------------------------------------------------------------------------------------
# The SPS table bounds B
# ---------------------------------------------------------------------------------------------


def test_the_batch_never_exceeds_the_sps_table():
    rng = np.random.default_rng(3)
    capped = 0
    for num_requests, gamma in sizes(rng, 300):
        case = random_case(rng, num_requests, gamma)
        b_max = len(case["sps_table"])
        for ell in (schedule(**case), schedule_full_search(**case)):
            assert num_requests + ell.sum() <= b_max
        stale = random_confidences(rng, num_requests, gamma, "high")
        ell = schedule_async(stale_confidences=stale, **case)
        assert num_requests + ell.sum() <= b_max
        capped += int(b_max < num_requests * (1 + gamma))
    assert capped > 50


def test_a_flat_profile_fills_the_table_exactly():
    c = np.full((4, 8), 0.9)
    for b_max in (4, 5, 17, 36):
        table = np.ones(b_max)
        assert 4 + schedule(confidences=c, sps_table=table).sum() == b_max


# ---------------------------------------------------------------------------------------------
# Optimality: Algorithm 1 == brute force where Θ is unimodal along the sorted order
# ---------------------------------------------------------------------------------------------


def thetas_along_sorted_order(c: np.ndarray, table: np.ndarray, num_drafts=None) -> np.ndarray:  # [m + 1]
    """Θ_k for k = 0..m admissions of the sorted candidate list, computed independently."""
    a = survival_products(confidences=c, num_drafts=num_drafts)  # [R, γ]
    ranked = np.sort(a[a > 0])[::-1][: len(table) - c.shape[0]]  # [m]
    tau = c.shape[0] + np.concatenate(([0.0], np.cumsum(ranked)))  # [m + 1]
    return tau * table[c.shape[0] - 1 : c.shape[0] + ranked.size]


def is_unimodal(theta: np.ndarray) -> bool:
    """Strictly rising up to the first non-improvement, non-increasing after it."""
    steps = np.diff(theta)
    peak = int(np.argmin(steps > 0)) if not np.all(steps > 0) else steps.size
    return bool(np.all(steps[:peak] > 0) and np.all(steps[peak:] <= 0))


def test_algorithm_1_finds_the_brute_force_optimum_when_theta_is_unimodal():
    """Unimodality by construction: for a fixed B the best ℓ is the top B - R candidates, so the
    optimum is max_k Θ_k with Θ_k = τ_k / t(R + k) along the sorted list. τ_k is increasing and
    concave in k (increments a sorted descending); the step time t(B) = t0 + t1·B + max(t_mem,
    t_tok·B) is positive, increasing and convex (an affine cost plus a roofline). Then
    {k : Θ_k ≥ α} = {k : τ_k - α·t(R+k) ≥ 0} is a superlevel set of a concave function, an
    interval: Θ_k is quasi-concave, so it rises then falls and the first non-improvement (the
    break) is the global maximum. Floating-point plateaus could still break strictness, so each
    case is also checked with `is_unimodal`; the few that fail it are counted, not tested.
    """
    rng = np.random.default_rng(4)
    tested = 0
    for _ in range(400):
        num_requests, gamma = int(rng.integers(1, 4)), int(rng.integers(1, 4))
        c = random_confidences(rng, num_requests, gamma, str(rng.choice(["uniform", "high", "zeros"])))
        num_drafts = random_num_drafts(rng, num_requests, gamma)
        b = np.arange(1, num_requests * (1 + gamma) + 1, dtype=np.float64)
        t0, t1 = rng.uniform(0.0, 1.0), rng.uniform(0.0, 0.3)
        t_mem, t_tok = rng.uniform(0.1, 2.0), rng.uniform(0.01, 0.5)
        table = 1.0 / (t0 + t1 * b + np.maximum(t_mem, t_tok * b))  # [B_max]
        if not is_unimodal(thetas_along_sorted_order(c, table, num_drafts)):
            continue
        tested += 1
        ell = schedule(confidences=c, sps_table=table, num_drafts=num_drafts)
        _, best = brute_force_optimum(confidences=c, sps_table=table, num_drafts=num_drafts)
        got = throughput_objective(confidences=c, draft_lengths=ell, sps_table=table, num_drafts=num_drafts)
        assert got == pytest.approx(best, rel=1e-12), (c, table, ell)
    assert tested >= 380  # the construction makes nearly every case unimodal


def test_the_full_search_is_the_brute_force_optimum_for_any_non_increasing_profile():
    # For a fixed B the top B - R candidates maximise τ*, so the argmax over prefixes of the
    # sorted list is the global optimum even for step-shaped SPS curves. (A non-monotone curve
    # can make padding with a = 0 drafts pay off, which no scheduler here does.)
    rng = np.random.default_rng(5)
    for _ in range(300):
        num_requests, gamma = int(rng.integers(1, 4)), int(rng.integers(1, 4))
        case = random_case(rng, num_requests, gamma)
        case["sps_table"] = np.minimum.accumulate(case["sps_table"])  # [B_max] made non-increasing
        _, best = brute_force_optimum(**case)
        got = throughput_objective(draft_lengths=schedule_full_search(**case), **case)
        assert got == pytest.approx(best, rel=1e-12)


# ---------------------------------------------------------------------------------------------
# Prefills in the same forward: B counts them, τ* counts the token each emits
# ---------------------------------------------------------------------------------------------


def with_prefills(rng: np.random.Generator, case: dict) -> dict:
    """`case` plus P prefill tokens and E <= P emitted, with the SPS table long enough for them."""
    prefill_tokens = int(rng.integers(0, 40))
    prefill_emitted = int(rng.integers(0, min(prefill_tokens, 4) + 1))
    table = np.asarray(case["sps_table"])
    extended = np.concatenate([table, np.full(prefill_tokens, table[-1])])  # [B_max + P]
    return {**case, "sps_table": extended, "prefill_tokens": prefill_tokens, "prefill_emitted": prefill_emitted}


def test_with_prefills_the_vectorised_schedulers_equal_the_reference():
    rng = np.random.default_rng(11)
    for num_requests, gamma in sizes(rng, 300):
        case = with_prefills(rng, random_case(rng, num_requests, gamma))
        np.testing.assert_array_equal(schedule(**case), schedule_reference(**case), err_msg=str(case["prefill_tokens"]))
        np.testing.assert_array_equal(schedule_full_search(**case), schedule_reference(**case, stop_at_first_decline=False))


def test_with_prefills_algorithm_1_still_finds_the_brute_force_optimum_when_theta_is_unimodal():
    rng = np.random.default_rng(12)
    for _ in range(200):
        num_requests, gamma = int(rng.integers(1, 4)), int(rng.integers(1, 4))
        c = random_confidences(rng, num_requests, gamma, "high")
        prefill_tokens, prefill_emitted = int(rng.integers(1, 30)), 1
        b = np.arange(1, prefill_tokens + num_requests * (1 + gamma) + 1, dtype=np.float64)
        table = 1.0 / (rng.uniform(0.0, 1.0) + np.maximum(rng.uniform(0.1, 2.0), rng.uniform(0.01, 0.5) * b))  # [B_max]
        kwargs = {"confidences": c, "sps_table": table, "prefill_tokens": prefill_tokens, "prefill_emitted": prefill_emitted}
        _, best = brute_force_optimum(**kwargs)
        got = throughput_objective(draft_lengths=schedule(**kwargs), **kwargs)
        assert got == pytest.approx(best, rel=1e-12)


def test_prefill_tokens_move_the_batch_along_the_sps_curve():
    # A roofline step time: flat while memory-bound (B <= 16), then proportional to B; c = 0.8
    # everywhere, so a = 0.8, 0.64, 0.512, ... and past the knee a draft pays iff a·B > τ*.
    b = np.arange(1, 512, dtype=np.float64)
    table = 1.0 / np.maximum(1.0, b / 16.0)  # [511]
    c = np.full((4, 7), 0.8)  # [R, γ]
    alone = schedule(confidences=c, sps_table=table)
    assert alone.sum() == 12  # 4 anchors + 12 drafts fill the flat part; 0.4096·16 < τ* = 11.8
    # 8 prefill tokens take 8 of the free slots: 4 drafts for free, then four 0.64s pay, 0.512·20 < 10.76.
    near_knee = schedule(confidences=c, sps_table=table, prefill_tokens=8, prefill_emitted=1)
    assert near_knee.sum() == 8
    # Behind a 200-token prefill the step is long anyway and a draft costs 1/B of it: all 28 pay.
    behind = schedule(confidences=c, sps_table=table, prefill_tokens=200, prefill_emitted=1)
    assert behind.sum() == 28
    np.testing.assert_array_equal(schedule(confidences=c, sps_table=table, prefill_tokens=0, prefill_emitted=0), alone)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"prefill_tokens": -1}, "prefill_tokens must be an integer >= 0"),
        ({"prefill_tokens": 1.5}, "prefill_tokens must be an integer >= 0"),
        ({"prefill_tokens": 1, "prefill_emitted": 2}, "cannot exceed prefill_tokens"),
        ({"prefill_tokens": 10}, "10 prefill tokens alone need B = 12"),
    ],
)
def test_invalid_prefill_counts_raise_value_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        schedule(confidences=[[0.5]] * 2, sps_table=[1.0] * 6, **kwargs)


def test_the_break_can_stop_in_a_local_optimum_of_a_step_shaped_profile():
    # The price of losslessness (docs/method.md §5.4): Θ dips at the first admission, so the
    # break stops at ℓ = 0 although ℓ = 2 is better.
    c = np.array([[0.8, 0.9]])
    table = np.array([1.0, 0.5, 0.45])
    assert schedule(confidences=c, sps_table=table).tolist() == [0]
    ell, best = brute_force_optimum(confidences=c, sps_table=table)
    assert ell.tolist() == [2] and best == pytest.approx((1 + 0.8 + 0.72) * 0.45)


def test_when_no_draft_can_pay_algorithm_1_admits_nothing_whatever_the_confidences():
    # asked before drafting: if it says no, the engine drafts nothing, and it must not drop a draft
    # Algorithm 1 would have verified; if it says yes, a certain first draft is admitted
    rng = np.random.default_rng(17)
    said = {True: 0, False: 0}
    for num_requests, gamma in sizes(rng, 300):
        case = random_case(rng, num_requests, gamma)
        prefill = int(rng.integers(0, 40)) if rng.random() < 0.3 else 0
        emitted = min(prefill, int(rng.integers(0, 3)))
        b_max = num_requests + prefill + int(rng.integers(0, num_requests * gamma + 1))
        table = random_sps_table(rng, b_max, str(rng.choice(SPS_KINDS)))
        can = any_draft_can_pay(num_requests=num_requests, sps_table=table, prefill_tokens=prefill, prefill_emitted=emitted)
        said[can] += 1
        kw = dict(sps_table=table, num_drafts=case["num_drafts"], prefill_tokens=prefill, prefill_emitted=emitted)
        if not can:
            for c in (case["confidences"], np.ones_like(case["confidences"])):
                assert schedule(confidences=c, **kw).sum() == 0
                assert schedule_reference(confidences=c, **kw).sum() == 0
        else:
            ones = np.ones((num_requests, gamma))
            assert schedule_reference(confidences=ones, **{**kw, "num_drafts": None}).sum() >= 1
    assert said[True] > 30 and said[False] > 30  # both answers were exercised


def test_no_draft_can_pay_at_the_step_of_a_staircase_profile():
    # compact fp32 weights on a 2-core AVX2 CPU (ms per step, B = 1..9): 4-row GEMM tiles
    step_ms = np.array([8.6, 8.9, 10.3, 12.1, 17.9, 19.8, 20.7, 24.1, 33.2])
    table = 1.0 / step_ms  # [9]
    assert [any_draft_can_pay(num_requests=r, sps_table=table) for r in range(1, 9)] == [
        True, True, True, False, True, True, False, False]  # R = 7: 8 / 24.1 < 7 / 20.7
    assert not any_draft_can_pay(num_requests=9, sps_table=table)  # B = 10 is beyond the table
    assert not any_draft_can_pay(num_requests=0, sps_table=table)
    # a prefill in the same forward moves the batch along the curve: 2 requests + 2 prefill tokens sit at B = 4
    assert not any_draft_can_pay(num_requests=2, sps_table=table, prefill_tokens=2, prefill_emitted=1)


# ---------------------------------------------------------------------------------------------
# The async variant
# ---------------------------------------------------------------------------------------------


def test_admit_top_k_takes_the_k_best_current_candidates_in_prefix_order():
    rng = np.random.default_rng(6)
    for _ in range(200):
        num_requests, gamma = int(rng.integers(1, 10)), int(rng.integers(1, 10))
        c = random_confidences(rng, num_requests, gamma, str(rng.choice(CONFIDENCE_KINDS)))
        n = random_num_drafts(rng, num_requests, gamma)
        k = int(rng.integers(0, num_requests * gamma + 2))
        # The reference: a flat table (Θ always rises) of exactly R + K entries admits the top K.
        expected = schedule_reference(confidences=c, num_drafts=n, sps_table=np.ones(num_requests + k))
        np.testing.assert_array_equal(admit_top_k(confidences=c, capacity=k, num_drafts=n), expected)


def test_async_capacity_comes_from_the_stale_confidences_with_a_full_search():
    table = np.array([1.0, 0.5, 0.45, 0.44, 0.43])  # Θ dips at the first admission, then rises
    stale = np.array([[0.8, 0.9]])  # the counterexample row: full search says 2 drafts fit
    assert full_search_capacity(confidences=stale, sps_table=table) == 2
    assert schedule(confidences=stale, sps_table=table).tolist() == [0]  # the break would say 0
    # This round's confidences do not change the capacity, only who gets it.
    for current in ([[0.1, 0.1, 0.1]], [[0.99, 0.99, 0.99]]):
        assert schedule_async(confidences=current, stale_confidences=stale, sps_table=table).tolist() == [2]
    # Two requests, flat table: the stale rows give K = 2 (request 1 has no stale drafts); the
    # current top 2 are (1, 1) with a = .95 and (0, 1) with a = .9, ahead of (1, 2) with .855.
    ell = schedule_async(
        confidences=[[0.9, 0.2], [0.95, 0.9]], stale_confidences=[[0.8, 0.9], [0.0, 0.0]], sps_table=np.ones(6)
    )
    assert ell.tolist() == [1, 1]


def test_async_capacity_is_capped_by_the_table_of_this_round():
    stale = np.full((2, 4), 0.9)  # a flat table of 10 would fit all 8 stale drafts
    ell = schedule_async(confidences=np.full((2, 4), 0.9), stale_confidences=stale, sps_table=np.ones(5))
    assert ell.sum() == 3  # B = 2 anchors + 3 drafts = 5


# ---------------------------------------------------------------------------------------------
# Losslessness: whole rounds simulated, drafts sampled, prefix verified by rejection sampling
# ---------------------------------------------------------------------------------------------

A, B = 0, 1
P_DRAFT = np.array([0.5, 0.5])  # p_d at every position


def draw(p: np.ndarray, u: float) -> int:
    """A token from a two-token distribution p, by inversion of the uniform u."""
    return A if u < p[A] else B


def verify(drafts: list[int], target, uniforms) -> list[int]:
    """Exact rejection sampling (docs/method.md §1) of the admitted drafts against
    target(prefix) -> p_t row; returns the emitted tokens (accepted + corrected or bonus)."""
    out: list[int] = []
    for x in drafts:
        p_t = target(out)
        if next(uniforms) < min(1.0, p_t[x] / P_DRAFT[x]):
            out.append(x)
            continue
        residual = np.maximum(p_t - P_DRAFT, 0.0)
        out.append(draw(residual / residual.sum(), next(uniforms)))
        return out
    out.append(draw(target(out), next(uniforms)))  # all accepted: the bonus token
    return out


def run_rounds(scheduler, confidences_of, target, table, *, rounds: int, seed: int):
    """Simulate `rounds` independent rounds of one request (γ = 2): draft x_1, x_2 from p_d,
    compute the confidences from the drafts as the drafter would, schedule, verify. Returns
    (first two output tokens per round [rounds, 2], ℓ per round [rounds]); when a round emits one
    token the second is drawn from the target directly (a plain round, exact by itself)."""
    uniforms = iter(np.random.default_rng(seed).random(rounds * 8).tolist())  # ≤ 6 used per round
    tokens = np.zeros((rounds, 2), dtype=np.int64)
    lengths = np.zeros(rounds, dtype=np.int64)
    for i in range(rounds):
        drafts = [draw(P_DRAFT, next(uniforms)) for _ in range(2)]
        ell = int(scheduler(confidences=np.array([confidences_of(drafts)]), sps_table=table)[0])
        out = verify(drafts[:ell], target, uniforms)
        if len(out) < 2:
            out.append(draw(target(out), next(uniforms)))
        tokens[i], lengths[i] = out[:2], ell
    return tokens, lengths


ROUNDS = 20_000


def test_the_papers_counterexample_biases_the_full_search_but_not_the_shipped_scheduler():
    """docs/method.md §5.4: R = 1, γ = 2, SPS = (1.0, 0.5, 0.45), a_1 = 0.8, p_t = (A .7, B .3),
    p_d = (.5, .5), c_2 = 0.9 if x_1 = A else 0. Without the break, x_1 = A gives Θ_2 = 1.134 > 1
    (ℓ = 2, and A is always accepted since p_t(A) > p_d(A)) while x_1 = B gives ℓ = 0 (a plain
    draw): P(A) = .5 + .5 · .7 = .85. With the break Θ_1 = 0.9 < 1 stops at ℓ = 0 every time."""
    table = np.array([1.0, 0.5, 0.45])

    def confidences_of(drafts: list[int]) -> list[float]:  # c_2 reads x_1, as the confidence head does
        return [0.8, 0.9 if drafts[0] == A else 0.0]

    def target(prefix: list[int]) -> np.ndarray:
        return np.array([0.7, 0.3])

    biased, biased_lengths = run_rounds(schedule_full_search, confidences_of, target, table, rounds=ROUNDS, seed=7)
    assert set(biased_lengths.tolist()) == {0, 2}  # the realisation of x_1 decides whether x_1 is verified
    count_a = int((biased[:, 0] == A).sum())
    assert binomtest(count_a, ROUNDS, 0.7).pvalue < 1e-12  # not the target distribution
    assert binomtest(count_a, ROUNDS, 0.85).pvalue > 1e-3  # the bias the paper predicts

    shipped, shipped_lengths = run_rounds(schedule, confidences_of, target, table, rounds=ROUNDS, seed=8)
    assert set(shipped_lengths.tolist()) == {0}  # the break stops before c_2 is looked at
    assert binomtest(int((shipped[:, 0] == A).sum()), ROUNDS, 0.7).pvalue > 1e-3


def test_the_shipped_scheduler_is_lossless_when_its_draft_length_depends_on_earlier_drafts():
    """A non-vacuous variant: SPS = (1.0, 0.6, 0.5), a_1 = 0.8 (Θ_1 = 1.08 > 1, x_1 always
    admitted), c_2 = 0.9 if x_1 = A else 0.1 (Θ_2 = 1.26 keeps x_2, or 0.94 stops): ℓ ∈ {1, 2}
    depends on x_1 but never on x_2. The target depends on the prefix; the first two output
    tokens must follow p_t(y_1) p_t(y_2 | y_1) exactly (chi-square over the four pairs)."""
    table = np.array([1.0, 0.6, 0.5])

    def confidences_of(drafts: list[int]) -> list[float]:
        return [0.8, 0.9 if drafts[0] == A else 0.1]

    second = {A: np.array([0.6, 0.4]), B: np.array([0.2, 0.8])}

    def target(prefix: list[int]) -> np.ndarray:
        return np.array([0.7, 0.3]) if not prefix else second[prefix[0]]

    tokens, lengths = run_rounds(schedule, confidences_of, target, table, rounds=ROUNDS, seed=9)
    assert set(lengths.tolist()) == {1, 2}
    observed = np.bincount(tokens[:, 0] * 2 + tokens[:, 1], minlength=4)  # [4] pairs AA, AB, BA, BB
    expected = ROUNDS * np.array([0.7 * 0.6, 0.7 * 0.4, 0.3 * 0.2, 0.3 * 0.8])
    assert chisquare(observed, expected).pvalue > 1e-3


@pytest.mark.parametrize("num_requests,prefill_tokens,prefill_emitted", [(1, 0, 0), (5, 0, 0), (3, 40, 2)])
def test_the_trace_of_a_round_without_drafts_is_what_algorithm_1_traces_for_it(num_requests, prefill_tokens, prefill_emitted):
    sps = np.linspace(100.0, 20.0, 64)  # [B_max]
    lengths, expected = schedule_with_trace(confidences=np.zeros((num_requests, 1)), num_drafts=np.zeros(num_requests, dtype=np.int64),
                                            sps_table=sps, prefill_tokens=prefill_tokens, prefill_emitted=prefill_emitted)
    got = empty_schedule_trace(num_requests=num_requests, sps_table=sps, prefill_tokens=prefill_tokens,
                               prefill_emitted=prefill_emitted)
    assert not lengths.any()
    assert (got.base_batch, got.admitted, got.stop, got.break_candidate) == (expected.base_batch, 0, expected.stop, None)
    np.testing.assert_array_equal(got.thetas, expected.thetas)
