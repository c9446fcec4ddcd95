"""Save / load a trained DSpark drafter: safetensors weights + JSON config + JSON STS temperatures.

    save_checkpoint(out_dir, drafter=drafter, temperatures=fit.temperatures)
    ckpt = load_checkpoint(out_dir, shared=SharedWeights.from_target(target))
    ckpt.drafter, ckpt.temperatures   # temperatures: [γ] fp32 or None before calibration

Layout of a checkpoint directory:
    config.json        DSparkConfig.to_json()
    model.safetensors  the drafter's state_dict: trainable tensors only. The shared embedding and
                       LM head are the target's and are never written; the RoPE table is derived.
    sts.json           {"temperatures": [T_1, ..., T_γ], "greedy_temperatures": [...]} (optional, written by
                       calibration): one fit for sampled requests (survival = the rejection test passes)
                       and one for greedy requests (survival = the draft equals the target's argmax);
                       the serving drafter picks by the request's temperature
A directory in DeepSpec's released layout (config.json naming Qwen3DSparkModel, HF tensor names)
loads too, translated by dspark/drafters/deepspec_format.py (an sts.json beside it is read as usual).
No pickle anywhere: safetensors and JSON only (dspark/drafters/checkpoint_io.py, shared with the
baselines). Loading checks the config against the tensors (missing / unexpected names, shapes)
and fails with a message naming every mismatch.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from dspark.drafters import deepspec_format
from dspark.drafters.checkpoint_io import STORAGE_DTYPES, load_state, load_weights, read_config_json, save_weights
from dspark.drafters.dspark.config import DSparkConfig
from dspark.drafters.dspark.model import DSparkDrafter
from dspark.drafters.shared import SharedWeights

STS_FILE = "sts.json"
FORMAT = "dspark-drafter/1"


REGIMES = {"sampled": "temperatures", "greedy": "greedy_temperatures"}  # calibration regime -> key in sts.json


@dataclass
class DrafterCheckpoint:
    drafter: DSparkDrafter
    temperatures: torch.Tensor | None  # [γ] fp32 STS temperatures of sampled requests, None if not calibrated
    greedy_temperatures: torch.Tensor | None = None  # [γ] of greedy requests, None if not calibrated for them


def save_checkpoint(directory: str | Path, *, drafter: DSparkDrafter, temperatures: torch.Tensor | None = None,
                    storage_dtype: str = "float32", greedy_temperatures: torch.Tensor | None = None) -> Path:
    """Write the drafter. `storage_dtype` "bfloat16" halves the file (what the committed default
    drafter uses to fit the size limit); loading upcasts into the fp32 parameters, so a bf16
    checkpoint drafts exactly like an fp32 drafter whose weights are the bf16-rounded values."""
    directory = save_weights(directory, module=drafter, config_json=drafter.config.to_json(), fmt=FORMAT, storage_dtype=storage_dtype)
    if temperatures is not None:
        save_temperatures(directory, temperatures, block_size=drafter.config.block_size)
    if greedy_temperatures is not None:
        save_temperatures(directory, greedy_temperatures, block_size=drafter.config.block_size, regime="greedy")
    return directory


def save_temperatures(directory: str | Path, temperatures: torch.Tensor, *, block_size: int, regime: str = "sampled") -> None:
    """Write one regime's temperatures [γ] into sts.json, keeping the other regime's."""
    if regime not in REGIMES:
        raise ValueError(f"regime must be one of {sorted(REGIMES)}, got {regime!r}")
    values = _check_temperatures(temperatures.tolist(), block_size=block_size, source="temperatures")
    path = Path(directory) / STS_FILE
    data = json.loads(path.read_text()) if path.exists() else {}
    data[REGIMES[regime]] = values
    path.write_text(json.dumps(data, indent=2))


def load_temperatures(directory: str | Path, *, block_size: int, regime: str = "sampled") -> torch.Tensor | None:  # [γ] or None
    if regime not in REGIMES:
        raise ValueError(f"regime must be one of {sorted(REGIMES)}, got {regime!r}")
    path = Path(directory) / STS_FILE
    if not path.exists():
        return None
    data = json.loads(path.read_text())
    if not isinstance(data, dict) or not set(data) <= set(REGIMES.values()):
        raise ValueError(f"{path}: expected {{\"temperatures\": [...], \"greedy_temperatures\": [...]}}, got {str(data)[:200]}")
    if REGIMES[regime] not in data:
        return None
    return torch.tensor(_check_temperatures(data[REGIMES[regime]], block_size=block_size, source=str(path)), dtype=torch.float32)


def _check_temperatures(values: list, *, block_size: int, source: str) -> list[float]:
    if len(values) != block_size or not all(isinstance(v, (int, float)) and v > 0 for v in values):
        raise ValueError(f"{source}: expected {block_size} positive temperatures (one per block position), got {values}")
    return [float(v) for v in values]


def load_checkpoint(directory: str | Path, *, shared: SharedWeights, device: str | torch.device = "cpu") -> DrafterCheckpoint:
    if deepspec_format.is_deepspec_checkpoint(directory):  # DeepSpec's released layout, translated (deepspec_format.py)
        config, state = deepspec_format.load(directory, algo="dspark", shared=shared)
        drafter = DSparkDrafter(config, shared=shared)
        load_state(drafter, state, source=directory)
        return DrafterCheckpoint(drafter=drafter.to(device),
                                 temperatures=load_temperatures(directory, block_size=config.block_size),
                                 greedy_temperatures=load_temperatures(directory, block_size=config.block_size, regime="greedy"))
    config = DSparkConfig.from_json(read_config_json(directory, algo="dspark"))
    drafter = DSparkDrafter(config, shared=shared)  # checks shared shapes against the config
    load_weights(directory, module=drafter, fmt=FORMAT, device=device)  # upcasts a bf16 / fp16 file into fp32
    return DrafterCheckpoint(drafter=drafter.to(device), temperatures=load_temperatures(directory, block_size=config.block_size),
                             greedy_temperatures=load_temperatures(directory, block_size=config.block_size, regime="greedy"))


def export_checkpoint(src: str | Path, dst: str | Path, *, storage_dtype: str = "bfloat16", shared: SharedWeights) -> Path:
    """Copy a checkpoint (weights re-stored as `storage_dtype`, config, STS temperatures if any)."""
    ckpt = load_checkpoint(src, shared=shared)
    return save_checkpoint(dst, drafter=ckpt.drafter, temperatures=ckpt.temperatures, storage_dtype=storage_dtype,
                           greedy_temperatures=ckpt.greedy_temperatures)


__all__ = ["DrafterCheckpoint", "STORAGE_DTYPES", "export_checkpoint", "transfer_weights", "load_checkpoint", "load_temperatures", "save_checkpoint", "save_temperatures"]


@torch.no_grad()
def transfer_weights(source: DSparkDrafter, target: DSparkDrafter) -> None:
    """Initialise `target` from a trained `source` of the same shape (layers, rank, block size,
    head), whatever either's draft vocabulary: every tensor is copied, except the Markov/RNN head's
    W2 [r, N], whose columns are gathered by target id (a target-vocabulary token the source could
    not propose starts at zero, i.e. no bias: the init of a fresh head). Used to warm-start a
    draft-vocabulary drafter from a full-vocabulary one (`dspark train --init-from`)."""
    src, dst = source.state_dict(), target.state_dict()
    skip = {"draft_to_target", "head.w2"}
    problems = [n for n in dst if n not in skip and (n not in src or src[n].shape != dst[n].shape)]
    if problems:
        raise ValueError(f"cannot initialise from a drafter of another shape: {problems[:8]}")
    for name, tensor in dst.items():
        if name not in skip:
            tensor.copy_(src[name])
    src_index = source.target_to_draft()[target.draft_to_target if target.draft_to_target is not None
                                         else torch.arange(target.config.vocab_size)]  # [N_dst] column in source, -1 if absent
    w2_src = source.head.w2  # [r, N_src]
    gathered = w2_src[:, src_index.clamp(min=0)] * (src_index >= 0).to(w2_src.dtype)  # [r, N_dst]
    target.head.w2.copy_(gathered)
