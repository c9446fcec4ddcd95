"""The draft vocabulary (FR-Spec; EAGLE-3's `draft_vocab_size` + d2t map): the N target tokens the
drafter may propose, chosen as the most frequent tokens of the target's OWN outputs (the response
tokens of the cache's training split: what the drafter will be asked to predict).

    d2t = frequent_tokens(cache, size=8192)             # [N] int64 target ids, ascending
    coverage(cache, d2t, lm_head, split="heldout")      # how much of p_t it can reach

Why this stays lossless: the drafter's p_d is zero outside the draft vocabulary and its rows are
sent over target ids (heads.sample_sequential); the verifier's rejection sampler works on the
full target vocabulary and is exact for ANY p_d (docs/method.md §6). What it
costs: the acceptance at a position is at most the target mass inside the vocabulary,
c* = 1 - TV(p_d, p_t) <= Σ_{v∈D} p_t(v), and at temperature 0 a draft can only match an argmax
that lies in D. What it saves: the LM head and the Markov head's W2 shrink from V to N columns,
and so do all the vocabulary-sized passes of the training loss.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from dspark.training.losses import target_probs_from_hidden
from dspark.training.target_cache import TargetCache


def token_counts(cache: TargetCache, *, split: str = "train") -> np.ndarray:  # [V] int64
    """How often the target emitted each token in the split's responses."""
    counts = np.zeros(cache.vocab_size, dtype=np.int64)
    for i in cache.indices(split):
        s = cache.sequences[i]
        response = cache.tokens(i)[s.prompt_len :].numpy()
        counts += np.bincount(response, minlength=cache.vocab_size)[: cache.vocab_size]
    return counts


def frequent_tokens(cache: TargetCache, *, size: int, split: str = "train") -> torch.Tensor:  # [N] int64, ascending
    """The `size` most frequent response tokens (ties: the lower id first), sorted by id."""
    if not 1 <= size <= cache.vocab_size:
        raise ValueError(f"draft vocabulary size must be in [1, {cache.vocab_size}], got {size}")
    counts = token_counts(cache, split=split)
    order = np.lexsort((np.arange(counts.size), -counts))  # by count descending, then id ascending
    return torch.from_numpy(np.sort(order[:size])).long()


@dataclass(frozen=True)
class Coverage:
    size: int  # N
    token_share: float  # fraction of the split's response tokens that lie in D
    target_mass: float  # mean Σ_{v∈D} p_t(v) over the sampled positions: the ceiling of c* at T = 1
    argmax_share: float  # fraction of positions whose target argmax lies in D: the ceiling at T = 0


@torch.no_grad()
def coverage(cache: TargetCache, draft_to_target: torch.Tensor, lm_head: torch.Tensor, *, split: str = "heldout",
             max_positions: int = 20_000, seed: int = 0) -> Coverage:
    """How much of the target a draft vocabulary can reach, on response positions of `split`."""
    in_vocab = torch.zeros(cache.vocab_size, dtype=torch.bool)
    in_vocab[draft_to_target] = True
    rng = np.random.default_rng(seed)
    hits = total = 0
    mass = argmax = 0.0
    positions = 0
    indices = cache.indices(split)
    per_seq = max(1, max_positions // max(1, len(indices)))
    for i in indices:
        s = cache.sequences[i]
        tokens = cache.tokens(i)
        response = tokens[s.prompt_len :]
        hits += int(in_vocab[response].sum())
        total += int(response.numel())
        # p_t at position p predicts token p + 1: rows P-1 .. T-2 predict the response tokens
        rows = np.arange(s.prompt_len - 1, s.length - 1)
        if rows.size > per_seq:
            rows = np.sort(rng.choice(rows, size=per_seq, replace=False))
        p_t = target_probs_from_hidden(cache.hidden_rows(i, rows).float(), lm_head)  # [rows, V]
        mass += float(p_t[:, in_vocab].sum())
        argmax += float(in_vocab[p_t.argmax(-1)].sum())
        positions += rows.size
    return Coverage(size=int(draft_to_target.numel()), token_share=hits / max(total, 1),
                    target_mass=mass / max(positions, 1), argmax_share=argmax / max(positions, 1))


__all__ = ["Coverage", "coverage", "frequent_tokens", "token_counts"]
