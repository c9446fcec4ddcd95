"""The JSON round trip every drafter configuration shares (DSpark, DFlash, EAGLE-3).

A configuration is a flat frozen dataclass; on disk it is the dataclass as a JSON object, with
`target_layer_ids` as a list and, for the baselines, an `"algo"` tag that says which family the
checkpoint belongs to (DSpark's files carry none: they predate the baselines and stay readable).
Unknown keys are errors that name them: a typo in a hand-edited config must not be ignored.

    d = config_to_dict(cfg, algo="dflash")
    assert config_from_dict(DFlashConfig, d, algo="dflash") == cfg
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, TypeVar

from dspark.model.config import ModelConfig

__all__ = ["check_fields", "check_shares_target", "config_from_dict", "config_from_json", "config_to_dict", "config_to_json"]

C = TypeVar("C")


def check_fields(cls: type, names, *, expected: bool = False) -> None:
    """Raise ValueError naming the keys of `names` that are not fields of `cls`."""
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = set(names) - known
    if unknown:
        tail = f"; expected a subset of {sorted(known)}" if expected else ""
        raise ValueError(f"unknown {cls.__name__} fields {sorted(unknown)}{tail}")


def check_shares_target(vocab_size: int, hidden_size: int, target_layer_ids: tuple[int, ...], target: ModelConfig) -> None:
    """Raise if a drafter of this geometry cannot run on `target`: it shares the target's embedding
    and LM head (same vocabulary and hidden size) and reads its hidden states (layers in range)."""
    if (vocab_size, hidden_size) != (target.vocab_size, target.hidden_size):
        raise ValueError(
            f"drafter (vocab {vocab_size}, hidden {hidden_size}) does not match the target "
            f"(vocab {target.vocab_size}, hidden {target.hidden_size}): embedding and LM head are shared"
        )
    bad = [layer for layer in target_layer_ids if layer >= target.num_layers]
    if bad:
        raise ValueError(f"target_layer_ids {bad} out of range for a {target.num_layers}-layer target")


def config_to_dict(cfg: Any, *, algo: str | None = None) -> dict[str, Any]:
    d = dataclasses.asdict(cfg)
    d["target_layer_ids"] = list(cfg.target_layer_ids)
    return d if algo is None else {"algo": algo, **d}


def config_from_dict(cls: type[C], d: dict[str, Any], *, algo: str | None = None) -> C:
    d = dict(d)
    if algo is not None:
        found = d.pop("algo", None)
        if found != algo:
            raise ValueError(f"not a {cls.__name__} (another drafter family's checkpoint?): algo is {found!r}, expected {algo!r}")
    check_fields(cls, d, expected=True)
    if "target_layer_ids" in d:
        d["target_layer_ids"] = tuple(int(layer) for layer in d["target_layer_ids"])
    return cls(**d)


def config_to_json(cfg: Any, *, algo: str | None = None) -> str:
    return json.dumps(config_to_dict(cfg, algo=algo), indent=2, sort_keys=True)


def config_from_json(cls: type[C], text: str, *, algo: str | None = None) -> C:
    return config_from_dict(cls, json.loads(text), algo=algo)
