"""Save / load a DFlash drafter: safetensors weights + JSON config carrying "algo": "dflash".

    save_checkpoint(out_dir, drafter=drafter)                      # storage_dtype="bfloat16" halves it
    drafter = load_checkpoint(out_dir, shared=SharedWeights.from_target(target))

Layout and checks: dspark/drafters/checkpoint_io.py (config.json with the algo field,
model.safetensors with the trainable tensors; no pickle).
"""

from __future__ import annotations

from pathlib import Path

import torch

from dspark.drafters import deepspec_format
from dspark.drafters.checkpoint_io import load_state, load_weights, read_config_json, save_weights
from dspark.drafters.dflash.config import DFlashConfig
from dspark.drafters.dflash.model import DFlashDrafter
from dspark.drafters.shared import SharedWeights

FORMAT = "dflash-drafter/1"


def save_checkpoint(directory: str | Path, *, drafter: DFlashDrafter, storage_dtype: str = "float32") -> Path:
    return save_weights(directory, module=drafter, config_json=drafter.config.to_json(), fmt=FORMAT, storage_dtype=storage_dtype)


def load_checkpoint(directory: str | Path, *, shared: SharedWeights, device: str | torch.device = "cpu") -> DFlashDrafter:
    if deepspec_format.is_deepspec_checkpoint(directory):  # DeepSpec's released layout, translated (deepspec_format.py)
        config, state = deepspec_format.load(directory, algo="dflash", shared=shared)
        drafter = DFlashDrafter(config, shared=shared)
        load_state(drafter, state, source=directory)
        return drafter.to(device)
    config = DFlashConfig.from_json(read_config_json(directory, algo="dflash"))
    drafter = DFlashDrafter(config, shared=shared)  # checks shared shapes against the config
    load_weights(directory, module=drafter, fmt=FORMAT, device=device)
    return drafter.to(device)


__all__ = ["FORMAT", "load_checkpoint", "save_checkpoint"]
