"""Exact target distributions of short continuations and a chi-square test against them: the
losslessness checks shared by the engine and drafter tests."""

from __future__ import annotations

from collections import Counter

import torch

from dspark.sampling.params import logits_to_probs


def exact_sequence_probs(runtime, prompt: list[int], num_tokens: int, *, temperature: float = 1.0, top_k: int = 0,
                         top_p: float = 1.0) -> dict[tuple[int, ...], float]:
    """P(t_1..t_n) under sampling with these settings (the target's `logits_to_probs`), from the
    model's logits (one request per prefix); continuations of probability 0 are left out."""
    probs = {(): 1.0}
    for depth in range(num_tokens):
        prefixes = list(probs)
        ids = [f"exact-{depth}-{i}" for i in range(len(prefixes))]
        for rid in ids:
            runtime.add_request(rid, len(prompt) + depth)
        length = len(prompt) + depth
        tokens = torch.tensor([t for p in prefixes for t in prompt + list(p)])
        last_rows = torch.arange(1, len(prefixes) + 1) * length - 1
        logits = runtime.forward(ids, tokens, [length] * len(prefixes), logits_indices=last_rows).logits
        step = logits_to_probs(logits, temperature=temperature, top_k=top_k, top_p=top_p).double()  # [num_prefixes, vocab]
        for rid in ids:
            runtime.free_request(rid)
        probs = {p + (v,): probs[p] * float(step[i, v]) for i, p in enumerate(prefixes) for v in range(step.shape[1]) if step[i, v] > 0}
    return probs


def chi_square_pvalue(counts: Counter, probs: dict, n: int) -> float:
    """Pearson chi-square of observed counts against exact cell probabilities, cells with an
    expected count under 5 pooled (smallest first) so the asymptotic distribution holds."""
    from scipy.stats import chisquare

    cells = sorted(probs, key=probs.get)
    observed, expected = [], []
    pool_obs = pool_exp = 0.0
    for c in cells:
        if pool_exp < 5 or n * probs[c] < 5:
            pool_obs, pool_exp = pool_obs + counts.get(c, 0), pool_exp + n * probs[c]
        else:
            observed.append(counts.get(c, 0))
            expected.append(n * probs[c])
    observed.append(pool_obs)
    expected.append(pool_exp)
    assert len(observed) > 10, "too few cells for a meaningful test"
    total = sum(expected)  # == n up to float rounding, which chisquare's sum check is strict about
    return float(chisquare(observed, [e * n / total for e in expected]).pvalue)
