"""How `dspark train --algo eagle3` trains an EAGLE-3 drafter (docs/method.md §9): one layer,
training-time test over γ steps, Σ_j 0.8^(j-1) · soft CE of step j against p_t (EAGLE-3's
training code), logging the diagnostics every objective logs (dspark.training.objective)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from dspark.drafters.eagle3.config import Eagle3Config
from dspark.drafters.eagle3.model import Eagle3Drafter
from dspark.drafters.shared import SharedWeights
from dspark.model.config import ModelConfig
from dspark.training.anchors import TrainBatch
from dspark.training.losses import target_probs_from_hidden
from dspark.training.objective import DIAGNOSTIC_DECAY, StepLoss, acceptance_metrics, refuse_dspark_options
from dspark.training.target_cache import TargetCache

if TYPE_CHECKING:
    from dspark.training.trainer import TrainConfig


class Eagle3Objective:
    default_layers = 1  # a one-layer drafter

    def check(self, config: TrainConfig) -> None:
        refuse_dspark_options(config)
        if config.layers != 1:
            raise ValueError(f"EAGLE-3 is a one-layer drafter: layers must be 1, got {config.layers}")

    def build(self, *, config: TrainConfig, target_config: ModelConfig, cache: TargetCache, shared: SharedWeights) -> Eagle3Drafter:
        cfg = Eagle3Config.from_target(target_config, target_layer_ids=cache.capture_layers, block_size=config.block_size)
        return Eagle3Drafter(cfg, shared=shared)

    def loss(self, model: Eagle3Drafter, batch: TrainBatch) -> StepLoss:
        if batch.context_token_ids is None:
            raise ValueError("EAGLE-3 reads the context's tokens: the batch has no context_token_ids (build it with build_batch)")
        out = model(batch.blocks, context_token_ids=batch.context_token_ids, target_tokens=batch.target_tokens)
        valid = batch.blocks.block_valid
        logits = out.logits[valid]  # [n, γ, V]: step j's logits of x_j
        n, gamma, vocab = logits.shape
        mask = batch.label_mask[valid].to(logits.dtype)  # [n, γ]
        with torch.no_grad():
            p_t = target_probs_from_hidden(batch.target_hidden[valid].reshape(n * gamma, -1), model.shared.lm_head).view(n, gamma, vocab)
        soft_ce = -(p_t * torch.log_softmax(logits.float(), dim=-1)).sum(-1)  # [n, γ] cross-entropy against p_t
        per_step = (soft_ce * mask).sum(0) / mask.sum(0).clamp_min(1)  # [γ] mean over blocks with a label
        step_weights = model.config.step_decay ** torch.arange(gamma, dtype=torch.float32, device=logits.device)
        total = (step_weights * per_step).sum()  # EAGLE-3: Σ_j 0.8^(j-1) L_j
        metrics = {"loss": total.item(), "ce": total.item(), **acceptance_metrics(logits, batch, model.shared.lm_head, decay=DIAGNOSTIC_DECAY)}
        return StepLoss(total=total, metrics=metrics)


__all__ = ["Eagle3Objective"]
