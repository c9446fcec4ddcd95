"""The EAGLE-3 baseline (docs/method.md §9): one autoregressive decoder layer over fused target features.

    config.py      Eagle3Config (flat, frozen, JSON with "algo": "eagle3", `from_target`, `tiny`)
    model.py       Eagle3Drafter: fc fusion of the captured target layers, the decoder layer over
                   [embed(x_p) ; feature], the training-time-test unroll (`forward`)
    checkpoint.py  save_checkpoint / load_checkpoint (safetensors + JSON)
    serving.py     Eagle3ServingDrafter: the engine's Drafter (fused features + a small KV cache per
                   request, γ sequential steps per round)
    objective.py   Eagle3Objective: `dspark train --algo eagle3` (TTT over γ steps, soft cross-entropy
                   against p_t with step weights 0.8^(j-1))
    family.py      its entry in the drafter registry (dspark/drafters/registry.py)

Tests: python -m pytest tests/drafters/test_eagle3*.py -q
"""

from __future__ import annotations

from dspark.drafters.eagle3.checkpoint import load_checkpoint, save_checkpoint
from dspark.drafters.eagle3.config import Eagle3Config
from dspark.drafters.eagle3.model import Eagle3Drafter, TTTOutput

__all__ = ["Eagle3Config", "Eagle3Drafter", "TTTOutput", "load_checkpoint", "save_checkpoint"]
