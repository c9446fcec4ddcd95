"""Exact target distributions of short continuations and a chi-square test against them: the
losslessness checks shared by the engine and drafter tests.

The level: a correct sampler passes at p > P_PASS = 1e-3 (seeds are fixed, so each test is
deterministic; with fresh seeds a correct sampler would fail one setting in a thousand), and the
sample sizes are chosen so that deliberately wrong samplers get p < P_WRONG = 1e-6 from the same
statistic (their tests assert that: none of these checks can pass vacuously)."""

from __future__ import annotations

import math
from collections import Counter

import torch

P_PASS = 1e-3  # a correct sampler's p-value exceeds this
P_WRONG = 1e-6  # a wrong sampler's p-value falls below this, at the same sample size


def reference_probs(logits: torch.Tensor, *, temperature: float, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """The target distribution of one logits row [vocab] -> [vocab] float64, written out plainly
    and independently of `logits_to_probs` (which tests/sampling/test_params.py holds to it):
    divide by the temperature; keep the tokens whose logit is at least the k-th largest; walking
    down from the most likely of those, keep each token while the mass before it is below top_p
    (so the most likely one and the one that crosses top_p are kept); softmax over what is kept."""
    z = [float(x) / temperature for x in logits.double().tolist()]
    order = sorted(range(len(z)), key=lambda v: -z[v])  # most likely first
    if 0 < top_k < len(z):
        order = [v for v in order if z[v] >= z[order[top_k - 1]]]
    if top_p < 1.0:
        mass = [math.exp(z[v] - z[order[0]]) for v in order]
        total, before, nucleus = sum(mass), 0.0, []
        for v, m in zip(order, mass):
            if nucleus and before >= top_p:
                break
            nucleus.append(v)
            before += m / total
        order = nucleus
    weights = {v: math.exp(z[v] - z[order[0]]) for v in order}
    total = sum(weights.values())
    return torch.tensor([weights.get(v, 0.0) / total for v in range(len(z))], dtype=torch.float64)


def exact_sequence_probs(runtime, prompt: list[int], num_tokens: int, *, temperature: float = 1.0, top_k: int = 0,
                         top_p: float = 1.0) -> dict[tuple[int, ...], float]:
    """P(t_1..t_n) under sampling with these settings (`reference_probs` of the target's logits,
    one request per prefix); continuations of probability 0 are left out."""
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
        step = torch.stack([reference_probs(row, temperature=temperature, top_k=top_k, top_p=top_p)
                            for row in logits])  # [num_prefixes, vocab]
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


def losslessness_pvalue(counts: Counter, probs: dict, n: int) -> float:
    """The chi-square p-value of `counts` against the exact `probs`, and 0 when a sample has
    probability 0 (outside the target's top-k / top-p): an impossible outcome rejects outright."""
    if any(c not in probs for c in counts):
        return 0.0
    return chi_square_pvalue(counts, probs, n)
