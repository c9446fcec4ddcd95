"""The drafter registry: every drafter the system serves or trains, by name.

    make_drafter("dspark", runtime=runtime, path=DIR)    # the serving Drafter (None for "none")
    drafter_capture_layers("eagle3", DIR)                # target layers it reads (None: it reads none)
    family("dflash").objective.loss(model, batch)        # what training needs of a family
    drafter_names()                                      # what --drafter accepts

A trained family (dspark, dflash, eagle3) is one `DrafterFamily`, declared in its own folder
(dspark/drafters/<name>/family.py): its config, model, checkpoint load / save, serving class and
training objective. A new family is a folder plus a line in `_builtin_families`, or a
`register_family` call from outside the package. The drafters without a checkpoint have no
entry: "none" (plain decoding), "ngram" (prompt lookup, drafters/ngram.py) and "<family>-lookup"
(lookup proposals beside the family's drafter, drafters/lookup.py) for the families whose
proposals carry confidences (`lookup_variant`).

A checkpoint directory in DeepSpec's released layout (github.com/deepseek-ai/DeepSpec: its DSpark,
DFlash and EAGLE-3 drafters of Qwen3 targets) is served as it is: its config and tensors are
translated onto the family it maps to (dspark/drafters/deepspec_format.py, docs/deepspec-checkpoints.md).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from torch import nn

from dspark.drafters import deepspec_format
from dspark.drafters.base import Drafter
from dspark.drafters.checkpoint_io import checkpoint_algo

if TYPE_CHECKING:
    from dspark.model.target_runtime import TargetRuntime
    from dspark.model.transformer import Transformer
    from dspark.training.objective import TrainingObjective

SERVING_ONLY = ("none", "ngram")  # drafters without a checkpoint
LOOKUP_SUFFIX = "-lookup"  # "<family>-lookup": the family's checkpoint with lookup proposals where the context repeats


class FamilyConfig(Protocol):
    """What the registry reads of a family's config (a flat frozen dataclass with a JSON round trip)."""

    target_layer_ids: tuple[int, ...]
    block_size: int

    @classmethod
    def from_json(cls, text: str) -> FamilyConfig: ...


class ServingClass(Protocol):
    """A family's serving drafter class, built from a checkpoint directory and the target it shares weights with."""

    def load(self, path: str | Path, *, target: Transformer, top_k: int = 0) -> Drafter: ...


@dataclass(frozen=True)
class DrafterFamily:
    """Everything the system knows about one trained drafter family."""

    name: str  # `--drafter` / `dspark train --algo`, and the "algo" of its checkpoints' config.json
    config: type[FamilyConfig]  # what config.json holds
    model: type[nn.Module]  # what `load` returns and `objective.build` builds
    load: Callable[..., nn.Module]  # (directory, *, shared, device="cpu") -> model: a checkpoint's weights
    save: Callable[..., Path]  # (directory, *, drafter) -> directory
    serving: ServingClass  # .load(directory, *, target, top_k) -> the engine's Drafter
    objective: TrainingObjective  # how `dspark train` builds and trains it (dspark.training.objective)
    lookup_variant: bool = False  # also served as "<name>-lookup" (needs proposals with confidences)


_families: dict[str, DrafterFamily] = {}
_builtins_registered = False


def _builtin_families() -> tuple[DrafterFamily, ...]:
    # Imported on first use, not at the top: a family's objective imports dspark.training, which
    # imports this package; and naming the drafters (--help) should load no model code before then.
    from dspark.drafters.dflash.family import FAMILY as DFLASH
    from dspark.drafters.dspark.family import FAMILY as DSPARK
    from dspark.drafters.eagle3.family import FAMILY as EAGLE3

    return DSPARK, DFLASH, EAGLE3


def _registered() -> dict[str, DrafterFamily]:
    global _builtins_registered
    if not _builtins_registered:
        _builtins_registered = True
        for f in _builtin_families():
            _families[f.name] = f
    return _families


def register_family(entry: DrafterFamily) -> None:
    """Make a family servable (`make_drafter`) and trainable (`dspark.training.trainer`) by name."""
    families = _registered()
    if entry.name in families or entry.name in SERVING_ONLY or entry.name.endswith(LOOKUP_SUFFIX):
        raise ValueError(f"drafter family name {entry.name!r} is taken or reserved (registered: {sorted(families)}, "
                         f"reserved: {SERVING_ONLY} and names ending in {LOOKUP_SUFFIX!r})")
    families[entry.name] = entry


