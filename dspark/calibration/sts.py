"""Sequential Temperature Scaling (STS, docs/method.md §4) and the calibration metrics around it.

The confidence head's raw c_k = σ(l_k) rank well but are over-confident; the scheduler needs
absolute values of the prefix survival a_k = Π_{i≤k} c_i. On a held-out set of blocks with raw
logits l [n, γ] and observed acceptance y [n, γ] (y_k = 1 iff x_k was accepted given x_<k
were; survival s_k = Π_{i≤k} y_i), STS fits one temperature per position, left to right:
    T_k = argmin_T ECE( a_{k-1} · σ(l_k / T),  s_k ),   a_{k-1} fixed by T_1..T_{k-1},
by grid search. Dividing a logit by T > 0 is monotone, so each position's ranking of its
conditional confidences (and its ROC-AUC) is unchanged; only the values move.

This module owns: `fit_sts`, `apply_temperatures`, `ece` (equal-width bins, count-weighted),
`roc_auc` (rank based, ties averaged), `reliability_diagram` and `plot_reliability` (PNG).
Run the tests: python -m pytest tests/calibration -q
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

DEFAULT_NUM_BINS = 15


def default_grid() -> torch.Tensor:  # [g] float64, ascending, includes T = 1 exactly
    """Temperatures 0.05..20 on a log scale (300 points), plus 1.0 (identity)."""
    grid = torch.logspace(math.log10(0.05), math.log10(20.0), 300, dtype=torch.float64)
    return torch.cat([grid, torch.ones(1, dtype=torch.float64)]).unique()


def prefix_survival(accepted: torch.Tensor) -> torch.Tensor:
    # accepted: [n, γ] {0, 1} conditional acceptance -> [n, γ] s_k = Π_{i≤k} y_i
    return accepted.to(torch.float64).cumprod(dim=-1)


def apply_temperatures(
    confidence_logits: torch.Tensor,  # [..., γ] raw logits l_k
    temperatures: torch.Tensor,  # [γ] T_k > 0
) -> torch.Tensor:  # [..., γ] calibrated conditional confidences c_k = σ(l_k / T_k)
    if temperatures.dim() != 1 or temperatures.shape[0] != confidence_logits.shape[-1]:
        raise ValueError(f"expected temperatures [{confidence_logits.shape[-1]}], got {list(temperatures.shape)}")
    if not bool((temperatures > 0).all()):
        raise ValueError(f"temperatures must be > 0, got {temperatures.tolist()}")
    return torch.sigmoid(confidence_logits / temperatures.to(confidence_logits.dtype))


def cumulative_confidence(conditional: torch.Tensor) -> torch.Tensor:
    # conditional: [..., γ] c_k -> [..., γ] a_k = Π_{i≤k} c_i (what the scheduler ranks)
    return conditional.cumprod(dim=-1)


# ---- metrics ------------------------------------------------------------------------------------


def _bin_index(probs: torch.Tensor, num_bins: int) -> torch.Tensor:
    # probs: [...] in [0, 1] -> [...] int64 bin in [0, num_bins): equal width, p = 1 in the last bin
    return (probs * num_bins).long().clamp(0, num_bins - 1)


def _ece_rows(
    probs: torch.Tensor,  # [g, n] candidate confidences (one row per candidate temperature)
    labels: torch.Tensor,  # [n] observed outcomes in [0, 1]
    weights: torch.Tensor,  # [n] sample weights (0 = excluded)
    num_bins: int,
) -> torch.Tensor:  # [g] ECE of each row
    # ECE = Σ_b (W_b / W) |mean_b(p) - mean_b(y)| = Σ_b |Σ_{i∈b} w_i (p_i - y_i)| / W
    g = probs.shape[0]
    gaps = torch.zeros(g, num_bins, dtype=torch.float64, device=probs.device)
    gaps.scatter_add_(1, _bin_index(probs, num_bins), (weights * (probs - labels)).to(torch.float64).expand(g, -1).contiguous())
    return gaps.abs().sum(dim=1) / weights.sum().clamp_min(1e-300)


def ece(
    probs: torch.Tensor,  # [n] predicted probabilities
    labels: torch.Tensor,  # [n] observed outcomes {0, 1}
    *,
    num_bins: int = DEFAULT_NUM_BINS,
    weights: torch.Tensor | None = None,  # [n] (e.g. a validity mask); None = all 1
) -> float:
    """Expected calibration error: equal-width bins on [0, 1], each bin's |mean confidence -
    observed rate| weighted by its share of the samples."""
    probs, labels, weights = _check_pairs(probs, labels, weights)
    if float(weights.sum()) == 0:
        raise ValueError("ece needs at least one sample with non-zero weight")
    return float(_ece_rows(probs.unsqueeze(0), labels, weights, num_bins)[0])


def roc_auc(scores: torch.Tensor, labels: torch.Tensor) -> float:
    """ROC-AUC by ranks (Mann-Whitney U): P(score of a positive > score of a negative), ties
    counted half. scores, labels: [n]. nan when only one class is present."""
    scores, labels, _ = _check_pairs(scores, labels, None)
    pos = labels > 0.5
    num_pos, num_neg = int(pos.sum()), int((~pos).sum())
    if num_pos == 0 or num_neg == 0:
        return float("nan")
    _, inverse, counts = torch.unique(scores, return_inverse=True, return_counts=True)  # unique values ascending
    first_rank = counts.cumsum(0) - counts + 1  # [u] 1-based rank of each value's first occurrence
    avg_rank = first_rank.double() + (counts.double() - 1) / 2  # [u] tied values share their mean rank
    rank_sum = float(avg_rank[inverse][pos].sum())
    return (rank_sum - num_pos * (num_pos + 1) / 2) / (num_pos * num_neg)


def _check_pairs(a: torch.Tensor, b: torch.Tensor, weights: torch.Tensor | None):
    if a.dim() != 1 or a.shape != b.shape:
        raise ValueError(f"expected two [n] tensors of equal length, got {list(a.shape)} and {list(b.shape)}")
    w = torch.ones_like(a, dtype=torch.float64) if weights is None else weights.to(torch.float64)
    if w.shape != a.shape:
        raise ValueError(f"expected weights [{a.shape[0]}], got {list(w.shape)}")
    return a.to(torch.float64), b.to(torch.float64), w


# ---- fitting ------------------------------------------------------------------------------------


@dataclass
class STSFit:
    temperatures: torch.Tensor  # [γ] fp32 T_k
    ece_before: torch.Tensor  # [γ] float64 ECE of the raw a_k against s_k
    ece_after: torch.Tensor  # [γ] float64 ECE of the calibrated a_k against s_k


def fit_sts(
    confidence_logits: torch.Tensor,  # [n, γ] raw logits l_k
    accepted: torch.Tensor,  # [n, γ] {0, 1} y_k: accepted given all previous accepted
    *,
    valid: torch.Tensor | None = None,  # [n, γ] bool, False = position not verified (excluded)
    grid: torch.Tensor | None = None,  # [g] candidate temperatures > 0; default `default_grid()`
    num_bins: int = DEFAULT_NUM_BINS,
) -> STSFit:
    """Left to right over k: the grid temperature minimising ECE(a_k, s_k) with T_<k fixed.
    Ties go to the temperature closest to 1 (in log scale). T = 1 is in the default grid, so on
    the fitting set position 1's ECE never ends up above the raw one; later positions are fitted
    on top of the already calibrated a_{k-1}, so theirs can (and on tiny sets sometimes does)."""
    if confidence_logits.dim() != 2 or confidence_logits.shape != accepted.shape:
        raise ValueError(f"expected confidence_logits and accepted [n, γ], got {list(confidence_logits.shape)} and {list(accepted.shape)}")
    if valid is not None and valid.shape != accepted.shape:
        raise ValueError(f"expected valid {list(accepted.shape)}, got {list(valid.shape)}")
    grid = default_grid() if grid is None else grid.to(torch.float64)
    if grid.dim() != 1 or grid.numel() == 0 or not bool((grid > 0).all()):
        raise ValueError(f"grid must be a non-empty 1-D tensor of positive temperatures, got {grid}")
    n, gamma = confidence_logits.shape
    logits = confidence_logits.to(torch.float64)
    survival = prefix_survival(accepted)  # [n, γ]
    weights = torch.ones(n, gamma, dtype=torch.float64) if valid is None else valid.to(torch.float64)
    raw = cumulative_confidence(torch.sigmoid(logits))  # [n, γ] uncalibrated a_k
    temps = torch.ones(gamma, dtype=torch.float64)
    before = torch.empty(gamma, dtype=torch.float64)
    after = torch.empty(gamma, dtype=torch.float64)
    a_prev = torch.ones(n, dtype=torch.float64)  # a_{k-1}, calibrated
    for k in range(gamma):
        w = weights[:, k]
        before[k] = _ece_rows(raw[:, k].unsqueeze(0), survival[:, k], w, num_bins)[0]
        candidates = a_prev.unsqueeze(0) * torch.sigmoid(logits[:, k].unsqueeze(0) / grid.unsqueeze(1))  # [g, n]
        errors = _ece_rows(candidates, survival[:, k], w, num_bins)  # [g]
        if float(w.sum()) > 0:
            tied = errors <= errors.min() + 1e-12
            closeness = torch.where(tied, grid.log().abs(), torch.full_like(grid, math.inf))
            best = int(closeness.argmin())
            temps[k] = grid[best]
            after[k] = errors[best]
        else:  # no verified sample at this position: leave it uncalibrated
            after[k] = before[k]
        a_prev = a_prev * torch.sigmoid(logits[:, k] / temps[k])
    return STSFit(temperatures=temps.float(), ece_before=before, ece_after=after)


# ---- reliability diagrams -----------------------------------------------------------------------


@dataclass
class ReliabilityDiagram:
    bin_edges: torch.Tensor  # [num_bins + 1] float64, equal width on [0, 1]
    mean_confidence: torch.Tensor  # [num_bins] float64, nan in empty bins
    observed_rate: torch.Tensor  # [num_bins] float64, nan in empty bins
    weight: torch.Tensor  # [num_bins] float64 total sample weight per bin (counts when unweighted)
    ece: float


def reliability_diagram(
    probs: torch.Tensor,  # [n]
    labels: torch.Tensor,  # [n]
    *,
    num_bins: int = DEFAULT_NUM_BINS,
    weights: torch.Tensor | None = None,  # [n]
) -> ReliabilityDiagram:
    probs, labels, weights = _check_pairs(probs, labels, weights)
    bins = _bin_index(probs, num_bins)
    per_bin = torch.zeros(num_bins, dtype=torch.float64).scatter_add_(0, bins, weights)
    conf = torch.zeros(num_bins, dtype=torch.float64).scatter_add_(0, bins, weights * probs) / per_bin
    rate = torch.zeros(num_bins, dtype=torch.float64).scatter_add_(0, bins, weights * labels) / per_bin
    return ReliabilityDiagram(
        bin_edges=torch.linspace(0, 1, num_bins + 1, dtype=torch.float64),
        mean_confidence=conf,  # 0/0 = nan in empty bins
        observed_rate=rate,
        weight=per_bin,
        ece=float(_ece_rows(probs.unsqueeze(0), labels, weights, num_bins)[0]) if float(weights.sum()) > 0 else float("nan"),
    )


def sts_diagrams(
    confidence_logits: torch.Tensor,  # [n, γ]
    accepted: torch.Tensor,  # [n, γ]
    temperatures: torch.Tensor,  # [γ]
    *,
    valid: torch.Tensor | None = None,  # [n, γ] bool
    num_bins: int = DEFAULT_NUM_BINS,
) -> list[ReliabilityDiagram]:
    """One diagram per position k: calibrated a_k against observed prefix survival s_k."""
    a = cumulative_confidence(apply_temperatures(confidence_logits.to(torch.float64), temperatures))
    s = prefix_survival(accepted)
    return [
        reliability_diagram(a[:, k], s[:, k], num_bins=num_bins, weights=None if valid is None else valid[:, k])
        for k in range(a.shape[1])
    ]


def plot_reliability(
    path: str | Path,
    curves: Mapping[str, Sequence[ReliabilityDiagram]],  # label -> one diagram per position
    *,
    title: str = "",
) -> Path:
    """A PNG with one panel per position; each curve is observed survival against mean
    predicted a_k per bin, with its ECE in the legend, and the diagonal for reference."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lengths = {len(v) for v in curves.values()}
    if len(lengths) != 1 or 0 in lengths:
        raise ValueError(f"every curve needs the same non-zero number of positions, got {sorted(lengths)}")
    num_panels = lengths.pop()
    cols = min(num_panels, 4)
    rows = -(-num_panels // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(3.2 * cols, 3.2 * rows), squeeze=False)
    for k in range(rows * cols):
        ax = axes[k // cols][k % cols]
        if k >= num_panels:
            ax.axis("off")
            continue
        ax.plot([0, 1], [0, 1], color="0.7", linestyle="--", linewidth=1)
        for label, diagrams in curves.items():
            d = diagrams[k]
            keep = d.weight > 0
            ax.plot(d.mean_confidence[keep].numpy(), d.observed_rate[keep].numpy(), marker="o", markersize=3,
                    label=f"{label} (ECE {100 * d.ece:.1f}%)")
        ax.set(xlim=(0, 1), ylim=(0, 1), title=f"position {k + 1}", xlabel="predicted a_k", ylabel="observed survival")
        ax.legend(fontsize=7, loc="upper left")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


__all__ = [
    "DEFAULT_NUM_BINS", "ReliabilityDiagram", "STSFit", "apply_temperatures", "cumulative_confidence",
    "default_grid", "ece", "fit_sts", "plot_reliability", "prefix_survival", "reliability_diagram",
    "roc_auc", "sts_diagrams",
]
