"""The DFlash family's entry in the drafter registry (dspark.drafters.registry)."""

from __future__ import annotations

from dspark.drafters.dflash.checkpoint import load_checkpoint, save_checkpoint
from dspark.drafters.dflash.config import DFlashConfig
from dspark.drafters.dflash.model import DFlashDrafter
from dspark.drafters.dflash.objective import DFlashObjective
from dspark.drafters.dflash.serving import DFlashServingDrafter
from dspark.drafters.registry import DrafterFamily

FAMILY = DrafterFamily(
    name="dflash", config=DFlashConfig, model=DFlashDrafter, load=load_checkpoint, save=save_checkpoint,
    serving=DFlashServingDrafter, objective=DFlashObjective(),
)
