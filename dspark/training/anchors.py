"""Anchor sampling and training batches: cached target sequences -> teacher-forced draft blocks.

For a sequence of T tokens with a P-token prompt, an anchor is a position t with P <= t <= T-2
(the anchor x_0 is a response token, as at serving time where it is the target's last output,
and at least the first label exists). Block position k = 1..γ then has (docs/method.md §3):
    label      x*_k  = tokens[t + k]               valid iff t + k <= T - 1 (masked beyond the end)
    p_t row    hidden[t + k - 1]                   the target's final hidden that predicted t + k
    context    captured[0 .. t-1]                   positions < t only (leakage rule; BlockBatch's
                                                   mask enforces it, we also load no row >= max t)
Everything is a pure function of (seed, epoch, sequence index): the anchors of a sequence come
from numpy's Generator seeded with [seed, epoch, index], the batch order from [seed, epoch].
So a resumed run rebuilds exactly the batches an uninterrupted run would have seen, with no
data-loader state to save.

    plan = plan_batches(cache, cache.indices("train"), batch_seqs=8, seed=0, epoch=0)
    batch = sample_batch(cache, plan[0], anchors_per_seq=64, block_size=7, seed=0, epoch=0)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from dspark.drafters.dspark.model import BlockBatch
from dspark.training.target_cache import TargetCache


def sample_anchors(*, prompt_len: int, length: int, num: int, rng: np.random.Generator) -> np.ndarray:  # [≤ num] int64
    """Up to `num` distinct anchors in [prompt_len, length - 2], ascending (all of them when fewer exist)."""
    lo, hi = prompt_len, length - 2
    if hi < lo:
        return np.empty(0, dtype=np.int64)
    count = hi - lo + 1
    if num >= count:
        return np.arange(lo, hi + 1, dtype=np.int64)
    return np.sort(rng.choice(count, size=num, replace=False)).astype(np.int64) + lo


def block_labels(
    tokens: torch.Tensor,  # [T] int64 the whole sequence
    anchors: torch.Tensor,  # [nb] int64 anchor positions t
    block_size: int,  # γ
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> labels [nb, γ] (tokens[t+k], 0 where masked), mask [nb, γ] (t+k <= T-1),
    hidden_rows [nb, γ] (t+k-1, clamped into [0, T-1] where masked)."""
    length = tokens.shape[0]
    pos = anchors.unsqueeze(-1) + torch.arange(1, block_size + 1)  # [nb, γ] t + k
    mask = pos <= length - 1
    labels = torch.where(mask, tokens[pos.clamp(max=length - 1)], torch.zeros_like(pos))
    hidden_rows = (pos - 1).clamp(max=length - 1)
    return labels, mask, hidden_rows


@dataclass
class TrainBatch:
    """Draft blocks of several sequences with their labels and the target's hidden rows for p_t."""

    blocks: BlockBatch  # context [rows, L, m, d] fp32, anchors [rows, nb]
    target_tokens: torch.Tensor  # [rows, nb, γ] int64 x*_k (0 where label_mask is False)
    label_mask: torch.Tensor  # [rows, nb, γ] bool: block valid and t + k <= T - 1
    target_hidden: torch.Tensor  # [rows, nb, γ, d] fp32 final hidden at t + k - 1 (p_t = LMHead of it)
    sequence_indices: list[int]  # [rows] positions in cache.sequences
    # [rows, L + 1] int64 tokens at positions 0..L (0 past a row's last anchor): the tokens of the
    # context, which EAGLE-3's entries [embed(x_p) ; g_{p-1}] read (the parallel drafters do not)
    context_token_ids: torch.Tensor | None = None
    # the cache's logit stats at the same rows as target_hidden (None for a cache without them):
    target_lse: torch.Tensor | None = None  # [rows, nb, γ] fp32 log Σ_v exp(logits)
    target_argmax: torch.Tensor | None = None  # [rows, nb, γ] int64 the target's argmax

    @property
    def num_blocks(self) -> int:
        return int(self.blocks.block_valid.sum())

    @property
    def num_labels(self) -> int:
        return int(self.label_mask.sum())

    @property
    def context_tokens(self) -> int:
        return int(self.blocks.context_lens.sum())

    def to(self, device: torch.device | str) -> TrainBatch:
        b = self.blocks
        blocks = BlockBatch(context=b.context.to(device), context_lens=b.context_lens.to(device),
                            anchor_positions=b.anchor_positions.to(device), anchor_tokens=b.anchor_tokens.to(device),
                            block_valid=b.block_valid.to(device))
        moved = lambda t: None if t is None else t.to(device)  # noqa: E731
        return TrainBatch(blocks=blocks, target_tokens=self.target_tokens.to(device), label_mask=self.label_mask.to(device),
                          target_hidden=self.target_hidden.to(device), sequence_indices=self.sequence_indices,
                          context_token_ids=moved(self.context_token_ids), target_lse=moved(self.target_lse),
                          target_argmax=moved(self.target_argmax))


