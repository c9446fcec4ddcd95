"""Held-out evaluation of a drafter during and after training: the analytic acceptance of its
teacher-forced drafts against the target on sequences it never trained on.

    dspark train ... --eval-every 100        # an {"event": "eval", ...} line in metrics.jsonl

For every block the drafter's distributions p_d_k are compared with the target's p_t_k (from the
cached final hidden states, as in training): c*_k = 1 - ½‖p_d_k - p_t_k‖₁ is the probability
that position k survives verification at temperature 1 given the earlier ones did (docs/method.md §3),
and τ = 1 + Σ_k Π_{i≤k} c*_i the expected accepted length of a round, bonus included. It is the
quantity the offline evaluation measures by sampling (`dspark eval`, T = 1), here without running
the target, so a run can be judged at every checkpoint in seconds. Every algorithm reports it the
same way (the `acceptance_metrics` diagnostics of dspark/training/objective.py), so runs compare directly.

The anchors are fixed (seeded by `seed`, epoch 0) so that two evaluations of the same model agree
exactly and two models are measured on the same blocks. Evaluation touches no global RNG state:
a resumed run's training trace stays bit-identical to an uninterrupted one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from dspark.training.anchors import plan_batches, sample_batch
from dspark.training.objective import TrainingObjective
from dspark.training.target_cache import TargetCache

EVAL_EPOCH = 0  # anchors of held-out sequences are drawn once, as for training epoch 0


@dataclass(frozen=True)
class HeldoutResult:
    split: str
    sequences: int
    blocks: int
    labels: int
    tv: float  # mean weighted ‖p_d - p_t‖₁ (the L_tv of the DSpark loss, γ_w = 4)
    acc: float  # mean c* over every labelled position
    tau: float  # expected accepted length per round, bonus included
    acc_per_pos: list[float]  # [γ] mean conditional c*_k
    # temperature 0 (losses.greedy_acceptance): argmax agreement along the data's tokens
    greedy_tau: float | None = None  # mean accepted length of a greedy round, bonus included
    greedy_acc_per_pos: list[float] | None = None  # [γ] conditional argmax agreement

    def to_dict(self) -> dict[str, Any]:
        return {"split": self.split, "sequences": self.sequences, "blocks": self.blocks, "labels": self.labels,
                "tv": round(self.tv, 5), "acc": round(self.acc, 5), "tau": round(self.tau, 5),
                "acc_per_pos": [round(a, 4) for a in self.acc_per_pos],
                "greedy_tau": None if self.greedy_tau is None else round(self.greedy_tau, 5),
                "greedy_acc_per_pos": None if self.greedy_acc_per_pos is None else [round(a, 4) for a in self.greedy_acc_per_pos]}


@torch.no_grad()
def evaluate_heldout(
    objective: TrainingObjective,  # the family's (dspark.drafters.registry `family(name).objective`)
    model: nn.Module,
    cache: TargetCache,
    *,
    split: str = "heldout",
    block_size: int,
    anchors_per_seq: int = 16,
    batch_seqs: int = 4,
    seed: int = 0,
    max_sequences: int | None = None,
    device: torch.device | str = "cpu",
    precision: str = "fp32",
) -> HeldoutResult | None:
    """Mean diagnostics over the split's sequences (None if the split is empty). Batch means are
    combined with weights (blocks for τ and acc_per_pos, labels for acc and tv), so the result
    does not depend on `batch_seqs` beyond float rounding."""
    indices = cache.indices(split)[:max_sequences]
    if not indices:
        return None
    device = torch.device(device)
    was_training = model.training
    model.eval()
    sums = {"tv": 0.0, "acc": 0.0, "tau": 0.0}
    pos_sum = torch.zeros(block_size, dtype=torch.float64)  # [γ] Σ over batches of blocks_k · mean c*_k
    pos_weight = torch.zeros(block_size, dtype=torch.float64)  # [γ] blocks with a label at k
    blocks = labels = 0
    greedy_tau_sum = 0.0
    greedy_hits = torch.zeros(block_size, dtype=torch.float64)  # [γ]
    greedy_tries = torch.zeros(block_size, dtype=torch.float64)  # [γ]
    autocast = torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=precision == "bf16")
    try:
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            for seqs in plan_batches(cache, indices, batch_seqs=batch_seqs, seed=seed, epoch=EVAL_EPOCH):
                batch = sample_batch(cache, seqs, anchors_per_seq=anchors_per_seq, block_size=block_size,
                                     seed=seed, epoch=EVAL_EPOCH).to(device)
                with autocast:
                    metrics = objective.loss(model, batch).metrics
                n_blocks, n_labels = batch.num_blocks, batch.num_labels
                if n_blocks == 0 or n_labels == 0:
                    continue
                sums["tau"] += metrics["tau"] * n_blocks
                sums["acc"] += metrics["acc"] * n_labels
                sums["tv"] += metrics["tv"] * n_labels
                valid = batch.label_mask[batch.blocks.block_valid].sum(0).cpu().double()  # [γ] blocks with a label at k
                per_pos = torch.tensor(metrics["acc_per_pos"], dtype=torch.float64).nan_to_num(0.0)
                pos_sum += per_pos * valid
                pos_weight += valid
                tries = torch.tensor(metrics["greedy_tries_per_pos"], dtype=torch.float64)
                greedy_tries += tries
                greedy_hits += torch.tensor(metrics["greedy_hits_per_pos"], dtype=torch.float64)
                greedy_tau_sum += metrics["greedy_tau"] * n_blocks
                blocks += n_blocks
                labels += n_labels
    finally:
        model.train(was_training)
    if blocks == 0:
        return None
    return HeldoutResult(split=split, sequences=len(indices), blocks=blocks, labels=labels, tv=sums["tv"] / labels,
                         acc=sums["acc"] / labels, tau=sums["tau"] / blocks,
                         acc_per_pos=(pos_sum / pos_weight.clamp_min(1)).tolist(), greedy_tau=greedy_tau_sum / blocks,
                         greedy_acc_per_pos=(greedy_hits / greedy_tries.clamp_min(1)).tolist())


__all__ = ["EVAL_EPOCH", "HeldoutResult", "evaluate_heldout"]
