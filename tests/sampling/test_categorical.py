"""`sample_categorical`: the drafters' draw is exactly the row's distribution."""

from __future__ import annotations

import pytest
import torch
from scipy.stats import chisquare

from dspark.sampling.categorical import sample_categorical


def test_draws_follow_the_row_distribution_chi_square():
    probs = torch.tensor([0.5, 0.25, 0.125, 0.0625, 0.0625, 0.0])  # [V]
    n = 40_000
    draws = sample_categorical(probs.expand(n, -1), torch.Generator().manual_seed(0))  # [n]
    counts = torch.bincount(draws, minlength=6)
    assert counts[5] == 0  # probability 0: never
    assert chisquare(counts[:5].numpy(), (probs[:5] * n).numpy()).pvalue > 1e-3


def test_a_wrong_distribution_is_rejected_by_the_same_test():
    draws = sample_categorical(torch.tensor([[0.52, 0.23, 0.125, 0.0625, 0.0625]]).expand(40_000, -1),
                               torch.Generator().manual_seed(0))
    expected = torch.tensor([0.5, 0.25, 0.125, 0.0625, 0.0625]) * 40_000
    assert chisquare(torch.bincount(draws, minlength=5).numpy(), expected.numpy()).pvalue < 1e-3


def test_rows_need_not_be_normalised_and_each_row_is_its_own_distribution():
    probs = torch.tensor([[0.0, 3.0, 0.0], [2.0, 0.0, 0.0], [0.0, 0.0, 1e-30]])  # [3, V]
    for seed in range(20):
        assert sample_categorical(probs, torch.Generator().manual_seed(seed)).tolist() == [1, 0, 2]


def test_the_top_of_the_unit_interval_still_lands_on_a_token_with_mass():
    probs = torch.tensor([[0.3, 0.7, 0.0, 0.0]])

    # u = 1 - 2^-53, the largest uniform torch.rand can return: u·total may round to total
    real_rand = torch.rand
    try:
        torch.rand = lambda *a, **k: torch.full((1, 1), 1.0 - 2.0**-53, dtype=torch.float64)
        assert sample_categorical(probs).tolist() == [1]
    finally:
        torch.rand = real_rand


def test_a_seeded_generator_reproduces_the_draws():
    probs = torch.softmax(torch.randn(8, 1000, generator=torch.Generator().manual_seed(1)), dim=-1)
    a = sample_categorical(probs, torch.Generator().manual_seed(3))
    b = sample_categorical(probs, torch.Generator().manual_seed(3))
    assert torch.equal(a, b)


@pytest.mark.parametrize("probs", [torch.zeros(2, 4), torch.ones(4)])
def test_bad_rows_are_refused(probs):
    with pytest.raises(ValueError):
        sample_categorical(probs)
