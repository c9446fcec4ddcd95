"""Statistics over recorded rounds, against values worked out by hand.

Specification: τ is the mean of a + 1 over rounds; P(accept k | accepted k-1) counts only the
rounds that verified x_k after accepting x_1..x_{k-1}; a static threshold C keeps the leading
drafts with c_k >= C (or a_k >= C, cumulative) and accepts min(a, ℓ_C) of them; reliability
pairs are the positions the verifier decided on.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from dspark.evaluation.acceptance import (
    RoundRecords,
    conditional_pairs,
    mean_accepted_length,
    position_acceptance,
    reliability,
    survival_pairs,
    threshold_sweep,
)

NAN = float("nan")


@pytest.fixture
def four_rounds() -> RoundRecords:
    """(ℓ, a, c): all three accepted; one of three; none of two; a round without drafts."""
    return RoundRecords(
        num_drafts=np.array([3, 3, 2, 0]),
        num_accepted=np.array([3, 1, 0, 0]),
        confidences=np.array([[0.9, 0.8, 0.7], [0.95, 0.4, 0.6], [0.3, 0.9, NAN], [NAN, NAN, NAN]]),
    )


def test_tau_is_the_mean_of_accepted_plus_one_over_rounds(four_rounds):
    assert mean_accepted_length(four_rounds) == (4 + 2 + 1 + 1) / 4
    assert math.isnan(mean_accepted_length(RoundRecords(np.zeros(0), np.zeros(0))))


def test_position_acceptance_is_conditional_on_the_previous_positions_being_accepted(four_rounds):
    pa = position_acceptance(four_rounds, 3)
    # k=1: verified in rounds 1-3, accepted in 1-2; k=2: reached in 1-2, accepted in 1; k=3: reached and accepted in 1
    assert pa.reached.tolist() == [3, 2, 1]
    assert pa.accepted.tolist() == [2, 1, 1]
    np.testing.assert_allclose(pa.rate, [2 / 3, 1 / 2, 1.0])


def test_a_position_never_reached_has_no_rate(four_rounds):
    pa = position_acceptance(four_rounds, 5)
    assert pa.reached.tolist()[3:] == [0, 0] and np.isnan(pa.rate[3:]).all()
    assert pa.to_json()["rate"][3:] == [None, None]


@pytest.mark.parametrize(
    "threshold, tau, verified, rate",
    [
        (0.0, 2.0, (4 + 4 + 3 + 1) / 4, 4 / 8),  # every draft verified: the run itself
        (0.35, 2.0, (4 + 4 + 1 + 1) / 4, 4 / 6),  # round 3 cut before c=0.3; round 2 keeps its rejected tail
        (0.5, 2.0, (4 + 2 + 1 + 1) / 4, 4 / 4),  # round 2 cut at c=0.4, exactly its rejection point
        (0.85, (2 + 2 + 1 + 1) / 4, (2 + 2 + 1 + 1) / 4, 2 / 2),  # round 1 loses two accepted drafts
        (1.0, 1.0, 1.0, NAN),  # nothing passes: plain decoding, no acceptance rate
    ],
)
def test_threshold_sweep_cuts_at_the_first_confidence_below_c(four_rounds, threshold, tau, verified, rate):
    sweep = threshold_sweep(four_rounds, [threshold])
    assert sweep.accepted_length[0] == pytest.approx(tau)
    assert sweep.verified_per_round[0] == pytest.approx(verified)
    if math.isnan(rate):
        assert math.isnan(sweep.acceptance_rate[0]) and sweep.to_json()["acceptance_rate"] == [None]
    else:
        assert sweep.acceptance_rate[0] == pytest.approx(rate)


def test_cumulative_threshold_cuts_at_the_first_survival_product_below_c(four_rounds):
    # C = 0.6: round 1 has a = 0.9, 0.72, 0.504 -> keeps 2; conditional c would keep all 3
    cumulative = threshold_sweep(four_rounds, [0.6], cumulative=True)
    assert cumulative.accepted_length[0] == pytest.approx((3 + 2 + 1 + 1) / 4)
    assert cumulative.verified_per_round[0] == pytest.approx((3 + 2 + 1 + 1) / 4)
    conditional = threshold_sweep(four_rounds, [0.6])
    assert conditional.accepted_length[0] == pytest.approx(2.0)


def test_threshold_zero_reproduces_the_recorded_run(four_rounds):
    assert threshold_sweep(four_rounds, [0.0]).accepted_length[0] == mean_accepted_length(four_rounds)


def test_reliability_pairs_are_the_positions_the_verifier_decided_on(four_rounds):
    conf, accepted = conditional_pairs(four_rounds)
    np.testing.assert_allclose(conf, [0.9, 0.8, 0.7, 0.95, 0.4, 0.3])
    assert accepted.tolist() == [1, 1, 1, 1, 0, 0]
    a_2, s_2 = survival_pairs(four_rounds, 2)  # rounds that verified x_2: 1, 2, 3
    np.testing.assert_allclose(a_2, [0.9 * 0.8, 0.95 * 0.4, 0.3 * 0.9])
    assert s_2.tolist() == [1, 0, 0]
    diagrams = reliability(four_rounds, 3, num_bins=10)
    assert diagrams["conditional"]["n"] == 6 and len(diagrams["positions"]) == 3
    assert [d["n"] for d in diagrams["positions"]] == [3, 3, 2]


def test_statistics_that_need_confidences_refuse_records_without_them():
    records = RoundRecords(np.array([2]), np.array([1]))
    with pytest.raises(ValueError, match="confidences"):
        threshold_sweep(records, [0.5])
    with pytest.raises(ValueError, match="confidences"):
        conditional_pairs(records)


def test_inconsistent_records_are_refused_with_a_message():
    with pytest.raises(ValueError, match="accepted <= drafts"):
        RoundRecords(np.array([2]), np.array([3]))
    with pytest.raises(ValueError, match="width"):
        RoundRecords(np.array([3]), np.array([1]), np.array([[0.5, 0.5]]))
    with pytest.raises(ValueError, match="differ in length"):
        RoundRecords(np.array([3, 1]), np.array([1]))
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        threshold_sweep(RoundRecords(np.array([1]), np.array([1]), np.array([[0.5]])), [1.5])


def test_concatenation_pads_confidences_and_drops_them_if_any_part_has_none(four_rounds):
    narrow = RoundRecords(np.array([1]), np.array([1]), np.array([[0.7]]))
    both = RoundRecords.concat([four_rounds, narrow])
    assert both.num_rounds == 5 and both.confidences.shape == (5, 3) and np.isnan(both.confidences[4, 1:]).all()
    assert RoundRecords.concat([four_rounds, RoundRecords(np.array([1]), np.array([0]))]).confidences is None
