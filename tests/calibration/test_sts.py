"""Specification tests of Sequential Temperature Scaling and its metrics (dspark/calibration/sts.py)."""

from __future__ import annotations

import itertools

import pytest
import torch

from dspark.calibration.sts import (
    apply_temperatures,
    cumulative_confidence,
    ece,
    fit_sts,
    plot_reliability,
    prefix_survival,
    reliability_diagram,
    roc_auc,
    sts_diagrams,
)


def overconfident_blocks(n: int, gamma: int, *, sharpness: float, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Synthetic held-out set: true conditional acceptance σ(z), raw head logits sharpness · z
    (over-confident when sharpness > 1). Returns raw logits, observed y [n, γ], true z."""
    g = torch.Generator().manual_seed(seed)
    z = 1.2 + 1.2 * torch.randn(n, gamma, generator=g) - 0.15 * torch.arange(gamma)  # acceptance drifts down
    accepted = (torch.rand(n, gamma, generator=g) < torch.sigmoid(z)).float()
    return sharpness * z, accepted, z


def brute_force_auc(scores: list[float], labels: list[int]) -> float:
    pos = [s for s, y in zip(scores, labels) if y]
    neg = [s for s, y in zip(scores, labels) if not y]
    wins = sum(1.0 if p > q else 0.5 if p == q else 0.0 for p, q in itertools.product(pos, neg))
    return wins / (len(pos) * len(neg))


# ---- metrics ------------------------------------------------------------------------------------


def test_ece_is_the_count_weighted_gap_between_confidence_and_outcome_per_equal_width_bin():
    probs = torch.tensor([0.1, 0.2, 0.8, 0.9])
    labels = torch.tensor([0.0, 1.0, 1.0, 1.0])
    # 2 bins: [0, .5): mean .15 vs rate .5 -> .35 · 2/4; [.5, 1]: mean .85 vs rate 1 -> .15 · 2/4
    assert ece(probs, labels, num_bins=2) == pytest.approx(0.25)
    assert ece(torch.tensor([1.0, 1.0]), torch.tensor([1.0, 1.0]), num_bins=10) == 0.0  # p = 1 lands in the last bin


def test_ece_weights_exclude_samples():
    probs = torch.tensor([0.1, 0.2, 0.8, 0.9])
    labels = torch.tensor([0.0, 1.0, 1.0, 1.0])
    weighted = ece(probs, labels, num_bins=2, weights=torch.tensor([1.0, 0.0, 1.0, 1.0]))
    assert weighted == pytest.approx(ece(probs[[0, 2, 3]], labels[[0, 2, 3]], num_bins=2))


def test_roc_auc_is_rank_based_and_counts_ties_half():
    assert roc_auc(torch.tensor([0.1, 0.4, 0.35, 0.8]), torch.tensor([0, 0, 1, 1])) == pytest.approx(0.75)
    assert roc_auc(torch.tensor([0.5, 0.5]), torch.tensor([0, 1])) == pytest.approx(0.5)
    g = torch.Generator().manual_seed(0)
    scores = torch.randint(0, 5, (40,), generator=g).float()  # many ties
    labels = torch.randint(0, 2, (40,), generator=g)
    assert roc_auc(scores, labels) == pytest.approx(brute_force_auc(scores.tolist(), labels.tolist()))
    assert roc_auc(scores, torch.ones(40)) != roc_auc(scores, torch.ones(40))  # one class: nan


def test_metrics_reject_mismatched_shapes():
    with pytest.raises(ValueError, match=r"got \[3\] and \[4\]"):
        ece(torch.zeros(3), torch.zeros(4))


def test_prefix_survival_is_the_cumulative_product_of_acceptance():
    accepted = torch.tensor([[1, 1, 0, 1], [0, 1, 1, 1]])
    assert prefix_survival(accepted).tolist() == [[1, 1, 0, 0], [0, 0, 0, 0]]


def test_apply_temperatures_divides_each_positions_logit_by_its_temperature():
    logits = torch.tensor([[2.0, -1.0, 0.5]])
    temps = torch.tensor([2.0, 0.5, 1.0])
    torch.testing.assert_close(apply_temperatures(logits, temps), torch.sigmoid(torch.tensor([[1.0, -2.0, 0.5]])))
    with pytest.raises(ValueError, match=r"expected temperatures \[3\]"):
        apply_temperatures(logits, torch.ones(2))


# ---- STS ----------------------------------------------------------------------------------------


def test_sts_lowers_ece_on_overconfident_data_and_recovers_the_temperature():
    logits, accepted, _ = overconfident_blocks(20000, 5, sharpness=3.0, seed=0)
    fit = fit_sts(logits, accepted)
    assert bool((fit.ece_after <= fit.ece_before).all())
    assert fit.ece_before.mean() > 0.05 and fit.ece_after.mean() < 0.015
    torch.testing.assert_close(fit.temperatures, torch.full((5,), 3.0), atol=0.45, rtol=0)
    # held out: the fitted temperatures generalise
    test_logits, test_accepted, _ = overconfident_blocks(20000, 5, sharpness=3.0, seed=1)
    a_raw = cumulative_confidence(torch.sigmoid(test_logits))
    a_cal = cumulative_confidence(apply_temperatures(test_logits, fit.temperatures))
    s = prefix_survival(test_accepted)
    for k in range(5):
        assert ece(a_cal[:, k], s[:, k]) < 0.5 * ece(a_raw[:, k], s[:, k])


def test_sts_keeps_the_ordering_of_scores():
    logits, accepted, _ = overconfident_blocks(5000, 4, sharpness=3.0, seed=2)
    fit = fit_sts(logits, accepted)
    logits = logits.double()  # fp32 σ saturates to 1.0 at these logits, which would create ties
    calibrated = apply_temperatures(logits, fit.temperatures)
    raw = torch.sigmoid(logits)
    survived_before = torch.cat([torch.ones(5000, 1), prefix_survival(accepted)[:, :-1]], dim=1).bool()
    for k in range(4):  # conditional confidence c_k vs y_k, on the rows that reached position k
        rows = survived_before[:, k]
        assert roc_auc(calibrated[rows, k], accepted[rows, k]) == pytest.approx(roc_auc(raw[rows, k], accepted[rows, k]), abs=1e-12)
    assert roc_auc(calibrated[:, 0], accepted[:, 0]) > 0.7  # informative scores, not a vacuous check
    assert torch.equal(torch.argsort(calibrated[:, 0], stable=True), torch.argsort(raw[:, 0], stable=True))


def test_sts_fits_left_to_right_keeping_earlier_temperatures_fixed():
    logits, accepted, _ = overconfident_blocks(4000, 3, sharpness=2.0, seed=3)
    full = fit_sts(logits, accepted)
    first_two = fit_sts(logits[:, :2], accepted[:, :2])
    assert torch.equal(full.temperatures[:2], first_two.temperatures)  # later positions never move earlier T


def test_sts_leaves_calibrated_data_near_temperature_one():
    logits, accepted, _ = overconfident_blocks(20000, 3, sharpness=1.0, seed=4)
    fit = fit_sts(logits, accepted)
    assert bool(((fit.temperatures > 0.8) & (fit.temperatures < 1.25)).all()), fit.temperatures


def test_sts_excludes_unverified_positions():
    logits, accepted, _ = overconfident_blocks(4000, 2, sharpness=2.0, seed=5)
    valid = torch.ones(4000, 2, dtype=torch.bool)
    valid[:2000, 1] = False
    garbage = accepted.clone()
    garbage[:2000, 1] = 1 - garbage[:2000, 1]  # what an unverified position "observed" must not matter
    assert torch.equal(fit_sts(logits, accepted, valid=valid).temperatures, fit_sts(logits, garbage, valid=valid).temperatures)


def test_sts_rejects_bad_inputs():
    with pytest.raises(ValueError, match=r"got \[4, 2\] and \[4, 3\]"):
        fit_sts(torch.zeros(4, 2), torch.zeros(4, 3))
    with pytest.raises(ValueError, match="positive temperatures"):
        fit_sts(torch.zeros(4, 2), torch.zeros(4, 2), grid=torch.tensor([0.0, 1.0]))


# ---- reliability diagrams -----------------------------------------------------------------------


def test_reliability_diagram_bins_and_plot_writes_a_png(tmp_path):
    d = reliability_diagram(torch.tensor([0.1, 0.2, 0.8, 0.9]), torch.tensor([0.0, 1.0, 1.0, 1.0]), num_bins=2)
    torch.testing.assert_close(d.mean_confidence, torch.tensor([0.15, 0.85], dtype=torch.float64))
    torch.testing.assert_close(d.observed_rate, torch.tensor([0.5, 1.0], dtype=torch.float64))
    assert d.weight.tolist() == [2.0, 2.0] and d.ece == pytest.approx(0.25)

    logits, accepted, _ = overconfident_blocks(3000, 3, sharpness=3.0, seed=6)
    fit = fit_sts(logits, accepted)
    curves = {"raw": sts_diagrams(logits, accepted, torch.ones(3)), "STS": sts_diagrams(logits, accepted, fit.temperatures)}
    assert [c.ece for c in curves["STS"]] == pytest.approx(fit.ece_after.tolist())
    path = plot_reliability(tmp_path / "reliability.png", curves, title="tiny")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