def unregister_family(name: str) -> None:
    """Forget a family registered with `register_family` (tests; the built-in ones stay)."""
    if name in {f.name for f in _builtin_families()}:
        raise ValueError(f"{name!r} is a built-in drafter family")
    _registered().pop(name, None)


def families() -> tuple[DrafterFamily, ...]:
    """Every registered family, the built-in ones first."""
    return tuple(_registered().values())


def family(name: str) -> DrafterFamily:
    """The family named `name` (ValueError naming the registered ones otherwise)."""
    registered = _registered()
    if name not in registered:
        raise ValueError(f"unknown drafter family {name!r}; expected one of {sorted(registered)}")
    return registered[name]


def drafter_names() -> tuple[str, ...]:
    """Every name `make_drafter` accepts."""
    names = list(SERVING_ONLY)
    for f in families():
        names += [f.name, f.name + LOOKUP_SUFFIX] if f.lookup_variant else [f.name]
    return tuple(names)


def checkpoint_family(name: str) -> str:
    """The family whose checkpoint a drafter name loads ("dspark-lookup" -> "dspark")."""
    return name.removesuffix(LOOKUP_SUFFIX)


def drafter_capture_layers(name: str, path: str | Path | None) -> tuple[int, ...] | None:
    """Target layers a drafter reads (the runtime must capture them), or None if it reads none."""
    entry = _registered().get(checkpoint_family(name))
    if entry is None:
        return None
    directory = Path(_require_path(entry.name, path))
    _check_algo(entry.name, directory)
    if deepspec_format.is_deepspec_checkpoint(directory):  # DeepSpec's released layout: its config translated
        return tuple(deepspec_format.read_config(directory, algo=entry.name).target_layer_ids)
    return tuple(entry.config.from_json((directory / "config.json").read_text()).target_layer_ids)


def make_drafter(name: str, *, runtime: TargetRuntime | None = None, path: str | Path | None = None,
                 top_k: int = 0) -> Drafter | None:
    """A drafter by name; None for plain decoding. A trained family's drafter needs the target
    runtime (shared embedding and LM head) and a checkpoint directory (default: the one shipped
    for it, dspark.drafters.shipped)."""
    if name == "none":
        return None
    if name == "ngram":
        from dspark.drafters.ngram import NgramDrafter

        return NgramDrafter()
    names = drafter_names()
    if name.endswith(LOOKUP_SUFFIX) and name in names:
        from dspark.drafters.datastore import DATASTORE_FILE, NgramDatastore
        from dspark.drafters.lookup import LookupDrafter

        model = make_drafter(checkpoint_family(name), runtime=runtime, path=path, top_k=top_k)
        # the target's own answers as an n-gram datastore, where the checkpoint carries one (datastore.py)
        store = Path(_require_path(checkpoint_family(name), path)) / DATASTORE_FILE
        return LookupDrafter(model, datastore=NgramDatastore.load(store) if store.exists() else None)
    if name not in names:
        raise ValueError(f"unknown drafter {name!r}; expected one of {names}")
    if runtime is None:
        raise ValueError(f"the {name} drafter shares the target's embedding and LM head: pass runtime=")
    directory = Path(_require_path(name, path))
    _check_algo(name, directory)
    if deepspec_format.is_deepspec_checkpoint(directory):
        # trained for this target? (hidden size, vocabulary, layer count and ids) before reading any weights
        deepspec_format.check_target(directory, runtime.model.config)
    return family(name).serving.load(directory, target=runtime.model, top_k=top_k)


def _check_algo(name: str, directory: Path) -> None:
    # a clear error for a checkpoint of another drafter family (its config would not parse)
    found = checkpoint_algo(directory)
    if found != name:
        raise ValueError(f"{directory} holds a {found!r} drafter checkpoint; use --drafter {found} (or another --drafter-path)")


def _require_path(name: str, path: str | Path | None) -> str | Path:
    """`path`, else the checkpoint shipped in the package for the default target (dspark.drafters.shipped)."""
    if path is not None:
        return path
    from dspark.drafters.shipped import shipped_checkpoint

    shipped = shipped_checkpoint(name)
    if shipped is None:
        raise ValueError(
            f"the {name} drafter needs a checkpoint directory (--drafter-path DIR): none ships for it "
            f"(train one with `dspark train --algo {name}`)"
        )
    return shipped


__all__ = [
    "LOOKUP_SUFFIX", "SERVING_ONLY", "DrafterFamily", "checkpoint_family", "drafter_capture_layers", "drafter_names",
    "families", "family", "make_drafter", "register_family", "unregister_family",
]
