"""Per-round acceptance records of an offline evaluation, and the paper's statistics over them.

A round of chain speculative decoding (docs/method.md §1) verifies ℓ drafts x_1..x_ℓ after the
anchor x_0, accepts a prefix of a ≤ ℓ of them and emits one more token (the corrected token
at the first rejection, else the bonus token): a + 1 tokens. One round is therefore fully
described, for the statistics here, by (ℓ, a) and, for drafters that have them, the
calibrated conditional confidences c_1..c_ℓ it proposed with. From those:

    τ = Σ_rounds (a + 1) / #rounds                           accepted length per round (Table 1)
    P(accept k | accepted k-1) = #{a ≥ k} / #{a ≥ k-1, ℓ ≥ k}  position-wise acceptance (Fig. 2)
    static threshold C (Fig. 5): ℓ_C = leading drafts with c_k ≥ C, and because acceptance
        of x_k does not depend on whether later drafts are verified, that round would have
        accepted min(a, ℓ_C) drafts: τ_C = mean(min(a, ℓ_C) + 1), verified ℓ_C + 1 tokens
    reliability (Fig. 6): pairs (c_k, 1[k ≤ a]) for every position the verifier decided on
        (k ≤ min(a + 1, ℓ)), and per position k the prefix survival a_k = Π_{i≤k} c_i against
        s_k = 1[a ≥ k] over rounds with ℓ ≥ k (what STS calibrates, docs/method.md §4).

Pure numpy functions, no model: the runner (runner.py) produces `RoundRecords`, the report
(offline_eval.py) turns them into numbers. Run the tests: python -m pytest tests/evaluation -q
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from dspark.calibration.sts import DEFAULT_NUM_BINS, reliability_diagram

# Static thresholds of the Fig. 5 sweep; C = 0 verifies every draft (the run itself).
DEFAULT_THRESHOLDS = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95)


@dataclass
class RoundRecords:
    """The decode rounds of one or more requests, in any order (statistics are order-free)."""

    num_drafts: np.ndarray  # [R] int64 ℓ: drafts verified in the round
    num_accepted: np.ndarray  # [R] int64 a: of those, accepted (0 <= a <= ℓ)
    confidences: np.ndarray | None = None  # [R, width] float64 c_k of the verified drafts, NaN past ℓ; None = no confidences

    def __post_init__(self) -> None:
        self.num_drafts = np.asarray(self.num_drafts, dtype=np.int64).reshape(-1)
        self.num_accepted = np.asarray(self.num_accepted, dtype=np.int64).reshape(-1)
        if self.num_drafts.shape != self.num_accepted.shape:
            raise ValueError(f"num_drafts {self.num_drafts.shape} and num_accepted {self.num_accepted.shape} differ in length")
        if (self.num_accepted < 0).any() or (self.num_accepted > self.num_drafts).any():
            raise ValueError("every round needs 0 <= accepted <= drafts")
        if self.confidences is not None:
            self.confidences = np.asarray(self.confidences, dtype=np.float64)
            if self.confidences.ndim != 2 or self.confidences.shape[0] != self.num_rounds:
                raise ValueError(f"confidences must be [{self.num_rounds}, width], got {list(self.confidences.shape)}")
            if self.num_rounds and int(self.num_drafts.max()) > self.confidences.shape[1]:
                raise ValueError(f"a round verified {int(self.num_drafts.max())} drafts, confidences have width {self.confidences.shape[1]}")

    @property
    def num_rounds(self) -> int:
        return int(self.num_drafts.shape[0])

    @property
    def width(self) -> int:
        """Largest position the records can speak about."""
        if self.confidences is not None:
            return int(self.confidences.shape[1])
        return int(self.num_drafts.max(initial=0))

    @classmethod
    def concat(cls, parts: Sequence[RoundRecords]) -> RoundRecords:
        """All rounds of `parts`; confidences are kept only if every part has them."""
        parts = list(parts)
        if not parts:
            return cls(np.zeros(0), np.zeros(0))
        drafts = np.concatenate([p.num_drafts for p in parts])
        accepted = np.concatenate([p.num_accepted for p in parts])
        if any(p.confidences is None for p in parts):
            return cls(drafts, accepted)
        width = max(p.width for p in parts)
        padded = [np.pad(p.confidences, ((0, 0), (0, width - p.width)), constant_values=np.nan) for p in parts]
        return cls(drafts, accepted, np.concatenate(padded) if padded else np.zeros((0, width)))


# ---- τ and position-wise acceptance ---------------------------------------------------------


def mean_accepted_length(records: RoundRecords) -> float:
    """τ = mean over rounds of a + 1 (accepted drafts + the corrected or bonus token); nan without rounds."""
    if records.num_rounds == 0:
        return float("nan")
    return float((records.num_accepted + 1).sum() / records.num_rounds)


@dataclass
class PositionAcceptance:
    reached: np.ndarray  # [γ] int64 rounds where x_k was verified after x_1..x_{k-1} were accepted
    accepted: np.ndarray  # [γ] int64 of those, rounds where x_k was accepted
    rate: np.ndarray  # [γ] float64 P(accept k | accepted k-1) = accepted / reached, nan where never reached

    def to_json(self) -> dict:
        return {"rate": _floats(self.rate), "reached": self.reached.tolist(), "accepted": self.accepted.tolist()}


def position_acceptance(records: RoundRecords, gamma: int) -> PositionAcceptance:
    """Conditional acceptance of each draft position k = 1..γ (paper Fig. 2)."""
    k = np.arange(1, gamma + 1)  # [γ]
    a = records.num_accepted[:, None]  # [R, 1]
    reached = ((a >= k - 1) & (records.num_drafts[:, None] >= k)).sum(axis=0)  # [γ]
    accepted = (a >= k).sum(axis=0)  # [γ]; a ≥ k implies ℓ ≥ k and a ≥ k-1
    with np.errstate(invalid="ignore", divide="ignore"):
        rate = np.where(reached > 0, accepted / np.maximum(reached, 1), np.nan)
    return PositionAcceptance(reached=reached.astype(np.int64), accepted=accepted.astype(np.int64), rate=rate)


# ---- static confidence threshold (Fig. 5) ---------------------------------------------------


@dataclass
class ThresholdSweep:
    thresholds: np.ndarray  # [n] C
    accepted_length: np.ndarray  # [n] τ_C = mean(min(a, ℓ_C) + 1)
    verified_per_round: np.ndarray  # [n] mean(ℓ_C + 1): tokens each request sends to the verifier (anchor included)
    acceptance_rate: np.ndarray  # [n] Σ min(a, ℓ_C) / Σ ℓ_C, nan when no draft passes C
    cumulative: bool  # False: cut at the first c_k < C (paper); True: at the first a_k = Π c_i < C (`threshold:C` policy)

    def to_json(self) -> dict:
        return {"thresholds": _floats(self.thresholds), "accepted_length": _floats(self.accepted_length),
                "verified_per_round": _floats(self.verified_per_round), "acceptance_rate": _floats(self.acceptance_rate)}


def cut_lengths(records: RoundRecords, threshold: float, *, cumulative: bool = False) -> np.ndarray:  # [R] int64 ℓ_C
    """Drafts each round keeps when cut before the first confidence below `threshold`."""
    if records.confidences is None:
        raise ValueError("the threshold sweep needs a drafter with confidences")
    conf = records.confidences  # [R, width]
    if cumulative:
        conf = np.cumprod(np.nan_to_num(conf, nan=0.0), axis=1)
    width = conf.shape[1]
    verified = np.arange(width)[None, :] < records.num_drafts[:, None]  # [R, width]
    passes = verified & (np.nan_to_num(conf, nan=-1.0) >= threshold)  # [R, width]
    return np.cumprod(passes, axis=1).sum(axis=1).astype(np.int64)  # leading run of passes


def threshold_sweep(records: RoundRecords, thresholds: Sequence[float] = DEFAULT_THRESHOLDS, *,
                    cumulative: bool = False) -> ThresholdSweep:
    """Accepted length and verification cost if drafts had been cut at a static threshold C."""
    bad = [c for c in thresholds if not 0.0 <= c <= 1.0]
    if bad:
        raise ValueError(f"thresholds must lie in [0, 1], got {bad}")
    rounds = max(records.num_rounds, 1)
    lengths, verified, rates = [], [], []
    for c in thresholds:
        kept = cut_lengths(records, c, cumulative=cumulative)  # [R]
        accepted = np.minimum(records.num_accepted, kept)  # [R]: acceptance of x_k ignores later drafts
        lengths.append((accepted + 1).sum() / rounds)
        verified.append((kept + 1).sum() / rounds)
        rates.append(accepted.sum() / kept.sum() if kept.sum() else np.nan)
    if records.num_rounds == 0:
        lengths, verified = [np.nan] * len(thresholds), [np.nan] * len(thresholds)
    return ThresholdSweep(thresholds=np.asarray(thresholds, dtype=np.float64), accepted_length=np.asarray(lengths, dtype=np.float64),
                          verified_per_round=np.asarray(verified, dtype=np.float64),
                          acceptance_rate=np.asarray(rates, dtype=np.float64), cumulative=cumulative)


# ---- reliability (Fig. 6) -------------------------------------------------------------------


def conditional_pairs(records: RoundRecords) -> tuple[np.ndarray, np.ndarray]:
    """(c_k [n], accepted [n]) for every position the verifier decided on: k ≤ min(a + 1, ℓ)."""
    if records.confidences is None:
        raise ValueError("reliability needs a drafter with confidences")
    width = records.confidences.shape[1]
    k = np.arange(1, width + 1)[None, :]  # [1, width]
    decided = (k <= np.minimum(records.num_accepted + 1, records.num_drafts)[:, None])  # [R, width]
    accepted = k <= records.num_accepted[:, None]  # [R, width]
    return records.confidences[decided], accepted[decided].astype(np.float64)


def survival_pairs(records: RoundRecords, position: int) -> tuple[np.ndarray, np.ndarray]:
    """(a_k [n], s_k [n]) at position k (1-based) over the rounds that verified x_k."""
    if records.confidences is None:
        raise ValueError("reliability needs a drafter with confidences")
    if position < 1:
        raise ValueError(f"positions are 1-based, got {position}")
    rows = records.num_drafts >= position  # [R]
    a_k = np.prod(records.confidences[rows, :position], axis=1)  # [n] Π_{i≤k} c_i
    return a_k, (records.num_accepted[rows] >= position).astype(np.float64)


def reliability(records: RoundRecords, gamma: int, *, num_bins: int = DEFAULT_NUM_BINS) -> dict:
    """JSON-ready reliability diagrams: the pooled conditional c_k against acceptance, and per
    position a_k against prefix survival s_k (equal-width bins, `calibration.sts`)."""
    conf, acc = conditional_pairs(records)
    out = {"conditional": _diagram_json(conf, acc, num_bins), "positions": []}
    for k in range(1, gamma + 1):
        a_k, s_k = survival_pairs(records, k)
        out["positions"].append(_diagram_json(a_k, s_k, num_bins))
    return out


def _diagram_json(probs: np.ndarray, labels: np.ndarray, num_bins: int) -> dict:
    if probs.size == 0:
        return {"n": 0, "ece": None, "mean_confidence": [], "observed_rate": [], "weight": []}
    d = reliability_diagram(torch.from_numpy(probs), torch.from_numpy(labels), num_bins=num_bins)
    return {"n": int(probs.size), "ece": d.ece, "mean_confidence": _floats(d.mean_confidence.numpy()),
            "observed_rate": _floats(d.observed_rate.numpy()), "weight": _floats(d.weight.numpy())}


def _floats(values) -> list[float | None]:
    """JSON has no nan: undefined values (empty bins, positions never reached) become null."""
    return [None if not np.isfinite(v) else float(v) for v in np.asarray(values, dtype=np.float64).reshape(-1)]


__all__ = [
    "DEFAULT_THRESHOLDS", "PositionAcceptance", "RoundRecords", "ThresholdSweep", "conditional_pairs", "cut_lengths",
    "mean_accepted_length", "position_acceptance", "reliability", "survival_pairs", "threshold_sweep",
]
