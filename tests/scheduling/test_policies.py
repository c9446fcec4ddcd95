"""Draft-length policies: parsing, each policy's behaviour, and the async policy's two-rounds-old
capacity over a scripted sequence of rounds."""

from __future__ import annotations

import numpy as np
import pytest

from dspark.scheduling.policies import (
    DSparkAsyncPolicy,
    DSparkPolicy,
    FixedPolicy,
    NonePolicy,
    ThresholdPolicy,
    parse_policy,
)
from dspark.scheduling.prefix_scheduler import full_search_capacity, schedule

IDS = ["a", "b", "c"]
CONF = np.array([[0.9, 0.9, 0.9, 0.9], [0.6, 0.5, 0.9, 0.9], [0.95, 0.0, 0.0, 0.0]])  # [3, 4]
NUM = np.array([4, 4, 1])  # [3]
TABLE = 1.0 / (1.0 + 0.05 * np.arange(1, 16))  # [15]: B ≤ 3 · (1 + 4)


# ---------------------------------------------------------------------------------------------
# Parsing
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "spec, expected",
    [
        ("none", NonePolicy()),
        ("fixed:3", FixedPolicy(3)),
        ("fixed:0", FixedPolicy(0)),
        (" Fixed : 7 ", FixedPolicy(7)),
        ("threshold:0.5", ThresholdPolicy(0.5)),
        ("threshold:1", ThresholdPolicy(1.0)),
        ("dspark", DSparkPolicy()),
    ],
)
def test_parse_policy_reads_each_form(spec, expected):
    policy = parse_policy(spec)
    assert policy == expected
    assert parse_policy(policy.spec) == policy  # spec round-trips


def test_parse_policy_gives_a_fresh_async_policy_each_time():
    first, second = parse_policy("dspark-async"), parse_policy("dspark-async")
    assert isinstance(first, DSparkAsyncPolicy) and first is not second and first.spec == "dspark-async"
    assert first._history is not second._history


@pytest.mark.parametrize(
    "spec, message",
    [
        ("", "unknown policy ''"),
        ("bogus", "unknown policy 'bogus'; expected one of none, fixed:K, threshold:C, dspark, dspark-async"),
        ("fixed", "fixed:K needs an integer K >= 0"),
        ("fixed:", "fixed:K needs an integer K >= 0"),
        ("fixed:x", "got 'fixed:x'"),
        ("fixed:1.5", "got 'fixed:1.5'"),
        ("fixed:-1", "got -1"),
        ("threshold:", "threshold:C needs a number"),
        ("threshold:abc", "got 'threshold:abc'"),
        ("threshold:1.5", "0 <= C <= 1, got 1.5"),
        ("threshold:nan", "0 <= C <= 1, got nan"),
        ("dspark:3", "takes no argument, got 'dspark:3'"),
        ("none:1", "takes no argument"),
    ],
)
def test_parse_policy_rejects_bad_strings_saying_what_was_got(spec, message):
    with pytest.raises(ValueError, match=message.replace(".", "\\.")):
        parse_policy(spec)


def test_parse_policy_rejects_non_strings():
    with pytest.raises(TypeError, match="given as a string"):
        parse_policy(3)


# ---------------------------------------------------------------------------------------------
# Each policy
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("spec", ["none", "fixed:2", "threshold:0.5", "dspark", "dspark-async"])
def test_every_policy_returns_int64_lengths_within_the_available_drafts(spec):
    ell = parse_policy(spec).draft_lengths(request_ids=IDS, num_drafts=NUM, confidences=CONF, sps_table=TABLE)
    assert ell.dtype == np.int64 and ell.shape == (3,)
    assert np.all(ell >= 0) and np.all(ell <= NUM)


def test_none_admits_nothing_and_fixed_admits_min_k_available():
    assert NonePolicy().draft_lengths(request_ids=IDS, num_drafts=NUM).tolist() == [0, 0, 0]
    assert FixedPolicy(2).draft_lengths(request_ids=IDS, num_drafts=NUM).tolist() == [2, 2, 1]
    assert FixedPolicy(9).draft_lengths(request_ids=IDS, num_drafts=[4, 0, 1]).tolist() == [4, 0, 1]


