"""The DFlash baseline (docs/method.md §9): DSpark's parallel backbone in its original form.

    config.py      DFlashConfig (flat, frozen, JSON with "algo": "dflash", `from_target`, `tiny`)
    model.py       DFlashDrafter: [x_0, mask × γ] -> γ independent distributions, no heads
    checkpoint.py  save_checkpoint / load_checkpoint (safetensors + JSON), the baselines' checkpoint I/O
    serving.py     DFlashServingDrafter: the engine's Drafter (context K/V cache per request)
    objective.py   DFlashObjective: `dspark train --algo dflash` (cross-entropy with position weights)
    family.py      its entry in the drafter registry (dspark/drafters/registry.py)

Tests: python -m pytest tests/drafters/test_dflash*.py -q
"""

from __future__ import annotations

from dspark.drafters.dflash.checkpoint import load_checkpoint, save_checkpoint
from dspark.drafters.dflash.config import DFlashConfig
from dspark.drafters.dflash.model import DFlashDrafter

__all__ = ["DFlashConfig", "DFlashDrafter", "load_checkpoint", "save_checkpoint"]
