"""The EAGLE-3 family's entry in the drafter registry (dspark.drafters.registry)."""

from __future__ import annotations

from dspark.drafters.eagle3.checkpoint import load_checkpoint, save_checkpoint
from dspark.drafters.eagle3.config import Eagle3Config
from dspark.drafters.eagle3.model import Eagle3Drafter
from dspark.drafters.eagle3.objective import Eagle3Objective
from dspark.drafters.eagle3.serving import Eagle3ServingDrafter
from dspark.drafters.registry import DrafterFamily

FAMILY = DrafterFamily(
    name="eagle3", config=Eagle3Config, model=Eagle3Drafter, load=load_checkpoint, save=save_checkpoint,
    serving=Eagle3ServingDrafter, objective=Eagle3Objective(),
)
