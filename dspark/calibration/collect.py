"""Held-out acceptance statistics for STS: draft like serving does, verify with the real target.

For each held-out sequence (from the target cache) and each sampled anchor t, the drafter drafts
x_1..x_γ from the cached context (positions < t) at the serving temperature, exactly as
`DSparkDrafter.draft` does at serving time, and records its raw confidence logits l_k. The
target then verifies the block as the serving verifier would, on the DRAFTED prefix:
    p_t_1  = target distribution after tokens[0..t]                    (the prefill's row t)
    p_t_k  = target distribution after tokens[0..t], x_1..x_{k-1}       (k >= 2)
and the observed acceptance is the serving event itself, one Bernoulli draw per position,
    y_k = 1[u_k < min(1, p_t_k(x_k) / p_d_k(x_k))]       (temperature 0: y_k = 1[x_k = argmax p_t_k])
i.e. "accepted given x_1..x_{k-1} accepted" (STS fits a_k = Π c_i against s_k = Π y_i). The
analytic c*_k = 1 - TV(p_d_k, p_t_k) (the training label, here with the exact p_t after the
drafted prefix) is recorded too. Cached hidden states cannot give p_t_k for k >= 2: they are
conditioned on the data's continuation, not on the drafted tokens.

Cost: per sequence one prefill up to its last anchor, then for each anchor (descending, so a KV
truncation to t+1 discards only what later rounds do not need) one forward of γ-1 draft tokens;
all sequences of a batch share each forward.

    data = collect_acceptance(drafter, runtime, cache, split="heldout", temperature=1.0)
    report = calibrate(data, out_dir=RUN / "final", block_size=γ)    # STS temperatures + PNG + table
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from dspark.calibration.sts import (
    apply_temperatures,
    cumulative_confidence,
    fit_sts,
    plot_reliability,
    prefix_survival,
    roc_auc,
    sts_diagrams,
)
from dspark.drafters.dspark.checkpoint import save_temperatures
from dspark.drafters.dspark.model import DSparkDrafter
from dspark.model.target_runtime import TargetRuntime
from dspark.sampling.params import logits_to_probs
from dspark.training.anchors import plan_batches, sample_batch
from dspark.training.target_cache import TargetCache


@dataclass
class AcceptanceData:
    """One row per drafted block (all positions drafted and verified)."""

    confidence_logits: torch.Tensor  # [n, γ] fp32 raw l_k
    accepted: torch.Tensor  # [n, γ] fp32 {0, 1} y_k, sampled: accepted given x_<k accepted
    c_star: torch.Tensor  # [n, γ] fp32 analytic 1 - TV(p_d_k, p_t_k) on the drafted prefix
    valid: torch.Tensor  # [n, γ] bool: t + k <= T - 1 (the block stays inside the cached sequence)
    draft_tokens: torch.Tensor  # [n, γ] int64

    @property
    def num_blocks(self) -> int:
        return int(self.accepted.shape[0])


@torch.no_grad()
def collect_acceptance(
    drafter: DSparkDrafter,
    runtime: TargetRuntime,
    cache: TargetCache,
    *,
    split: str = "heldout",
    anchors_per_seq: int = 32,
    batch_seqs: int = 4,
    temperature: float = 1.0,
    seed: int = 0,
    max_sequences: int | None = None,
    progress: bool = True,
) -> AcceptanceData:
    from tqdm import tqdm

    gamma = drafter.config.block_size
    if tuple(cache.capture_layers) != tuple(drafter.config.target_layer_ids):
        raise ValueError(f"the cache captured layers {cache.capture_layers}, the drafter reads {drafter.config.target_layer_ids}")
    indices = cache.indices(split)
    if max_sequences is not None:
        indices = indices[:max_sequences]
    plan = plan_batches(cache, indices, batch_seqs=batch_seqs, seed=seed, epoch=0)
    if not plan:
        raise ValueError(f"the cache has no {split!r} sequence with a response of >= 2 tokens")
    gen = torch.Generator().manual_seed(seed)
    device = next(drafter.parameters()).device
    drafter.eval()
    parts: list[tuple[torch.Tensor, ...]] = []
    for seqs in tqdm(plan, desc="calibrate", disable=not progress):
        batch = sample_batch(cache, seqs, anchors_per_seq=anchors_per_seq, block_size=gamma, seed=seed, epoch=0)
        blocks = batch.to(device).blocks
        sample = drafter.draft(blocks, temperature=temperature, generator=gen if device.type == "cpu" else None)
        tokens = sample.tokens.cpu()  # [n, γ] row-major over valid blocks
        counts = batch.blocks.block_valid.sum(1).tolist()
        anchors = [batch.blocks.anchor_positions[r, :c] for r, c in enumerate(counts)]
        drafts = list(tokens.split(counts))
        target_logits = verify_logits(runtime, [cache.tokens(i) for i in seqs], anchors, drafts)  # [n, γ, V]
        if temperature == 0.0:
            accepted = (tokens == target_logits.argmax(-1)).float()
            c_star = accepted.clone()
        else:
            p_t = logits_to_probs(target_logits.flatten(0, 1), temperature=temperature).view_as(target_logits)
            p_d = sample.dense_probs.cpu() if sample.dense_probs is not None else _dense(sample, target_logits.shape[-1])
            pt_x = p_t.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
            pd_x = p_d.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
            u = torch.rand(tokens.shape, generator=gen)
            accepted = (u < (pt_x / pd_x).clamp(max=1.0)).float()
            c_star = (1.0 - 0.5 * (p_d - p_t).abs().sum(-1)).clamp(0.0, 1.0)
        valid = batch.label_mask[batch.blocks.block_valid]
        parts.append((sample.confidence_logits.cpu().float(), accepted, c_star.float(), valid, tokens))
    cat = [torch.cat(x) for x in zip(*parts)]
    return AcceptanceData(confidence_logits=cat[0], accepted=cat[1], c_star=cat[2], valid=cat[3], draft_tokens=cat[4])


def _dense(sample, vocab: int) -> torch.Tensor:  # sparse rows (top-k/top-p) -> [n, γ, V]
    ids, probs = sample.sparse_ids.cpu(), sample.sparse_probs.cpu()
    out = torch.zeros(*ids.shape[:2], vocab)
    return out.scatter_add_(-1, ids.clamp_min(0), torch.where(ids >= 0, probs, torch.zeros_like(probs)))


def verify_logits(
    runtime: TargetRuntime,
    tokens: list[torch.Tensor],  # each [T_i] int64 the whole sequence
    anchors: list[torch.Tensor],  # each [nb_i] int64 anchor positions
    drafts: list[torch.Tensor],  # each [nb_i, γ] int64 drafted x_1..x_γ
) -> torch.Tensor:  # [Σ nb_i, γ, V] fp32 target logits for x_1..x_γ given the drafted prefix
    """The target's logits at the γ positions the verifier scores, per block, in the input order."""
    gamma = drafts[0].shape[1]
    rids = [f"calib-{i}" for i in range(len(tokens))]
    offsets = np.cumsum([0] + [a.numel() for a in anchors])
    out = torch.empty(int(offsets[-1]), gamma, runtime.vocab_size)
    for rid, a in zip(rids, anchors):
        runtime.add_request(rid, int(a.max()) + gamma)
    try:
        # one prefill per sequence up to its last anchor; its rows t give p_t_1 of every block
        lens = [int(a.max()) + 1 for a in anchors]
        ids = torch.cat([tok[:n] for tok, n in zip(tokens, lens)])
        starts = np.cumsum([0] + lens[:-1])
        rows = torch.cat([a + int(s) for a, s in zip(anchors, starts)])
        out[:, 0] = runtime.forward(rids, ids, lens, logits_indices=rows).logits
        # then anchors in descending order: truncate to t+1, score x_1..x_{γ-1}
        order = [torch.argsort(a, descending=True) for a in anchors]
        for j in range(max(a.numel() for a in anchors) if gamma > 1 else 0):
            live = [i for i, a in enumerate(anchors) if a.numel() > j]
            for i in live:
                runtime.truncate(rids[i], int(anchors[i][order[i][j]]) + 1)
            query = torch.cat([drafts[i][order[i][j], : gamma - 1] for i in live])
            logits = runtime.forward([rids[i] for i in live], query, [gamma - 1] * len(live)).logits
            for n, i in enumerate(live):
                out[int(offsets[i]) + int(order[i][j]), 1:] = logits[n * (gamma - 1) : (n + 1) * (gamma - 1)]
    finally:
        for rid in rids:
            runtime.free_request(rid)
    return out