def test_threshold_uses_the_cumulative_survival_not_the_single_confidence():
    # Request a: c = .9 everywhere, a = .9, .81, .729, .656: C = .75 admits 2 (c alone would admit 4).
    # Request b: a = .6, .3, ...: C = .75 admits none; C = .5 admits 1 even though c_3 = .9.
    got = ThresholdPolicy(0.75).draft_lengths(request_ids=IDS, num_drafts=NUM, confidences=CONF)
    assert got.tolist() == [2, 0, 1]
    assert ThresholdPolicy(0.5).draft_lengths(request_ids=IDS, num_drafts=NUM, confidences=CONF).tolist() == [4, 1, 1]
    assert ThresholdPolicy(0.0).draft_lengths(request_ids=IDS, num_drafts=NUM, confidences=CONF).tolist() == [4, 4, 1]
    assert ThresholdPolicy(1.0).draft_lengths(request_ids=IDS, num_drafts=NUM, confidences=CONF).tolist() == [0, 0, 0]


def test_dspark_is_algorithm_1():
    got = DSparkPolicy().draft_lengths(request_ids=IDS, num_drafts=NUM, confidences=CONF, sps_table=TABLE)
    np.testing.assert_array_equal(got, schedule(confidences=CONF, num_drafts=NUM, sps_table=TABLE))
    assert got.sum() > 0


@pytest.mark.parametrize("spec", ["threshold:0.5", "dspark", "dspark-async"])
def test_confidence_policies_refuse_to_run_without_confidences(spec):
    with pytest.raises(ValueError, match="needs calibrated confidences"):
        parse_policy(spec).draft_lengths(request_ids=IDS, num_drafts=NUM, sps_table=TABLE)
    assert parse_policy(spec).needs_confidences


@pytest.mark.parametrize("spec", ["dspark", "dspark-async"])
def test_dspark_policies_refuse_to_run_without_the_sps_table(spec):
    with pytest.raises(ValueError, match="needs the SPS table"):
        parse_policy(spec).draft_lengths(request_ids=IDS, num_drafts=NUM, confidences=CONF)


def test_num_drafts_must_match_the_request_ids():
    with pytest.raises(ValueError, match="num_drafts must have shape \\[3\\]"):
        FixedPolicy(1).draft_lengths(request_ids=IDS, num_drafts=[1, 1])
    with pytest.raises(ValueError, match="integers >= 0"):
        FixedPolicy(1).draft_lengths(request_ids=IDS, num_drafts=[1, -1, 1])


# ---------------------------------------------------------------------------------------------
# dspark-async over a scripted sequence of rounds
# ---------------------------------------------------------------------------------------------

FLAT = np.ones(40)  # flat SPS: the full search fits every stale draft with a > 0 (B ≤ 40)


def test_async_uses_two_rounds_old_capacity_but_this_rounds_ranking():
    policy = DSparkAsyncPolicy()
    ids = ["a", "b"]
    given = [
        np.array([[0.9, 0.9, 0.0, 0.0], [0.9, 0.0, 0.0, 0.0]]),  # round 0: K = 3 for round 2
        np.zeros((2, 4)),  # round 1: K = 0 for round 3
        np.array([[0.2, 0.2, 0.2, 0.2], [0.99, 0.99, 0.99, 0.99]]),  # round 2: K = 8 for round 4
        np.array([[0.9, 0.9, 0.0, 0.0], [0.9, 0.0, 0.0, 0.0]]),  # round 3: K = 3 for round 5
        np.array([[0.99, 0.99, 0.99, 0.99], [0.1, 0.1, 0.1, 0.1]]),
        np.full((2, 4), 0.9),  # round 5: a and b tie position by position
    ]
    assert [full_search_capacity(confidences=c, sps_table=FLAT) for c in given[:4]] == [3, 0, 8, 3]
    lengths = [
        policy.draft_lengths(request_ids=ids, num_drafts=[4, 4], confidences=c, sps_table=FLAT).tolist() for c in given
    ]
    assert lengths[0] == [0, 0] and lengths[1] == [0, 0]  # no round two rounds old yet
    assert lengths[2] == [0, 3]  # K = 3 from round 0; round 2's ranking prefers request b
    assert lengths[3] == [0, 0]  # K = 0 from round 1, although round 3 is confident
    assert lengths[4] == [4, 4]  # K = 8 from round 2 (all of round 4's candidates are positive)
    assert policy.round_index == 6
    assert lengths[5] == [2, 1]  # K = 3 from round 3; ties go to request a first, position by position


