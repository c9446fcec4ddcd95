"""Save / load an EAGLE-3 drafter: safetensors weights + JSON config carrying "algo": "eagle3".

    save_checkpoint(out_dir, drafter=drafter)                      # storage_dtype="bfloat16" halves it
    drafter = load_checkpoint(out_dir, shared=SharedWeights.from_target(target))

Layout: config.json (Eagle3Config.to_json()) and model.safetensors (fc, the decoder layer, the
final norm; never the shared embedding / LM head). The checks and the I/O are the baselines'
common ones (dspark/drafters/checkpoint_io.py). No pickle.
"""

from __future__ import annotations

from pathlib import Path

import torch

from dspark.drafters import deepspec_format
from dspark.drafters.checkpoint_io import load_state, load_weights, read_config_json, save_weights
from dspark.drafters.eagle3.config import Eagle3Config
from dspark.drafters.eagle3.model import Eagle3Drafter
from dspark.drafters.shared import SharedWeights

FORMAT = "eagle3-drafter/1"


def save_checkpoint(directory: str | Path, *, drafter: Eagle3Drafter, storage_dtype: str = "float32") -> Path:
    return save_weights(directory, module=drafter, config_json=drafter.config.to_json(), fmt=FORMAT, storage_dtype=storage_dtype)


def load_checkpoint(directory: str | Path, *, shared: SharedWeights, device: str | torch.device = "cpu") -> Eagle3Drafter:
    if deepspec_format.is_deepspec_checkpoint(directory):  # DeepSpec's released layout, translated (deepspec_format.py)
        config, state = deepspec_format.load(directory, algo="eagle3", shared=shared)
        drafter = Eagle3Drafter(config, shared=shared)
        load_state(drafter, state, source=directory)
        return drafter.to(device)
    config = Eagle3Config.from_json(read_config_json(directory, algo="eagle3"))
    drafter = Eagle3Drafter(config, shared=shared)  # checks shared shapes against the config
    load_weights(directory, module=drafter, fmt=FORMAT, device=device)
    return drafter.to(device)


__all__ = ["load_checkpoint", "save_checkpoint"]
