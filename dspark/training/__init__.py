"""Drafter training: the DSpark objective (losses.py). Data pipeline and trainer come later."""

from dspark.training.losses import DSparkLoss, dspark_loss, target_probs_from_hidden

__all__ = ["DSparkLoss", "dspark_loss", "target_probs_from_hidden"]
