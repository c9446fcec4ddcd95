"""What every drafter configuration shares (DSpark, DFlash, EAGLE-3): the JSON round trip, the
target's geometry as the draft layers' default, the geometry checks and the derived sizes.

A configuration is a flat frozen dataclass; on disk it is the dataclass as a JSON object, with
`target_layer_ids` as a list and, for the baselines, an `"algo"` tag that says which family the
checkpoint belongs to (DSpark's files carry none: they predate the baselines and stay readable).
Unknown keys are errors that name them: a typo in a hand-edited config must not be ignored.

    d = config_to_dict(cfg, algo="dflash")
    assert config_from_dict(DFlashConfig, d, algo="dflash") == cfg

The draft layers copy the target's attention geometry by default (`target_geometry(target)`);
`check_geometry` is the validation they all share. `DrafterConfigBase`, the base of the config
dataclasses, derives the sizes and gives the JSON methods (`to_json`, `from_json`, ...).
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, ClassVar, Self, TypeVar

from dspark.model.config import ModelConfig

__all__ = [
    "DrafterConfigBase", "check_fields", "check_geometry", "check_shares_target", "config_for_target", "config_from_dict",
    "config_from_json", "config_to_dict", "config_to_json", "target_geometry",
]

C = TypeVar("C")


def check_fields(cls: type, names, *, expected: bool = False) -> None:
    """Raise ValueError naming the keys of `names` that are not fields of `cls`."""
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = set(names) - known
    if unknown:
        tail = f"; expected a subset of {sorted(known)}" if expected else ""
        raise ValueError(f"unknown {cls.__name__} fields {sorted(unknown)}{tail}")


def target_geometry(target: ModelConfig) -> dict[str, Any]:
    """The draft layers' default geometry: the target's. The drafter shares the target's embedding
    and LM head, so vocabulary and hidden size MUST be the target's; the rest is only a sensible default."""
    return {
        "vocab_size": target.vocab_size,
        "hidden_size": target.hidden_size,
        "num_heads": target.num_heads,
        "num_kv_heads": target.num_kv_heads,
        "head_dim": target.head_dim,
        "intermediate_size": target.intermediate_size,
        "rms_norm_eps": target.rms_norm_eps,
        "rope_theta": target.rope_theta,
        "rope_scaling": dict(target.rope_scaling) if target.rope_scaling else None,
        "qk_norm": target.qk_norm,
    }


def config_for_target(cls: type[C], target: ModelConfig, *, defaults: dict[str, Any], overrides: dict[str, Any]) -> C:
    """`cls(**defaults, **overrides)` (target_layer_ids as a tuple), checked against `target` (its
    `check_target`); an override that is not a field of `cls` is an error that names it."""
    check_fields(cls, overrides)
    base = {**defaults, **overrides}
    base["target_layer_ids"] = tuple(base["target_layer_ids"])
    cfg = cls(**base)
    cfg.check_target(target)
    return cfg


GEOMETRY_POSITIVE_INTS = ("vocab_size", "hidden_size", "num_heads", "num_kv_heads", "head_dim", "intermediate_size", "block_size")


def check_geometry(cfg: Any, *, also_positive: tuple[str, ...] = ()) -> None:
    """Raise ValueError unless `cfg`'s sizes (and the fields in `also_positive`) are positive ints,
    its query heads group evenly over the KV heads, head_dim is even (RoPE rotates pairs) and
    target_layer_ids is a non-empty tuple of distinct non-negative layer indices."""
    for name in GEOMETRY_POSITIVE_INTS + also_positive:
        value = getattr(cfg, name)
        if not isinstance(value, int) or value <= 0:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if cfg.num_heads % cfg.num_kv_heads:
        raise ValueError(f"num_heads ({cfg.num_heads}) must be a multiple of num_kv_heads ({cfg.num_kv_heads})")
    if cfg.head_dim % 2:
        raise ValueError(f"head_dim must be even for RoPE, got {cfg.head_dim}")
    layers = cfg.target_layer_ids
    if not isinstance(layers, tuple) or not layers:
        raise ValueError(f"target_layer_ids must be a non-empty tuple, got {layers!r}")
    if len(set(layers)) != len(layers) or min(layers) < 0:
        raise ValueError(f"target_layer_ids must be distinct non-negative layer indices, got {layers}")


class DrafterConfigBase:
    """What a drafter configuration dataclass derives from its fields, with no fields of its own:
    the sizes (from num_heads, num_kv_heads, head_dim, target_layer_ids) and the JSON round trip,
    tagged `"algo": json_algo` where the subclass sets one."""

    json_algo: ClassVar[str | None] = None  # DSpark's files carry no tag: they predate the baselines

    @property
    def num_context_layers(self) -> int:  # m, the target layers read
        return len(self.target_layer_ids)

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def to_dict(self) -> dict[str, Any]:
        return config_to_dict(self, algo=self.json_algo)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Self:
        return config_from_dict(cls, d, algo=cls.json_algo)

    def to_json(self) -> str:
        return config_to_json(self, algo=self.json_algo)

    @classmethod
    def from_json(cls, text: str) -> Self:
        return config_from_json(cls, text, algo=cls.json_algo)


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
