"""Checkpoint I/O every drafter family shares: safetensors weights + a JSON config, no pickle.

    save_weights(out_dir, module=drafter, config_json=cfg.to_json(), fmt="dflash-drafter/1")
    load_weights(out_dir, module=drafter, fmt="dflash-drafter/1")     # checks names and shapes
    checkpoint_algo(out_dir)                                           # "dspark" | "dflash" | "eagle3"

A checkpoint directory holds config.json (the family's config, with an "algo" field for the
baselines; DSpark checkpoints predate it and carry none) and model.safetensors (trainable tensors
only: the shared embedding / LM head are the target's; metadata "format" names the family and
version). Loading checks the tensors against the module the config builds and names every
mismatch; a bf16 / fp16 file is upcast into the fp32 parameters by load_state_dict's copy.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
STORAGE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def checkpoint_algo(directory: str | Path) -> str:
    """The drafter family a checkpoint directory holds: its config's "algo" field ("dspark" when
    absent: DSpark checkpoints predate the field), or, for a checkpoint in DeepSpec's released
    layout, the family it maps onto (dspark/drafters/deepspec_format.py)."""
    path = Path(directory) / CONFIG_FILE
    if not path.exists():
        raise FileNotFoundError(f"{directory} is not a drafter checkpoint: no {CONFIG_FILE}")
    data = json.loads(path.read_text())
    from dspark.drafters import deepspec_format  # a checkpoint in DeepSpec's released layout (no "algo")

    if deepspec_format.is_deepspec_config(data):
        return deepspec_format.deepspec_family(data, source=path)
    if isinstance(data, dict) and isinstance(data.get("algo", "dspark"), str):
        return data.get("algo", "dspark")
    raise ValueError(f"{path}: expected a JSON object with a string \"algo\" (or none), got {str(data)[:200]}")


def save_weights(directory: str | Path, *, module: nn.Module, config_json: str, fmt: str, storage_dtype: str = "float32") -> Path:
    """config.json + model.safetensors (the module's state_dict, floats stored as `storage_dtype`)."""
    if storage_dtype not in STORAGE_DTYPES:
        raise ValueError(f"storage_dtype must be one of {sorted(STORAGE_DTYPES)}, got {storage_dtype!r}")
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    dtype = STORAGE_DTYPES[storage_dtype]
    state = {name: t.detach().cpu().to(dtype if t.is_floating_point() else t.dtype).contiguous()
             for name, t in module.state_dict().items()}
    save_file(state, str(directory / WEIGHTS_FILE), metadata={"format": fmt})
    (directory / CONFIG_FILE).write_text(config_json)
    return directory


def read_config_json(directory: str | Path, *, algo: str) -> str:
    """config.json of a checkpoint that must hold an `algo` drafter (clear error otherwise)."""
    directory = Path(directory)
    for name in (CONFIG_FILE, WEIGHTS_FILE):
        if not (directory / name).exists():
            raise FileNotFoundError(f"{directory} is not a drafter checkpoint: no {name}")
    found = checkpoint_algo(directory)
    if found != algo:
        raise ValueError(f"{directory} holds a {found!r} drafter, not a {algo!r} one")
    return (directory / CONFIG_FILE).read_text()


def load_weights(directory: str | Path, *, module: nn.Module, fmt: str, device: str | torch.device = "cpu") -> None:
    """Load model.safetensors into `module` after checking format, names and shapes (a bf16 /
    fp16 file is upcast into the fp32 parameters by load_state_dict's copy)."""
    path = Path(directory) / WEIGHTS_FILE
    with safe_open(str(path), framework="pt", device=str(device)) as f:
        got_fmt = (f.metadata() or {}).get("format")
        if got_fmt != fmt:
            raise ValueError(f"{path}: format {got_fmt!r}, expected {fmt!r}")
        state = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118 (a safetensors handle, not a dict)
    load_state(module, state, source=directory)


def load_state(module: nn.Module, state: dict[str, torch.Tensor], *, source: str | Path) -> None:
    """Load `state` into `module` after checking its names and shapes against the module the
    config built (ValueError naming every mismatch; `source` names the checkpoint)."""
    expected = {name: tuple(t.shape) for name, t in module.state_dict().items()}
    got = {name: tuple(t.shape) for name, t in state.items()}
    problems = [f"missing {n}" for n in sorted(expected.keys() - got.keys())]
    problems += [f"unexpected {n}" for n in sorted(got.keys() - expected.keys())]
    problems += [f"{n}: shape {got[n]}, config implies {expected[n]}" for n in sorted(expected.keys() & got.keys()) if got[n] != expected[n]]
    if problems:
        raise ValueError(f"{Path(source)}: weights do not match {CONFIG_FILE}: " + "; ".join(problems))
    module.load_state_dict(state)


__all__ = [
    "CONFIG_FILE", "STORAGE_DTYPES", "WEIGHTS_FILE", "checkpoint_algo", "load_state", "load_weights", "read_config_json", "save_weights",
]
