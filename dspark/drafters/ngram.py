"""Prompt-lookup (n-gram) drafter: copy what followed the latest earlier occurrence of the
last n tokens. No model, so it exercises the speculative loop before trained drafters exist,
and it is strong where outputs quote their context (code edits, extraction, repetition).

Its proposals are deterministic, i.e. sampled from a point mass: p_d(x_k) = 1. The rejection
sampler then accepts x_k with probability p_t(x_k), which keeps the output exactly the target's.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dspark.drafters.base import Drafter, DrafterSpec, DraftProposal, DraftRequest


def find_ngram_continuation(tokens: np.ndarray, *, min_n: int, max_n: int, k: int) -> list[int]:
    """Longest n (max_n down to min_n) whose last-n suffix occurred earlier; return up to k
    tokens that followed its most recent earlier occurrence. tokens: [seq_len] int64."""
    seq_len = tokens.shape[0]
    for n in range(min(max_n, seq_len - 1), min_n - 1, -1):
        suffix = tokens[seq_len - n:]
        # windows[i] = tokens[i : i + n] for every start that ends before the suffix itself
        windows = np.lib.stride_tricks.sliding_window_view(tokens[: seq_len - 1], n)
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return tokens[start : start + k].tolist()
    return []


@dataclass
class NgramDrafter(Drafter):
    min_n: int = 1
    max_n: int = 4

    spec = DrafterSpec(name="ngram")  # stateless: the base's lifecycle defaults

    def __post_init__(self) -> None:
        if not 1 <= self.min_n <= self.max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got min_n={self.min_n}, max_n={self.max_n}")

    def propose(self, requests: list[DraftRequest]) -> list[DraftProposal]:
        out = []
        for req in requests:
            if req.max_draft_tokens <= 0:
                out.append(DraftProposal.empty())
                continue
            tokens = np.asarray(req.token_ids, dtype=np.int64)
            draft = find_ngram_continuation(tokens, min_n=self.min_n, max_n=self.max_n, k=req.max_draft_tokens)
            proposal = DraftProposal.point_mass(draft) if draft else DraftProposal.empty()
            proposal.free = True  # a search in the context, no model forward
            out.append(proposal)
        return out
