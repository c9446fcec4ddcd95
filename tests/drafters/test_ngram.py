"""The n-gram (prompt-lookup) drafter: longest suffix match, most recent occurrence, capped
continuation, point-mass proposals; and its lookup against a plain reference."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dspark.drafters.base import DraftRequest
from dspark.drafters.ngram import ContextIndex, NgramDrafter, find_ngram_continuation
from dspark.sampling.params import SamplingParams


def lookup(tokens: list[int], *, min_n: int = 1, max_n: int = 4, k: int = 5) -> list[int]:
    return find_ngram_continuation(np.asarray(tokens, dtype=np.int64), min_n=min_n, max_n=max_n, k=k)


def reference_lookup(tokens: list[int], *, min_n: int, max_n: int, k: int) -> list[int]:
    """Plain definition: for n from max_n down to min_n, the latest start i < len - n with
    tokens[i:i+n] == the last n tokens; return up to k tokens after that occurrence."""
    for n in range(max_n, min_n - 1, -1):
        if n >= len(tokens):
            continue
        suffix = tokens[-n:]
        for i in range(len(tokens) - n - 1, -1, -1):
            if tokens[i : i + n] == suffix:
                return tokens[i + n : i + n + k]
    return []


def request(tokens: list[int], max_draft_tokens: int, rid: str = "r") -> DraftRequest:
    return DraftRequest(request_id=rid, token_ids=tokens, num_prompt_tokens=1, params=SamplingParams(), max_draft_tokens=max_draft_tokens)


def test_the_longest_matching_suffix_wins_over_a_more_recent_shorter_one():
    # suffix [1, 2, 3] occurred at 0 (followed by 9, 5); the 1-gram [3] last occurred at 5 (followed by 7)
    tokens = [1, 2, 3, 9, 5, 3, 7, 1, 2, 3]
    assert lookup(tokens, k=2) == [9, 5]
    assert lookup(tokens, max_n=1, k=2) == [7, 1]


def test_among_occurrences_of_the_same_ngram_the_most_recent_is_used():
    assert lookup([1, 2, 8, 1, 2, 9, 1, 2], k=1) == [9]
    assert lookup([4, 6, 4, 7, 4], k=3) == [7, 4]


def test_the_continuation_is_capped_at_k_and_may_run_into_the_suffix_itself():
    tokens = [10, 11, 12, 13, 14, 15, 16, 10]
    assert lookup(tokens, k=3) == [11, 12, 13]
    assert lookup(tokens, k=100) == [11, 12, 13, 14, 15, 16, 10]
    assert lookup([5, 5, 5], k=4) == [5]  # [5, 5] last occurred at 0, followed by the final 5


def test_no_match_gives_no_draft():
    assert lookup([1, 2, 3, 4]) == []
    assert lookup([7]) == []  # nothing before the suffix
    assert lookup([1, 2, 3, 1], min_n=2) == []  # only a 1-gram matches


def test_ngrams_longer_than_max_n_are_not_considered():
    # only the 3-gram [1, 2, 3] points at 8; with max_n=2 the 2-gram [2, 3] last occurred before 4
    tokens = [1, 2, 3, 8, 0, 2, 3, 4, 1, 2, 3]
    assert lookup(tokens, max_n=3, k=1) == [8]
    assert lookup(tokens, max_n=2, k=1) == [4]


def test_lookup_agrees_with_the_plain_reference_on_random_sequences():
    g = np.random.default_rng(0)
    checked_hits = 0
    for trial in range(400):
        tokens = g.integers(0, 4 if trial % 2 else 12, size=int(g.integers(1, 40))).tolist()
        min_n = int(g.integers(1, 3))
        max_n = int(g.integers(min_n, 6))
        k = int(g.integers(1, 8))
        expected = reference_lookup(tokens, min_n=min_n, max_n=max_n, k=k)
        assert lookup(tokens, min_n=min_n, max_n=max_n, k=k) == expected, (tokens, min_n, max_n, k)
        checked_hits += bool(expected)
    assert checked_hits > 100


def test_proposals_are_point_masses_on_the_drafted_tokens():
    (p,) = NgramDrafter().propose([request([1, 2, 3, 9, 5, 3, 7, 1, 2, 3], 4)])
    assert p.token_ids.tolist() == [9, 5, 3, 7]
    assert p.token_ids.dtype == torch.long
    assert p.prob_ids.shape == (4, 1) and p.prob_ids[:, 0].tolist() == [9, 5, 3, 7]
    assert p.probs.dtype == torch.float32 and torch.equal(p.probs, torch.ones(4, 1))
    assert len(p) == 4


def test_the_drafter_proposes_at_most_max_draft_tokens_per_request_in_request_order():
    tokens = [10, 11, 12, 13, 14, 15, 16, 10]
    proposals = NgramDrafter().propose([
        request(tokens, 3, "a"), request(tokens, 0, "b"), request([1, 2, 3], 5, "c"), request(tokens, 20, "d")
    ])
    assert [p.token_ids.tolist() for p in proposals] == [[11, 12, 13], [], [], [11, 12, 13, 14, 15, 16, 10]]
    for p in proposals[1:3]:  # empty proposals keep the [0, k] row shapes
        assert p.prob_ids.shape[0] == p.probs.shape[0] == 0


def test_min_n_and_max_n_are_honoured_by_the_drafter():
    tokens = [1, 2, 3, 1]
    assert len(NgramDrafter(min_n=1, max_n=4).propose([request(tokens, 3)])[0]) == 3
    assert len(NgramDrafter(min_n=2, max_n=4).propose([request(tokens, 3)])[0]) == 0


@pytest.mark.parametrize("min_n, max_n", [(0, 3), (3, 2), (-1, 1)])
def test_invalid_ngram_bounds_are_a_value_error(min_n, max_n):
    with pytest.raises(ValueError, match=f"need 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}"):
        NgramDrafter(min_n=min_n, max_n=max_n)


def test_the_incremental_index_answers_as_the_reference_on_contexts_that_grow_round_by_round():
    # the serving path (ContextIndex) against the plain rescan, a few tokens added per round as the
    # engine adds them, and a context that is not an extension (a rebuilt request) indexed afresh
    g = np.random.default_rng(3)
    hits = 0
    for trial in range(120):
        min_n = int(g.integers(1, 3))
        max_n = int(g.integers(min_n, 6))
        index = ContextIndex(min_n=min_n, max_n=max_n)
        tokens = g.integers(0, 4 if trial % 2 else 12, size=int(g.integers(1, 10))).tolist()
        for _ in range(12):
            k = int(g.integers(1, 8))
            index.update(list(tokens))
            expected = reference_lookup(tokens, min_n=min_n, max_n=max_n, k=k)
            got = index.longest_match(k)
            assert got[1] == expected, (tokens, min_n, max_n, k)
            assert (got[0] == 0) == (not expected)
            hits += bool(expected)
            if g.random() < 0.1:
                tokens = g.integers(0, 6, size=int(g.integers(1, 20))).tolist()  # not an extension
            else:
                tokens = tokens + g.integers(0, 6, size=int(g.integers(1, 9))).tolist()
    assert hits > 400


def test_the_match_length_is_the_longest_n_that_occurred():
    index = ContextIndex(min_n=2, max_n=4)
    index.update([7, 1, 2, 3, 9, 5, 2, 3, 8, 1, 2, 3])
    assert index.longest_match(2) == (3, [9, 5])  # [1, 2, 3] beats the later [2, 3]


def test_the_drafter_forgets_a_request_it_is_told_to_remove():
    drafter = NgramDrafter()
    drafter.remove_request("never-seen")  # a no-op, not an error
    drafter.propose([request([1, 2, 3, 1, 2], 2, "a")])
    assert "a" in drafter._index
    drafter.remove_request("a")
    assert "a" not in drafter._index and drafter.spec.name == "ngram"
    # a request id used again starts from its new context, not the old one
    (p,) = drafter.propose([request([4, 5, 6, 4], 2, "a")])
    assert p.token_ids.tolist() == [5, 6]
