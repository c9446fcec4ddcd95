"""Save / load a DFlash drafter: safetensors weights + JSON config carrying "algo": "dflash".

    save_checkpoint(out_dir, drafter=drafter)                      # storage_dtype="bfloat16" halves it
    drafter = load_checkpoint(out_dir, shared=SharedWeights.from_target(target))

Layout (as a DSpark checkpoint, dspark/drafters/dspark/checkpoint.py, plus the algo field):
    config.json        DFlashConfig.to_json(), with "algo": "dflash"
    model.safetensors  trainable tensors only (the shared embedding / LM head are the target's)
No pickle: safetensors and JSON only. `save_weights` / `load_weights` / `checkpoint_algo` are
the baselines' common checkpoint I/O (the EAGLE-3 checkpoint uses them too): loading checks
the tensors against the module the config builds and names every mismatch.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from dspark.drafters.dflash.config import DFlashConfig
from dspark.drafters.dflash.model import DFlashDrafter
from dspark.drafters.dspark.model import SharedWeights

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
FORMAT = "dflash-drafter/1"
STORAGE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def checkpoint_algo(directory: str | Path) -> str:
    """The drafter family a checkpoint directory holds: its config's "algo" field ("dspark" when
    absent: DSpark checkpoints predate the field)."""
    path = Path(directory) / CONFIG_FILE
    if not path.exists():
        raise FileNotFoundError(f"{directory} is not a drafter checkpoint: no {CONFIG_FILE}")
    data = json.loads(path.read_text())
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
    expected = {name: tuple(t.shape) for name, t in module.state_dict().items()}
    got = {name: tuple(t.shape) for name, t in state.items()}
    problems = [f"missing {n}" for n in sorted(expected.keys() - got.keys())]
    problems += [f"unexpected {n}" for n in sorted(got.keys() - expected.keys())]
    problems += [f"{n}: shape {got[n]}, config implies {expected[n]}" for n in sorted(expected.keys() & got.keys()) if got[n] != expected[n]]
    if problems:
        raise ValueError(f"{Path(directory)}: weights do not match {CONFIG_FILE}: " + "; ".join(problems))
    module.load_state_dict(state)


def save_checkpoint(directory: str | Path, *, drafter: DFlashDrafter, storage_dtype: str = "float32") -> Path:
    return save_weights(directory, module=drafter, config_json=drafter.config.to_json(), fmt=FORMAT, storage_dtype=storage_dtype)


def load_checkpoint(directory: str | Path, *, shared: SharedWeights, device: str | torch.device = "cpu") -> DFlashDrafter:
    config = DFlashConfig.from_json(read_config_json(directory, algo="dflash"))
    drafter = DFlashDrafter(config, shared=shared)  # checks shared shapes against the config
    load_weights(directory, module=drafter, fmt=FORMAT, device=device)
    return drafter.to(device)


__all__ = [
    "CONFIG_FILE", "STORAGE_DTYPES", "WEIGHTS_FILE", "checkpoint_algo", "load_checkpoint", "load_weights",
    "read_config_json", "save_checkpoint", "save_weights",
]
