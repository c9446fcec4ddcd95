"""The n-gram datastore of the target's own answers (dspark/drafters/datastore.py).

Specification: each stored n-gram gives its most frequent successor (ties: the smallest id), how
often it followed and how often anything did; a search takes the longest stored suffix; a chain
extends the context by its own drafts and stops where nothing is stored; the vectorised build
equals a plain dictionary count; the file round-trips; ids that do not fit the packing are refused.
"""

from __future__ import annotations

import collections
import json

import numpy as np
import pytest

from dspark.drafters.datastore import NgramDatastore, read_responses


def test_the_most_frequent_successor_of_the_longest_stored_suffix():
    store = NgramDatastore.build([[1, 2, 3, 1, 2, 4, 1, 2, 3], [9, 2, 5]], vocab_size=16, min_n=1, max_n=2)
    # (1, 2) was followed by 3, 4, 3: 3 with share 2/3
    assert store.successor([7, 1, 2]) == (3, pytest.approx(2 / 3), 2)
    # (7, 2) was never seen; 2 alone was followed by 3, 4, 3, 5
    assert store.successor([7, 2]) == (3, pytest.approx(2 / 4), 1)
    assert store.successor([8]) is None  # 8 never occurred


def test_ties_go_to_the_smallest_id():
    store = NgramDatastore.build([[4, 9], [4, 7], [4, 8]], vocab_size=16, min_n=1, max_n=1)
    assert store.successor([4]) == (7, pytest.approx(1 / 3), 1)


def test_a_chain_feeds_on_its_own_drafts_and_stops_where_nothing_is_stored():
    store = NgramDatastore.build([[1, 2, 3, 4, 5]], vocab_size=16, min_n=2, max_n=2)
    assert store.chain([0, 1, 2], 7) == ([3, 4, 5], [1.0, 1.0, 1.0])  # (4, 5) has no successor
    assert store.chain([0, 1, 2], 2) == ([3, 4], [1.0, 1.0])
    assert store.chain([2], 3) == ([], [])  # shorter than min_n


def test_a_chain_says_how_often_each_drafts_suffix_was_followed():
    store = NgramDatastore.build([[1, 2, 3, 4], [1, 2, 3, 9], [1, 2, 5]], vocab_size=16, min_n=1, max_n=2)
    tokens, shares, totals = store.chain_with_totals([1, 2], 2)
    assert tokens == [3, 4]  # (1, 2) -> 3 two times in three; (2, 3) -> 4 and 9 tie: the smaller id
    assert shares == [pytest.approx(2 / 3), pytest.approx(1 / 2)] and totals == [3, 2]
    assert store.chain([1, 2], 2) == (tokens, shares)


def test_the_vectorised_build_equals_a_dictionary_count():
    rng = np.random.default_rng(0)
    seqs = [rng.integers(0, 12, size=rng.integers(1, 60)).tolist() for _ in range(80)]
    store = NgramDatastore.build(seqs, vocab_size=12, min_n=1, max_n=3)
    for n in (1, 2, 3):
        counts = collections.defaultdict(collections.Counter)
        for s in seqs:
            for t in range(n, len(s)):
                counts[tuple(s[t - n:t])][s[t]] += 1
        assert len(store.tables[n].keys) == len(counts)
        for gram, c in counts.items():
            best = min(c, key=lambda tok: (-c[tok], tok))
            token, share, found_n = _at(store, list(gram), n)
            assert (token, found_n) == (best, n) and share == pytest.approx(c[best] / sum(c.values()))


def _at(store: NgramDatastore, gram: list[int], n: int):
    """The stored entry of exactly this n-gram (successor() prefers longer suffixes)."""
    only = NgramDatastore(min_n=n, max_n=n, bits=store.bits, tables={n: store.tables[n]})
    return only.successor(gram)


def test_the_file_round_trips(tmp_path):
    store = NgramDatastore.build([[1, 2, 3, 1, 2, 4]], vocab_size=49152, min_n=2, max_n=4)
    store.save(tmp_path / "s.npz")
    again = NgramDatastore.load(tmp_path / "s.npz")
    assert (again.min_n, again.max_n, again.bits) == (2, 4, 16)
    for n in (2, 3, 4):
        for name in ("keys", "next_token", "count", "total"):
            np.testing.assert_array_equal(getattr(again.tables[n], name), getattr(store.tables[n], name))
    assert again.chain([1, 2], 3) == store.chain([1, 2], 3)


def test_a_large_vocabulary_packs_fewer_tokens_a_key():
    ids = [[151_000, 5, 151_935, 7]]
    assert NgramDatastore.build(ids, vocab_size=151_936, min_n=1, max_n=3).bits == 18
    assert NgramDatastore.build(ids, vocab_size=151_936, min_n=1, max_n=3).successor([151_000, 5]) == (151_935, 1.0, 2)
    with pytest.raises(ValueError, match="64"):
        NgramDatastore.build(ids, vocab_size=151_936, min_n=1, max_n=4)  # 4 x 18 bits do not fit
    with pytest.raises(ValueError, match="token ids"):
        NgramDatastore.build([[3, 16]], vocab_size=16)


def test_responses_of_the_train_split_are_read(tmp_path):
    path = tmp_path / "responses.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in [
        {"split": "train", "response_ids": [1, 2]}, {"split": "heldout", "response_ids": [3]}, {"response_ids": [4]}]) + "\n")
    assert read_responses([path]) == [[1, 2], [4]]
    assert read_responses([path], split="heldout") == [[3]]


def test_a_memoised_chain_is_the_chain_searched_again_and_cannot_be_changed_through_its_result():
    g = np.random.default_rng(5)
    store = NgramDatastore.build([g.integers(0, 6, size=60).tolist() for _ in range(30)], vocab_size=6, min_n=1, max_n=3)
    fresh = NgramDatastore(min_n=store.min_n, max_n=store.max_n, bits=store.bits, tables=store.tables)
    for _ in range(200):
        context, k = g.integers(0, 6, size=int(g.integers(1, 8))).tolist(), int(g.integers(1, 8))
        first = store.chain(context, k)
        first[0].append(-1)  # a caller's change to a result must not reach the memo
        again = store.chain(context, k)
        plain = NgramDatastore(min_n=store.min_n, max_n=store.max_n, bits=store.bits, tables=store.tables).chain(context, k)
        assert again == plain and again[0] == first[0][:-1]
        assert fresh.chain(context, k) == plain
