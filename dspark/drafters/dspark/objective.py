"""How `dspark train --algo dspark` trains a DSpark drafter (docs/method.md §3).

The DSpark loss 0.1 CE + 0.9 TV + 1.0 conf with position weights (dspark.training.losses
`dspark_loss`) on the teacher-forced forward over the valid blocks of a batch; with a draft
vocabulary (`draft_vocab_size`: the N most frequent response tokens of the cache's train split,
dspark.training.draft_vocab) the target's rows are restricted to those N columns and the mass
outside them is the TV term's. `init_from` starts from another checkpoint's weights.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from dspark.drafters.dspark.checkpoint import load_checkpoint, transfer_weights
from dspark.drafters.dspark.config import DSparkConfig
from dspark.drafters.dspark.model import DSparkDrafter
from dspark.drafters.shared import SharedWeights
from dspark.model.config import ModelConfig
from dspark.training.anchors import TrainBatch
from dspark.training.draft_vocab import frequent_tokens
from dspark.training.losses import (dspark_loss, expected_acceptance, expected_accepted_length, target_probs_from_hidden,
                                    target_probs_on_vocab)
from dspark.training.objective import StepLoss, greedy_metrics
from dspark.training.target_cache import TargetCache

if TYPE_CHECKING:
    from dspark.training.trainer import TrainConfig


class DSparkObjective:
    default_layers = 2

    def check(self, config: TrainConfig) -> None:
        pass  # every TrainConfig option is a DSpark option

    def build(self, *, config: TrainConfig, target_config: ModelConfig, cache: TargetCache, shared: SharedWeights) -> DSparkDrafter:
        cfg = DSparkConfig.from_target(target_config, target_layer_ids=cache.capture_layers, num_layers=config.layers,
                                       block_size=config.block_size, markov_rank=config.markov_rank, head_type=config.head,
                                       draft_vocab_size=config.draft_vocab_size)
        d2t = None if config.draft_vocab_size is None else frequent_tokens(cache, size=config.draft_vocab_size, split=config.split)
        model = DSparkDrafter(cfg, shared=shared, draft_to_target=d2t)
        if config.init_from is not None:
            transfer_weights(load_checkpoint(config.init_from, shared=shared).drafter, model)
        return model

    def loss(self, model: DSparkDrafter, batch: TrainBatch) -> StepLoss:
        c = model.config
        # valid blocks only: padding blocks carry no loss, so they skip the vocabulary-sized products
        logits, confidence_logits = model.forward_valid(batch.blocks, target_tokens=batch.target_tokens)  # [n, γ, N], [n, γ]
        valid = batch.blocks.block_valid  # [rows, nb]
        n, gamma, _ = logits.shape
        mask = batch.label_mask[valid]  # [n, γ]
        labels = batch.target_tokens[valid]  # [n, γ] target ids
        d2t = model.draft_to_target
        with torch.no_grad():
            hidden = batch.target_hidden[valid].reshape(n * gamma, -1)  # [n γ, d]
            outside = None
            if d2t is not None and batch.target_lse is not None:
                # the cache's normaliser: only the N rows of the LM head the drafter can propose
                p_t, outside = target_probs_on_vocab(hidden, model.draft_lm_head(), batch.target_lse[valid].reshape(-1))
                p_t, outside = p_t.view(n, gamma, -1), outside.view(n, gamma)  # [n, γ, N], [n, γ]
                target_argmax = batch.target_argmax[valid]  # [n, γ]
            else:
                p_t = target_probs_from_hidden(hidden, model.shared.lm_head).view(n, gamma, -1)  # [n, γ, V]
                target_argmax = p_t.argmax(dim=-1)  # [n, γ]
                if d2t is not None:  # only the N columns the drafter can propose, and the mass it cannot
                    p_t = p_t[..., d2t]  # [n, γ, N]
                    outside = (1.0 - p_t.sum(dim=-1)).clamp_min(0.0)  # [n, γ]
            if d2t is not None:
                labels = model.target_to_draft()[labels]  # [n, γ] draft indices, -1 outside
        loss = dspark_loss(draft_logits=logits, target_ids=labels, target_probs=p_t, outside_mass=outside,
                           confidence_logits=confidence_logits, mask=mask, ce_weight=c.ce_weight,
                           tv_weight=c.tv_weight, conf_weight=c.conf_weight, position_decay=c.position_decay)
        acc = expected_acceptance(loss.c_star, mask)  # [γ]
        draft_argmax = logits.detach().argmax(dim=-1)  # [n, γ] draft indices
        if d2t is not None:
            draft_argmax = d2t[draft_argmax]
        metrics = {
            "loss": loss.total.item(), "ce": loss.ce.item(), "tv": loss.tv.item(), "conf": loss.conf.item(),
            "acc": float((loss.c_star * mask).sum() / mask.sum().clamp_min(1)),
            "tau": expected_accepted_length(loss.c_star, mask).item(),
            "acc_per_pos": [round(float(a), 4) for a in acc],
            **greedy_metrics(draft_argmax, target_argmax, mask),
        }
        return StepLoss(total=loss.total, metrics=metrics)


__all__ = ["DSparkObjective"]
