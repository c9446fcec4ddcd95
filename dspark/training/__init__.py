"""Drafter training: the DSpark objective (losses.py), the target cache (target_cache.py),
anchor sampling and batches (anchors.py), the trainer (trainer.py) and its CLI (cli.py)."""

from dspark.training.losses import DSparkLoss, dspark_loss, target_probs_from_hidden

__all__ = ["DSparkLoss", "dspark_loss", "target_probs_from_hidden"]
