"""Save / load a trained DSpark drafter: safetensors weights + JSON config + JSON STS temperatures.

    save_checkpoint(out_dir, drafter=drafter, temperatures=fit.temperatures)
    ckpt = load_checkpoint(out_dir, shared=SharedWeights.from_target(target))
    ckpt.drafter, ckpt.temperatures   # temperatures: [γ] fp32 or None before calibration

Layout of a checkpoint directory:
    config.json        DSparkConfig.to_json()
    model.safetensors  the drafter's state_dict: trainable tensors only. The shared embedding and
                       LM head are the target's and are never written; the RoPE table is derived.
    sts.json           {"temperatures": [T_1, ..., T_γ]} (optional, written by calibration)
No pickle anywhere: safetensors and JSON only (dspark/drafters/checkpoint_io.py, shared with the
baselines). Loading checks the config against the tensors (missing / unexpected names, shapes)
and fails with a message naming every mismatch.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from dspark.drafters.checkpoint_io import STORAGE_DTYPES, load_weights, read_config_json, save_weights
from dspark.drafters.dspark.config import DSparkConfig
from dspark.drafters.dspark.model import DSparkDrafter, SharedWeights

STS_FILE = "sts.json"
FORMAT = "dspark-drafter/1"


@dataclass
class DrafterCheckpoint:
    drafter: DSparkDrafter
    temperatures: torch.Tensor | None  # [γ] fp32 STS temperatures, None if not calibrated


def save_checkpoint(directory: str | Path, *, drafter: DSparkDrafter, temperatures: torch.Tensor | None = None,
                    storage_dtype: str = "float32") -> Path:
    """Write the drafter. `storage_dtype` "bfloat16" halves the file (what the committed default
    drafter uses to fit the size limit); loading upcasts into the fp32 parameters, so a bf16
    checkpoint drafts exactly like an fp32 drafter whose weights are the bf16-rounded values."""
    directory = save_weights(directory, module=drafter, config_json=drafter.config.to_json(), fmt=FORMAT, storage_dtype=storage_dtype)
    if temperatures is not None:
        save_temperatures(directory, temperatures, block_size=drafter.config.block_size)
    return directory


def save_temperatures(directory: str | Path, temperatures: torch.Tensor, *, block_size: int) -> None:
    # temperatures: [γ]
    values = _check_temperatures(temperatures.tolist(), block_size=block_size, source="temperatures")
    (Path(directory) / STS_FILE).write_text(json.dumps({"temperatures": values}, indent=2))


def load_temperatures(directory: str | Path, *, block_size: int) -> torch.Tensor | None:  # [γ] or None
    path = Path(directory) / STS_FILE
    if not path.exists():
        return None
    data = json.loads(path.read_text())
    if not isinstance(data, dict) or "temperatures" not in data:
        raise ValueError(f"{path}: expected {{\"temperatures\": [...]}}, got {str(data)[:200]}")
    return torch.tensor(_check_temperatures(data["temperatures"], block_size=block_size, source=str(path)), dtype=torch.float32)


def _check_temperatures(values: list, *, block_size: int, source: str) -> list[float]:
    if len(values) != block_size or not all(isinstance(v, (int, float)) and v > 0 for v in values):
        raise ValueError(f"{source}: expected {block_size} positive temperatures (one per block position), got {values}")
    return [float(v) for v in values]


def load_checkpoint(directory: str | Path, *, shared: SharedWeights, device: str | torch.device = "cpu") -> DrafterCheckpoint:
    config = DSparkConfig.from_json(read_config_json(directory, algo="dspark"))
    drafter = DSparkDrafter(config, shared=shared)  # checks shared shapes against the config
    load_weights(directory, module=drafter, fmt=FORMAT, device=device)  # upcasts a bf16 / fp16 file into fp32
    return DrafterCheckpoint(drafter=drafter.to(device), temperatures=load_temperatures(directory, block_size=config.block_size))


def export_checkpoint(src: str | Path, dst: str | Path, *, storage_dtype: str = "bfloat16", shared: SharedWeights) -> Path:
    """Copy a checkpoint (weights re-stored as `storage_dtype`, config, STS temperatures if any)."""
    ckpt = load_checkpoint(src, shared=shared)
    return save_checkpoint(dst, drafter=ckpt.drafter, temperatures=ckpt.temperatures, storage_dtype=storage_dtype)


__all__ = ["DrafterCheckpoint", "STORAGE_DTYPES", "export_checkpoint", "load_checkpoint", "load_temperatures", "save_checkpoint", "save_temperatures"]
