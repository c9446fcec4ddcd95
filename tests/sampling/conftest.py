"""Batch builders shared by the sampling tests (exposed as fixtures that return functions)."""

from __future__ import annotations

import pytest
import torch

from dspark.sampling import DraftProbs, RejectionBatch, SamplingParams, draw_rejection_randoms, logits_to_probs

# Every kind of request the sampler must handle, cycled through by the mixed-batch builder.
MIXED_PARAMS = [
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.7, top_k=5),
    SamplingParams(temperature=1.2, top_p=0.8),
    SamplingParams(temperature=0.5, top_k=8, top_p=0.9),
    SamplingParams(temperature=1.0, top_k=3),
]


def make_mixed_batch(
    seed: int,
    *,
    num_requests: int = 8,
    vocab: int = 40,
    max_draft: int = 4,
    sparse: bool = False,
    sparse_k: int = 6,
) -> RejectionBatch:
    """A random round: greedy, plain, top-k and top-p requests, some with l_r = 0.

    Drafts come from rows close to the target (so that some are accepted), sparse rows are the
    drafter's top-`sparse_k` renormalised plus one padding entry (id -1, prob 0).
    """
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(0, max_draft + 1, (num_requests,), generator=g)
    lens[torch.randint(0, num_requests, (1,), generator=g)] = 0  # always at least one l_r = 0
    offset = int(torch.randint(0, len(MIXED_PARAMS), (1,), generator=g))
    params = [MIXED_PARAMS[(offset + r) % len(MIXED_PARAMS)] for r in range(num_requests)]
    total = int(lens.sum())
    logits = 3.0 * torch.randn(total + num_requests, vocab, generator=g)  # [rows, vocab]

    draft_rows, draft_ids = [], []
    for r, n in enumerate(lens.tolist()):
        start = int(lens[:r].sum())
        temperature = params[r].temperature or 1.0
        for k in range(n):
            target_row = logits[start + r + k]
            row = torch.softmax(target_row / temperature + 0.7 * torch.randn(vocab, generator=g), -1)
            if sparse:
                top = torch.topk(row, sparse_k)
                row = torch.zeros(vocab).scatter(0, top.indices, top.values / top.values.sum())
            draft_rows.append(row)
            if params[r].is_greedy and float(torch.rand((), generator=g)) < 0.7:
                draft_ids.append(int(target_row.argmax()))
            else:
                draft_ids.append(int(torch.multinomial(row, 1, generator=g)))
    dense = torch.stack(draft_rows) if draft_rows else torch.zeros(0, vocab)  # [total, vocab]
    if sparse:
        vals, ids = torch.topk(dense, sparse_k, dim=-1)  # [total, sparse_k]
        pad = torch.full((total, 1), -1, dtype=torch.int64)
        probs = torch.cat([vals, torch.zeros(total, 1)], 1)
        draft = DraftProbs(sparse_ids=torch.cat([ids, pad], 1), sparse_probs=probs)
    else:
        draft = DraftProbs(dense=dense)
    generators = [torch.Generator().manual_seed(1000 * seed + r) for r in range(num_requests)]
    uniforms, exp_noise = draw_rejection_randoms(lens, vocab, generators)
    return RejectionBatch(
        draft_token_ids=torch.tensor(draft_ids, dtype=torch.int64),
        num_draft_tokens=lens,
        target_logits=logits,
        draft_probs=draft,
        params=params,
        uniforms=uniforms,
        exp_noise=exp_noise,
    )


def build_batch(
    requests: list[tuple[SamplingParams, list[int], torch.Tensor, torch.Tensor | None]],
    *,
    uniforms: torch.Tensor | None = None,  # [num_draft_tokens]
    exp_noise: torch.Tensor | None = None,  # [num_requests, vocab]
    seed: int = 0,
) -> RejectionBatch:
    """A batch from explicit requests: (params, draft ids, target logits [l+1, V], draft rows [l, V] or None).

    Missing random numbers are drawn from `seed`; draft rows of requests that give None are
    uniform (greedy requests never read them); all-None gives draft_probs=None.
    """
    vocab = requests[0][2].shape[-1]
    lens = torch.tensor([len(ids) for _, ids, _, _ in requests], dtype=torch.int64)
    rows = [
        d if d is not None else torch.full((len(ids), vocab), 1.0 / vocab) for _, ids, _, d in requests
    ]
    g = torch.Generator().manual_seed(seed)
    total = int(lens.sum())
    return RejectionBatch(
        draft_token_ids=torch.tensor([t for _, ids, _, _ in requests for t in ids], dtype=torch.int64),
        num_draft_tokens=lens,
        target_logits=torch.cat([logits for _, _, logits, _ in requests]).float(),
        draft_probs=None if all(d is None for *_, d in requests) else DraftProbs(dense=torch.cat(rows).float()),
        params=[p for p, *_ in requests],
        uniforms=uniforms if uniforms is not None else torch.rand(total, generator=g),
        exp_noise=exp_noise if exp_noise is not None else torch.empty(len(requests), vocab).exponential_(generator=g),
    )


@pytest.fixture
def mixed_batch():
    return make_mixed_batch


@pytest.fixture
def batch_of():
    return build_batch


# The largest fp32 below 1: a uniform that rejects a draft whose p_d exceeds p_t by one rounding step.
LAST_UNIFORM_BELOW_ONE = float(torch.tensor(1.0).nextafter(torch.tensor(0.0)))


def rounding_vocab(at_least: int) -> int:
    """The smallest n >= at_least whose uniform fp32 target row (softmax of n zeros) sums below 1.

    A drafter whose row is that very row (p_d = p_t, the best drafter there is) is renormalised by
    the verifier to p_t / sum > p_t: the residual max(0, p_t - p_d) is all zero and
    u = LAST_UNIFORM_BELOW_ONE rejects its draft. This is the one way an all-zero residual arises
    (rounding); the fallback that handles it needs such a case to be tested at all.
    """
    from dspark.sampling.rejection_sampler import normalised_rows

    for n in range(at_least, at_least + 500):
        p_t = logits_to_probs(torch.zeros(1, n), temperature=1.0)  # [1, n]
        p_d = normalised_rows(p_t)
        if bool((p_d >= p_t).all()) and not LAST_UNIFORM_BELOW_ONE * float(p_d[0, 0]) < float(p_t[0, 0]):
            return n
    raise AssertionError(f"no uniform row of {at_least}..{at_least + 499} tokens rounds to a sum below 1")
