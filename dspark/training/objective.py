"""What a drafter family's training objective is, and the diagnostics every objective logs.

    objective = family("dflash").objective        # dspark.drafters.registry
    objective.check(config)                       # ValueError for settings the family cannot train with
    model = objective.build(config=config, target_config=target.config, cache=cache, shared=shared)
    step = objective.loss(model, batch)           # StepLoss: the tensor to backward, the metrics to log

Each family's objective lives in its own folder (dspark/drafters/<family>/objective.py) and
composes the pure losses of dspark/training/losses.py; the trainer (trainer.py) only runs the
loop. Every objective logs the same diagnostics (tv, acc, tau, acc_per_pos: the analytic
acceptance of its teacher-forced drafts against p_t, and their greedy counterparts), so the
runs' logs compare directly.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import nn

from dspark.drafters.shared import SharedWeights
from dspark.model.config import ModelConfig
from dspark.training.anchors import TrainBatch
from dspark.training.losses import (
    acceptance_rate,
    expected_acceptance,
    expected_accepted_length,
    greedy_acceptance,
    position_weights,
    target_probs_from_hidden,
    weighted_mean,
)
from dspark.training.target_cache import TargetCache

if TYPE_CHECKING:  # the trainer imports the registry, which holds the objectives
    from dspark.training.trainer import TrainConfig


@dataclass
class StepLoss:
    total: torch.Tensor  # [] what backward() runs on
    metrics: dict[str, Any]  # floats / lists for the log and the progress bar


class TrainingObjective(Protocol):
    """What the trainer needs from a drafter family besides its checkpoint I/O (DrafterFamily)."""

    default_layers: int  # draft layers when `dspark train` is given no --layers

    def check(self, config: TrainConfig) -> None:
        """Raise ValueError for settings of `config` this family cannot train with."""

    def build(self, *, config: TrainConfig, target_config: ModelConfig, cache: TargetCache, shared: SharedWeights) -> nn.Module:
        """A freshly initialised drafter reading the cache's captured target layers."""

    def loss(self, model: nn.Module, batch: TrainBatch) -> StepLoss: ...


def refuse_dspark_options(config: TrainConfig) -> None:
    """The check of the families that have neither a draft vocabulary nor a warm start."""
    if config.draft_vocab_size is not None or config.init_from is not None:
        raise ValueError(f"draft_vocab_size and init_from are DSpark options, not {config.algo}'s")


DIAGNOSTIC_DECAY = 4.0  # γ_w of the logged tv of the baselines (DSpark's default, so all logs weight alike)


@torch.no_grad()
def acceptance_metrics(draft_logits: torch.Tensor, batch: TrainBatch, lm_head: torch.Tensor, *, decay: float) -> dict[str, Any]:
    """The diagnostics every algorithm logs, from its teacher-forced draft logits [n, γ, V] of the
    valid blocks: tv (weighted mean ‖p_d - p_t‖₁, as L_tv), acc (mean c* = 1 - TV), tau (expected
    accepted length 1 + Σ_k Π_{i<=k} c*_i) and acc_per_pos."""
    valid = batch.blocks.block_valid
    n, gamma, vocab = draft_logits.shape
    mask = batch.label_mask[valid]  # [n, γ]
    p_t = target_probs_from_hidden(batch.target_hidden[valid].reshape(n * gamma, -1), lm_head).view(n, gamma, vocab)
    p_d = torch.softmax(draft_logits.float(), dim=-1)
    c_star = acceptance_rate(p_d, p_t)  # [n, γ]
    tv = weighted_mean((p_d - p_t).abs().sum(-1), position_weights(gamma, decay=decay, device=p_d.device), mask)
    return {
        "tv": tv.item(), "acc": float((c_star * mask).sum() / mask.sum().clamp_min(1)),
        "tau": expected_accepted_length(c_star, mask).item(),
        "acc_per_pos": [round(float(a), 4) for a in expected_acceptance(c_star, mask)],
        **greedy_metrics(p_d.argmax(dim=-1), p_t.argmax(dim=-1), mask),
    }


def greedy_metrics(draft_argmax: torch.Tensor, target_argmax: torch.Tensor, mask: torch.Tensor) -> dict[str, Any]:
    """The temperature-0 diagnostics (losses.greedy_acceptance) every algorithm logs beside c*_k:
    greedy_tau, greedy_acc_per_pos (conditional argmax agreement) and its denominators."""
    tau, hits, tries = greedy_acceptance(draft_argmax, target_argmax, mask)  # [], [γ], [γ]
    return {"greedy_tau": float(tau), "greedy_acc_per_pos": [round(float(h) / max(int(t), 1), 4) for h, t in zip(hits, tries)],
            "greedy_hits_per_pos": [int(h) for h in hits], "greedy_tries_per_pos": [int(t) for t in tries]}


__all__ = ["DIAGNOSTIC_DECAY", "StepLoss", "TrainingObjective", "acceptance_metrics", "greedy_metrics", "refuse_dspark_options"]
