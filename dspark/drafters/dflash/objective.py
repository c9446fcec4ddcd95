"""How `dspark train --algo dflash` trains a DFlash drafter (docs/method.md §9): the parallel
backbone over [x_0, mask × γ], cross-entropy with position weights w_k = exp(-(k-1)/γ_w)
(DFlash Eq. 4), logging the diagnostics every objective logs (dspark.training.objective)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from dspark.drafters.dflash.config import DFlashConfig
from dspark.drafters.dflash.model import DFlashDrafter
from dspark.drafters.shared import SharedWeights
from dspark.model.config import ModelConfig
from dspark.training.anchors import TrainBatch
from dspark.training.losses import ce_loss, position_weights
from dspark.training.objective import DIAGNOSTIC_DECAY, StepLoss, acceptance_metrics, refuse_dspark_options
from dspark.training.target_cache import TargetCache

if TYPE_CHECKING:
    from dspark.training.trainer import TrainConfig


class DFlashObjective:
    default_layers = 2

    def check(self, config: TrainConfig) -> None:
        refuse_dspark_options(config)

    def build(self, *, config: TrainConfig, target_config: ModelConfig, cache: TargetCache, shared: SharedWeights) -> DFlashDrafter:
        cfg = DFlashConfig.from_target(target_config, target_layer_ids=cache.capture_layers, num_layers=config.layers,
                                       block_size=config.block_size)
        return DFlashDrafter(cfg, shared=shared)

    def loss(self, model: DFlashDrafter, batch: TrainBatch) -> StepLoss:
        valid = batch.blocks.block_valid  # [rows, nb]: padding blocks carry no loss
        logits = model(batch.blocks)[valid]  # [n, γ, V]
        weights = position_weights(logits.shape[1], decay=model.config.position_decay, device=logits.device)
        ce = ce_loss(logits, batch.target_tokens[valid], weights, batch.label_mask[valid])  # DFlash Eq. 4
        metrics = {"loss": ce.item(), "ce": ce.item(), **acceptance_metrics(logits, batch, model.shared.lm_head, decay=DIAGNOSTIC_DECAY)}
        return StepLoss(total=ce, metrics=metrics)


__all__ = ["DFlashObjective"]
