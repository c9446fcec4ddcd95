"""logits_to_probs is the definition of the target distribution: temperature, top-k, top-p."""

import math

import pytest
import torch

from dspark.sampling import SamplingParams, logits_to_probs


def test_temperature_divides_the_logits_before_the_softmax():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    for temperature in (0.5, 1.0, 2.0):
        probs = logits_to_probs(logits, temperature=temperature)
        torch.testing.assert_close(probs, torch.softmax(logits / temperature, -1))
    # Lower temperature sharpens: the top token gains mass.
    assert logits_to_probs(logits, temperature=0.5)[0, 0] > logits_to_probs(logits, temperature=2.0)[0, 0]


def test_output_is_fp32_rows_summing_to_one_whatever_the_input_dtype():
    logits = torch.randn(3, 11, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    probs = logits_to_probs(logits, temperature=0.8, top_k=4, top_p=0.9)
    assert probs.dtype == torch.float32
    torch.testing.assert_close(probs.sum(-1), torch.ones(3))


def test_top_k_keeps_exactly_the_k_largest_logits():
    logits = torch.randn(5, 20, generator=torch.Generator().manual_seed(1))
    probs = logits_to_probs(logits, temperature=1.0, top_k=4)
    assert ((probs > 0).sum(-1) == 4).all()
    kept = probs > 0
    assert torch.equal(kept, torch.zeros_like(kept).scatter(-1, logits.topk(4).indices, True))
    # Renormalised softmax over the kept ones.
    expected = torch.softmax(logits.masked_fill(~kept, float("-inf")), -1)
    torch.testing.assert_close(probs, expected)


def test_top_k_zero_or_at_least_vocab_is_off():
    logits = torch.randn(2, 7, generator=torch.Generator().manual_seed(2))
    for top_k in (0, 7, 100):
        torch.testing.assert_close(logits_to_probs(logits, temperature=1.0, top_k=top_k), torch.softmax(logits, -1))


def test_top_p_keeps_the_smallest_nucleus_including_the_crossing_token():
    p = torch.tensor([0.05, 0.5, 0.15, 0.3])  # sorted: 0.5 (id 1), 0.3 (id 3), 0.15 (id 2), 0.05 (id 0)
    logits = p.log()[None]
    cases = {
        0.45: {1},  # the top token alone crosses 0.45
        0.79: {1, 3},  # 0.5 + 0.3 = 0.8 crosses 0.79: id 3 is kept
        0.81: {1, 3, 2},  # 0.8 < 0.81, the crossing token is id 2
        1.0: {0, 1, 2, 3},
    }
    for top_p, expected in cases.items():
        probs = logits_to_probs(logits, temperature=1.0, top_p=top_p)[0]
        assert set((probs > 0).nonzero().flatten().tolist()) == expected, top_p
        kept = torch.tensor(sorted(expected))
        torch.testing.assert_close(probs[kept], p[kept] / p[kept].sum())


def test_a_top_p_below_fp32_range_keeps_the_most_likely_token():
    logits = torch.tensor([[0.0, 3.0, 1.0]])
    for top_p in (1e-30, 1e-300, 5e-324):  # fp32 rounds the last two to 0: the comparison must not drop everything
        assert logits_to_probs(logits, temperature=1.0, top_p=top_p).tolist() == [[0.0, 1.0, 0.0]]


def test_top_k_applies_before_top_p():
    p = torch.tensor([0.4, 0.3, 0.2, 0.1])
    # top_k=2 leaves (0.4, 0.3) -> renormalised (4/7, 3/7); top_p=0.5 then keeps only id 0.
    probs = logits_to_probs(p.log()[None], temperature=1.0, top_k=2, top_p=0.5)[0]
    assert (probs > 0).nonzero().flatten().tolist() == [0]


def test_greedy_is_temperature_zero_and_logits_to_probs_refuses_it():
    assert SamplingParams(temperature=0.0).is_greedy
    assert not SamplingParams(temperature=1e-3).is_greedy
    with pytest.raises(ValueError, match="temperature > 0"):
        logits_to_probs(torch.zeros(1, 3), temperature=0.0)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": math.nan}, "temperature"),
        ({"temperature": 1e-300}, "temperature"),  # logits / temperature would overflow fp32: NaN probabilities
        ({"temperature": math.inf}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -1}, "top_k"),
    ],
)
def test_invalid_sampling_params_raise(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("settings", [
    {"temperature": 0.5}, {"temperature": 1.5}, {"temperature": 1.0, "top_k": 3}, {"temperature": 1.0, "top_p": 0.7},
    {"temperature": 0.7, "top_k": 5, "top_p": 0.8}, {"temperature": 1.3, "top_k": 40, "top_p": 0.95},
])
def test_logits_to_probs_agrees_with_the_plain_float64_reference_the_chi_square_tests_use(settings):
    """tests/distribution_checks.reference_probs is the independent definition the losslessness
    tests compare sampled output with: same support, same probabilities up to fp32 rounding."""
    from tests.distribution_checks import reference_probs

    logits = 3.0 * torch.randn(64, 50, generator=torch.Generator().manual_seed(5))  # [64, 50]
    fast = logits_to_probs(logits, **settings)
    plain = torch.stack([reference_probs(row, **settings) for row in logits])
    assert torch.equal(fast > 0, plain > 0)
    torch.testing.assert_close(fast.double(), plain, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("kwargs,field", [
    ({"top_k": -1}, "top_k"), ({"top_k": 2.7}, "top_k"), ({"top_k": True}, "top_k"),
    ({"seed": "7"}, "seed"), ({"seed": 1.0}, "seed"), ({"seed": False}, "seed"),
    ({"seed": -(2**63) - 1}, "seed"), ({"seed": 2**64}, "seed"),
])
def test_sampling_params_refuse_what_the_generator_or_the_filter_would_misread(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_seeds_at_both_ends_of_the_generators_range_and_numpy_integers_are_accepted():
    import numpy as np

    for seed in (-(2**63), 2**64 - 1, np.int64(5)):
        torch.Generator().manual_seed(int(SamplingParams(seed=seed).seed))
    assert SamplingParams(top_k=np.int32(3)).top_k == 3


@pytest.mark.parametrize("scale", [0.5, 3.0, 10.0])  # flat rows (nucleus past the candidates: the full sort) to peaked ones
@pytest.mark.parametrize("top_p", [0.1, 0.5, 0.8, 0.95, 0.999])
def test_the_partial_sort_nucleus_is_the_full_sort_nucleus(scale, top_p):
    from dspark.sampling.params import TOP_P_CANDIDATES, top_p_drop, top_p_drop_sorted

    g = torch.Generator().manual_seed(int(scale * 100 + top_p * 1000))
    first, last = TOP_P_CANDIDATES[0], TOP_P_CANDIDATES[-1]
    vocab = 4 * last + 3
    logits = torch.randn(16, vocab, generator=g) * scale
    logits[3, 100:] = float("-inf")  # a row cut by top_k first
    logits[5] = logits[5] * 0.01  # nearly uniform: its nucleus needs the full sort
    for row, head in ((7, 2 * first), (9, 2 * last)):  # a flat head past the first tier within the last, past the last
        logits[row] = torch.randn(vocab, generator=g) * 0.1
        logits[row, :head] += 30.0
    assert torch.equal(top_p_drop(logits, top_p), top_p_drop_sorted(logits, top_p))
    kept = (~top_p_drop(logits, top_p)).sum(1)  # [16] nucleus sizes
    if top_p >= 0.8:
        assert first < int(kept[7]) <= last and int(kept[9]) > last  # the tiers the rows were built for
    small = logits[:, : first // 2]  # a vocabulary smaller than the candidates
    assert torch.equal(top_p_drop(small, top_p), top_p_drop_sorted(small, top_p))
