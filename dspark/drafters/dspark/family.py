"""The DSpark family's entry in the drafter registry (dspark.drafters.registry)."""

from __future__ import annotations

from pathlib import Path

import torch

from dspark.drafters.dspark.checkpoint import load_checkpoint, save_checkpoint
from dspark.drafters.dspark.config import DSparkConfig
from dspark.drafters.dspark.model import DSparkDrafter
from dspark.drafters.dspark.objective import DSparkObjective
from dspark.drafters.dspark.serving import DSparkServingDrafter
from dspark.drafters.registry import DrafterFamily
from dspark.drafters.shared import SharedWeights


def load_drafter(directory: str | Path, *, shared: SharedWeights, device: str | torch.device = "cpu") -> DSparkDrafter:
    """A checkpoint's drafter, without its STS temperatures (what training resumes from)."""
    return load_checkpoint(directory, shared=shared, device=device).drafter


FAMILY = DrafterFamily(
    name="dspark", config=DSparkConfig, model=DSparkDrafter, load=load_drafter, save=save_checkpoint,
    serving=DSparkServingDrafter, objective=DSparkObjective(),
    lookup_variant=True,  # STS-calibrated confidences weigh the lookups against the model (drafters/lookup.py)
)