def build_batch(cache: TargetCache, seq_indices: Sequence[int], anchors: Sequence[np.ndarray], *, block_size: int) -> TrainBatch:
    """One row per sequence; each row's context is loaded up to its last anchor (positions < t are
    all any of its blocks may read)."""
    if len(seq_indices) != len(anchors) or not seq_indices:
        raise ValueError(f"need one anchor array per sequence, got {len(seq_indices)} sequences and {len(anchors)} anchor arrays")
    contexts, positions, anchor_tokens, labels, masks, hiddens, context_ids = [], [], [], [], [], [], []
    with_stats = cache.has_logit_stats
    stats = []  # per sequence (lse, argmax) [nb, γ] each
    for i, a in zip(seq_indices, anchors):
        if len(a) == 0:
            raise ValueError(f"sequence {cache.sequences[i].id!r} has no anchor (response shorter than 2 tokens?)")
        s = cache.sequences[i]
        t = torch.as_tensor(a, dtype=torch.long)
        if int(t.min()) < s.prompt_len or int(t.max()) > s.length - 2:
            raise ValueError(f"sequence {s.id!r}: anchors must be in [{s.prompt_len}, {s.length - 2}], got {t.tolist()}")
        tokens = cache.tokens(i)
        lab, mask, rows = block_labels(tokens, t, block_size)
        contexts.append(cache.captured(i, stop=int(t.max())).float())
        positions.append(t)
        anchor_tokens.append(tokens[t])
        context_ids.append(tokens[: int(t.max()) + 1])
        labels.append(lab)
        masks.append(mask)
        hiddens.append(cache.hidden_rows(i, rows.flatten().numpy()).float().view(*rows.shape, -1))
        if with_stats:
            lse, argmax = cache.logit_stats_rows(i, rows.flatten().numpy())
            stats.append((lse.view(rows.shape), argmax.view(rows.shape)))
    blocks = BlockBatch.from_sequences(contexts=contexts, anchor_positions=positions, anchor_tokens=anchor_tokens)
    rows, nb = blocks.anchor_positions.shape
    d = hiddens[0].shape[-1]
    target_tokens = torch.zeros(rows, nb, block_size, dtype=torch.long)
    label_mask = torch.zeros(rows, nb, block_size, dtype=torch.bool)
    target_hidden = torch.zeros(rows, nb, block_size, d)
    context_token_ids = torch.zeros(rows, blocks.context.shape[1] + 1, dtype=torch.long)
    for r, (lab, mask, hid, ids) in enumerate(zip(labels, masks, hiddens, context_ids)):
        target_tokens[r, : lab.shape[0]] = lab
        label_mask[r, : mask.shape[0]] = mask
        target_hidden[r, : hid.shape[0]] = hid
        context_token_ids[r, : ids.shape[0]] = ids
    target_lse = target_argmax = None
    if with_stats:
        target_lse = torch.zeros(rows, nb, block_size)
        target_argmax = torch.zeros(rows, nb, block_size, dtype=torch.long)
        for r, (lse, argmax) in enumerate(stats):
            target_lse[r, : lse.shape[0]] = lse
            target_argmax[r, : argmax.shape[0]] = argmax
    return TrainBatch(blocks=blocks, target_tokens=target_tokens, label_mask=label_mask, target_hidden=target_hidden,
                      sequence_indices=list(seq_indices), context_token_ids=context_token_ids,
                      target_lse=target_lse, target_argmax=target_argmax)


def sequence_rng(seed: int, epoch: int, index: int) -> np.random.Generator:
    return np.random.default_rng([seed, epoch, index])


def sample_batch(
    cache: TargetCache,
    seq_indices: Sequence[int],
    *,
    anchors_per_seq: int,
    block_size: int,
    seed: int,
    epoch: int,
) -> TrainBatch:
    anchors = []
    for i in seq_indices:
        s = cache.sequences[i]
        anchors.append(sample_anchors(prompt_len=s.prompt_len, length=s.length, num=anchors_per_seq, rng=sequence_rng(seed, epoch, i)))
    return build_batch(cache, seq_indices, anchors, block_size=block_size)


def plan_batches(
    cache: TargetCache,
    indices: Sequence[int],
    *,
    batch_seqs: int,
    seed: int,
    epoch: int,
    max_batch_tokens: int | None = None,
) -> list[list[int]]:
    """The epoch's batches: sequences with an anchor, shuffled by [seed, epoch], packed greedily
    up to `batch_seqs` sequences and (if set) `max_batch_tokens` context tokens per batch."""
    if batch_seqs < 1:
        raise ValueError(f"batch_seqs must be >= 1, got {batch_seqs}")
    usable = [i for i in indices if cache.sequences[i].length - 2 >= cache.sequences[i].prompt_len]
    order = [usable[j] for j in np.random.default_rng([seed, epoch]).permutation(len(usable))]
    batches, current, tokens = [], [], 0
    for i in order:
        n = cache.sequences[i].length
        if current and (len(current) >= batch_seqs or (max_batch_tokens is not None and tokens + n > max_batch_tokens)):
            batches.append(current)
            current, tokens = [], 0
        current.append(i)
        tokens += n
    if current:
        batches.append(current)
    return batches


__all__ = ["TrainBatch", "block_labels", "build_batch", "plan_batches", "sample_anchors", "sample_batch", "sequence_rng"]
