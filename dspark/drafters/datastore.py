"""An n-gram datastore of the target's own outputs: free draft proposals where the context does
not repeat itself (docs/method.md §8; in the spirit of REST, He et al. 2023, on the target's
regenerations instead of a corpus).

A small target's greedy answers are stereotyped ("Here is a Python function that ..."), so the
token that most often followed the last n tokens in its own earlier answers is often the one it
emits next. Built once from `responses.jsonl` files of `dspark data generate` (the target's
regenerations; `dspark data datastore`), stored beside the drafter checkpoint, and searched per
round for the longest n in [min_n, max_n] whose n-gram was seen: a chain of point-mass drafts
x_k = the most frequent successor of (context, x_1 .. x_{k-1}), each with the share of its
successor among all successors seen (`share`), which the lookup drafter calibrates online.

Lossless for the same reason as a context lookup: every draft is a deterministic function of the
context and of the stored table, proposed as a point mass (p_d(x_k) = 1).

Layout: per n one table sorted by key, the n tokens packed into one uint64 (`bits` bits a
token, so n * bits <= 64; 16 bits hold the default model's 49,152 ids), with the most frequent
successor (ties: the smallest id), how often it followed and how often anything followed.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np

DATASTORE_FILE = "ngram_datastore.npz"  # beside a drafter checkpoint's config.json
_MAX_MEMO_CHAINS = 1 << 16  # ~10 MB of memoised chains at most, then the memo starts over


@dataclass(frozen=True)
class NgramTable:
    keys: np.ndarray  # [entries] uint64, ascending: the n tokens packed, oldest in the high bits
    next_token: np.ndarray  # [entries] int32: the most frequent successor
    count: np.ndarray  # [entries] uint32: how often it followed
    total: np.ndarray  # [entries] uint32: how often any token followed


def _bits_for(vocab_size: int) -> int:
    return max(16, math.ceil(math.log2(max(vocab_size, 2))))


def _pack(windows: np.ndarray, bits: int) -> np.ndarray:  # windows [num, n] int -> [num] uint64
    key = np.zeros(windows.shape[0], dtype=np.uint64)
    for j in range(windows.shape[1]):
        key = (key << np.uint64(bits)) | windows[:, j].astype(np.uint64)
    return key


def _table(keys: np.ndarray, successors: np.ndarray) -> NgramTable:
    """keys [num] uint64, successors [num] int64: each key's most frequent successor and counts."""
    order = np.lexsort((successors, keys))  # by key, then successor
    k, s = keys[order], successors[order]
    pair_start = np.ones(len(k), dtype=bool)
    pair_start[1:] = (k[1:] != k[:-1]) | (s[1:] != s[:-1])
    starts = np.flatnonzero(pair_start)
    pair_key, pair_succ = k[starts], s[starts]
    pair_count = np.diff(np.append(starts, len(k)))
    # per key: the pair with the largest count; ties to the smallest successor (pairs are sorted by it)
    key_start = np.ones(len(pair_key), dtype=bool)
    key_start[1:] = pair_key[1:] != pair_key[:-1]
    group = np.cumsum(key_start) - 1  # [pairs] key index
    num_keys = int(group[-1]) + 1 if len(group) else 0
    total = np.bincount(group, weights=pair_count, minlength=num_keys).astype(np.uint32)
    best = np.lexsort((-pair_count, group))  # within each key, the largest count first (stable: smallest id)
    first = best[np.r_[True, group[best][1:] != group[best][:-1]]] if len(best) else best
    return NgramTable(keys=pair_key[first], next_token=pair_succ[first].astype(np.int32),
                      count=pair_count[first].astype(np.uint32), total=total)