def test_async_request_without_history_borrows_the_population_row_of_two_rounds_ago():
    policy = DSparkAsyncPolicy()
    old = np.array([[0.9, 0.9, 0.0]])  # round 0: request a alone, population row (0.9, 0.9, 0)
    policy.draft_lengths(request_ids=["a"], num_drafts=[3], confidences=old, sps_table=FLAT)
    policy.draft_lengths(request_ids=["a"], num_drafts=[3], confidences=np.zeros((1, 3)), sps_table=FLAT)
    # Round 2: b is new; it borrows round 0's population row, so K = 2 (a's) + 2 (b's borrowed)
    # = 4, and the current ranking gives b's three 0.99s and a's first 0.5.
    ell = policy.draft_lengths(
        request_ids=["a", "b"], num_drafts=[3, 3], confidences=[[0.5, 0.5, 0.5], [0.99, 0.99, 0.99]], sps_table=FLAT
    )
    assert ell.tolist() == [1, 3]


def test_async_population_row_averages_each_position_over_the_requests_that_had_it():
    policy = DSparkAsyncPolicy()
    round0 = np.array([[0.8, 0.6, 0.0], [0.4, 0.0, 0.0]])  # a has 2 drafts, b has 1
    policy.draft_lengths(request_ids=["a", "b"], num_drafts=[2, 1], confidences=round0, sps_table=FLAT)
    policy.draft_lengths(request_ids=["a", "b"], num_drafts=[2, 1], confidences=round0, sps_table=FLAT)
    np.testing.assert_allclose(policy._population[0][1], [0.6, 0.6])  # (0.8 + 0.4) / 2, then a's 0.6 alone
    # Round 2, c alone and new: it borrows (0.6, 0.6): K = 2 under the flat profile.
    ell = policy.draft_lengths(request_ids=["c"], num_drafts=[3], confidences=[[0.9, 0.9, 0.9]], sps_table=FLAT)
    assert ell.tolist() == [2]


def test_async_first_two_rounds_of_the_engine_admit_no_drafts():
    policy = DSparkAsyncPolicy()
    conf = np.full((2, 3), 0.9)
    for _ in range(2):
        assert policy.draft_lengths(request_ids=["a", "b"], num_drafts=[3, 3], confidences=conf, sps_table=FLAT).tolist() == [0, 0]


def test_async_request_that_skipped_a_round_uses_its_newest_row_at_least_two_rounds_old():
    policy = DSparkAsyncPolicy()
    conf = np.array([[0.9, 0.9, 0.9]])
    policy.draft_lengths(request_ids=["a"], num_drafts=[3], confidences=conf, sps_table=FLAT)  # round 0: K = 3
    policy.draft_lengths(request_ids=["b"], num_drafts=[3], confidences=conf, sps_table=FLAT)  # round 1: a absent
    ell = policy.draft_lengths(request_ids=["a"], num_drafts=[3], confidences=conf, sps_table=FLAT)  # round 2
    assert ell.tolist() == [3]
    # Round 3: a's rows are from rounds 0 and 2; round 2 is too new, round 0 still counts.
    ell = policy.draft_lengths(request_ids=["a"], num_drafts=[3], confidences=conf, sps_table=FLAT)
    assert ell.tolist() == [3]


def test_async_forgets_removed_requests_and_ignores_rounds_that_failed_validation():
    policy = DSparkAsyncPolicy()
    conf = np.array([[0.9, 0.9]])
    policy.draft_lengths(request_ids=["a"], num_drafts=[2], confidences=conf, sps_table=FLAT)
    with pytest.raises(ValueError, match="\\[0, 1\\]"):
        policy.draft_lengths(request_ids=["a"], num_drafts=[2], confidences=[[1.5, 0.9]], sps_table=FLAT)
    assert policy.round_index == 1  # the failed call did not count as a round
    policy.draft_lengths(request_ids=["a"], num_drafts=[2], confidences=conf, sps_table=FLAT)
    policy.remove_request("a")
    assert "a" not in policy._history
    # A request id seen again after its removal is a new request: it borrows the population row.
    assert policy.draft_lengths(request_ids=["a"], num_drafts=[2], confidences=conf, sps_table=FLAT).tolist() == [2]
    with pytest.raises(ValueError, match="unique"):
        policy.draft_lengths(request_ids=["a", "a"], num_drafts=[2, 2], confidences=np.vstack([conf, conf]), sps_table=FLAT)