# ---- STS fit + report ---------------------------------------------------------------------------


@dataclass
class CalibrationReport:
    temperatures: torch.Tensor  # [γ]
    rows: list[dict]  # one per position: ece/auc before and after, acceptance
    png: Path
    table: str

    def to_json(self) -> str:
        return json.dumps({"temperatures": self.temperatures.tolist(), "positions": self.rows}, indent=2)


def _auc(scores: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor) -> float:
    return roc_auc(scores[mask], labels[mask]) if bool(mask.any()) else float("nan")


def calibrate(data: AcceptanceData, *, out_dir: str | Path, block_size: int, title: str = "",
              regime: str = "sampled") -> CalibrationReport:
    """Fit STS on `data`, write the regime's temperatures into sts.json and reliability.png and
    calibration.json in `out_dir` (reliability_greedy.png, calibration_greedy.json for the greedy
    regime: data collected at temperature 0, survival = argmax match), and return the
    per-position table (ECE and ROC-AUC of a_k against s_k)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if data.confidence_logits.shape[1] != block_size:
        raise ValueError(f"data has {data.confidence_logits.shape[1]} positions, the drafter's block size is {block_size}")
    fit = fit_sts(data.confidence_logits, data.accepted, valid=data.valid)
    save_temperatures(out, fit.temperatures, block_size=block_size, regime=regime)
    suffix = "" if regime == "sampled" else f"_{regime}"
    ones = torch.ones(block_size)
    raw_a = cumulative_confidence(apply_temperatures(data.confidence_logits.double(), ones.double()))
    cal_a = cumulative_confidence(apply_temperatures(data.confidence_logits.double(), fit.temperatures.double()))
    survival = prefix_survival(data.accepted)
    cond = torch.cat([torch.ones(data.num_blocks, 1), survival[:, :-1].float()], dim=1) > 0  # x_<k all accepted
    rows = []
    for k in range(block_size):
        v = data.valid[:, k]
        rows.append({
            "position": k + 1, "temperature": float(fit.temperatures[k]), "n": int(v.sum()),
            "survival": float(survival[v, k].mean()) if bool(v.any()) else float("nan"),
            "cond_accept": float(data.accepted[v & cond[:, k], k].mean()) if bool((v & cond[:, k]).any()) else float("nan"),
            "mean_c_star": float(data.c_star[v, k].mean()) if bool(v.any()) else float("nan"),
            "ece_before": float(fit.ece_before[k]), "ece_after": float(fit.ece_after[k]),
            "auc_before": _auc(raw_a[:, k], survival[:, k], v), "auc_after": _auc(cal_a[:, k], survival[:, k], v),
            "auc_conditional": _auc(data.confidence_logits[:, k], data.accepted[:, k], v & cond[:, k]),
        })
    header = f"{'k':>2} {'T_k':>6} {'n':>6} {'surv':>6} {'ECE raw':>8} {'ECE STS':>8} {'AUC raw':>8} {'AUC STS':>8} {'AUC cond':>8}"
    lines = [header] + [
        f"{r['position']:>2} {r['temperature']:>6.3f} {r['n']:>6} {r['survival']:>6.3f} {100 * r['ece_before']:>7.2f}% "
        f"{100 * r['ece_after']:>7.2f}% {r['auc_before']:>8.3f} {r['auc_after']:>8.3f} {r['auc_conditional']:>8.3f}"
        for r in rows
    ]
    mean_before = float(np.nanmean([r["ece_before"] for r in rows]))
    mean_after = float(np.nanmean([r["ece_after"] for r in rows]))
    lines.append(f"mean ECE {100 * mean_before:.2f}% -> {100 * mean_after:.2f}% over {data.num_blocks} blocks")
    png = plot_reliability(out / f"reliability{suffix}.png", {
        "raw": sts_diagrams(data.confidence_logits, data.accepted, ones, valid=data.valid),
        "STS": sts_diagrams(data.confidence_logits, data.accepted, fit.temperatures, valid=data.valid),
    }, title=title or "a_k vs observed prefix survival (held-out)")
    report = CalibrationReport(temperatures=fit.temperatures, rows=rows, png=png, table="\n".join(lines))
    (out / f"calibration{suffix}.json").write_text(_nan_safe(report.to_json()))
    return report


def _nan_safe(text: str) -> str:
    return text.replace("NaN", "null")


__all__ = ["AcceptanceData", "CalibrationReport", "calibrate", "collect_acceptance", "verify_logits"]