@dataclass(frozen=True)
class NgramDatastore:
    min_n: int
    max_n: int
    bits: int
    tables: dict[int, NgramTable]  # n -> table
    # chains already looked up, by (last max_n tokens, k): a chain depends on nothing else, and
    # the same suffixes recur across rounds and requests (a search is ~10 µs a step)
    _chains: dict[tuple[tuple[int, ...], int], tuple[tuple[int, ...], tuple[float, ...]]] = field(
        default_factory=dict, init=False, repr=False, compare=False)

    @classmethod
    def build(cls, sequences: Iterable[Sequence[int]], *, vocab_size: int, min_n: int = 2, max_n: int = 4) -> "NgramDatastore":
        """From token sequences (the target's responses): every position's n previous tokens -> it."""
        bits = _bits_for(vocab_size)
        if not 1 <= min_n <= max_n or max_n * bits > 64:
            raise ValueError(f"need 1 <= min_n <= max_n and max_n * {bits} bits <= 64, got min_n={min_n}, max_n={max_n}")
        seqs = [np.asarray(s, dtype=np.int64) for s in sequences]
        if any(len(s) and (s.min() < 0 or s.max() >= vocab_size) for s in seqs):
            raise ValueError(f"token ids must lie in [0, {vocab_size})")
        tables = {}
        for n in range(min_n, max_n + 1):
            keys, succ = [], []
            for s in seqs:
                if len(s) > n:
                    keys.append(_pack(np.lib.stride_tricks.sliding_window_view(s[:-1], n), bits))  # [len - n]
                    succ.append(s[n:])
            tables[n] = _table(np.concatenate(keys) if keys else np.zeros(0, np.uint64),
                               np.concatenate(succ) if succ else np.zeros(0, np.int64))
        return cls(min_n=min_n, max_n=max_n, bits=bits, tables=tables)

    @property
    def entries(self) -> int:
        return sum(len(t.keys) for t in self.tables.values())

    def successor(self, context: Sequence[int]) -> tuple[int, float, int] | None:
        """(token, share, n): the most frequent successor of the longest stored suffix of
        `context` (n tokens) and its share of what followed that suffix; None if none is stored."""
        found = self._lookup(context)
        return None if found is None else found[:3]

    def _lookup(self, context: Sequence[int]) -> tuple[int, float, int, int] | None:
        """successor()'s answer and how often anything followed the suffix (its evidence)."""
        bits, m = self.bits, len(context)
        for n in range(min(self.max_n, m), self.min_n - 1, -1):
            table = self.tables[n]
            key = 0
            for token in context[m - n :]:  # _pack's order, on Python ints (its array round trip costs ~20 µs)
                key = (key << bits) | int(token)
            i = int(table.keys.searchsorted(np.uint64(key)))
            if i < len(table.keys) and int(table.keys[i]) == key:
                total = int(table.total[i])
                return int(table.next_token[i]), float(table.count[i]) / float(total), n, total
        return None

    def chain(self, context: Sequence[int], k: int) -> tuple[list[int], list[float]]:
        """Up to k drafts, each the successor of the context extended by the drafts before it, and
        their shares; it stops where no suffix is stored."""
        tokens, shares, _ = self.chain_with_totals(context, k)
        return tokens, shares

    def chain_with_totals(self, context: Sequence[int], k: int) -> tuple[list[int], list[float], list[int]]:
        """chain(), and for each draft how often anything followed its suffix: a share of 1.0
        seen once is weaker evidence than 0.9 seen a hundred times."""
        ctx = list(context[-self.max_n:])
        memo_key = (tuple(ctx), k)
        memo = self._chains.get(memo_key)
        if memo is not None:
            return list(memo[0]), list(memo[1]), list(memo[2])
        tokens, shares, totals = [], [], []
        for _ in range(k):
            found = self._lookup(ctx)
            if found is None:
                break
            token, share, _, total = found
            tokens.append(token)
            shares.append(share)
            totals.append(total)
            ctx = ctx[1:] + [token] if len(ctx) >= self.max_n else ctx + [token]
        if len(self._chains) >= _MAX_MEMO_CHAINS:
            self._chains.clear()
        self._chains[memo_key] = (tuple(tokens), tuple(shares), tuple(totals))
        return tokens, shares, totals

    def save(self, path: str | Path) -> None:
        arrays = {"meta": np.frombuffer(json.dumps({"min_n": self.min_n, "max_n": self.max_n, "bits": self.bits}).encode(), np.uint8)}
        for n, t in self.tables.items():
            arrays.update({f"keys_{n}": t.keys, f"next_{n}": t.next_token, f"count_{n}": t.count, f"total_{n}": t.total})
        np.savez_compressed(path, **arrays)

    @classmethod
    def load(cls, path: str | Path) -> "NgramDatastore":
        with np.load(path) as f:
            meta = json.loads(bytes(f["meta"]).decode())
            tables = {n: NgramTable(keys=f[f"keys_{n}"], next_token=f[f"next_{n}"], count=f[f"count_{n}"], total=f[f"total_{n}"])
                      for n in range(meta["min_n"], meta["max_n"] + 1)}
        return cls(min_n=meta["min_n"], max_n=meta["max_n"], bits=meta["bits"], tables=tables)


def read_responses(paths: Iterable[str | Path], *, split: str = "train") -> list[list[int]]:
    """response_ids of the records of `split` in responses.jsonl files (dspark data generate)."""
    out = []
    for path in paths:
        with open(path) as f:
            for line in f:
                record = json.loads(line)
                if record.get("split", "train") == split:
                    out.append(record["response_ids"])
    return out


__all__ = ["DATASTORE_FILE", "NgramDatastore", "NgramTable", "read_responses"]
