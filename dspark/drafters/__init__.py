"""Drafters: propose draft tokens + the distribution rows they were sampled from (base.py).

`make_drafter(name, ...)` is the one registry the CLI and the servers build drafters from.
"""

from __future__ import annotations

from pathlib import Path

from dspark.drafters.base import Drafter, DraftProposal, DraftRequest, NoDrafter

DRAFTERS = ("none", "ngram", "dspark", "dspark-lookup", "dflash", "eagle3")
TRAINED_DRAFTERS = ("dspark", "dflash", "eagle3")  # read target hidden states, load from a checkpoint directory
# a trained drafter's checkpoint with lookup proposals where the context repeats (drafters/lookup.py)
LOOKUP_SUFFIX = "-lookup"


def checkpoint_family(name: str) -> str:
    """The trained family whose checkpoint a drafter name loads ("dspark-lookup" -> "dspark")."""
    return name.removesuffix(LOOKUP_SUFFIX)


def drafter_capture_layers(name: str, path: str | Path | None) -> tuple[int, ...] | None:
    """Target layers a drafter reads (the runtime must capture them), or None if it reads none."""
    name = checkpoint_family(name)
    if name not in TRAINED_DRAFTERS:
        return None
    directory = Path(_require_path(name, path))
    _check_algo(name, directory)
    if name == "dspark":
        from dspark.drafters.dspark.config import DSparkConfig

        return tuple(DSparkConfig.from_json((directory / "config.json").read_text()).target_layer_ids)
    if name == "dflash":
        from dspark.drafters.dflash.config import DFlashConfig

        return tuple(DFlashConfig.from_json((directory / "config.json").read_text()).target_layer_ids)
    from dspark.drafters.eagle3.config import Eagle3Config

    return tuple(Eagle3Config.from_json((directory / "config.json").read_text()).target_layer_ids)


def make_drafter(name: str, *, runtime=None, path: str | Path | None = None, top_k: int = 0) -> Drafter | None:
    """A drafter by name; None for plain decoding. The trained drafters (dspark, dflash, eagle3)
    need the target runtime (shared embedding and LM head) and a checkpoint directory."""
    if name == "none":
        return None
    if name == "ngram":
        from dspark.drafters.ngram import NgramDrafter

        return NgramDrafter()
    if name.endswith(LOOKUP_SUFFIX) and name in DRAFTERS:
        from dspark.drafters.lookup import LookupDrafter

        return LookupDrafter(make_drafter(checkpoint_family(name), runtime=runtime, path=path, top_k=top_k))
    if name not in TRAINED_DRAFTERS:
        raise ValueError(f"unknown drafter {name!r}; expected one of {DRAFTERS}")
    if runtime is None:
        raise ValueError(f"the {name} drafter shares the target's embedding and LM head: pass runtime=")
    directory = Path(_require_path(name, path))
    _check_algo(name, directory)
    if name == "dspark":
        from dspark.drafters.dspark.serving import DSparkServingDrafter

        return DSparkServingDrafter.load(directory, target=runtime.model, top_k=top_k)
    if name == "dflash":
        from dspark.drafters.dflash.serving import DFlashServingDrafter

        return DFlashServingDrafter.load(directory, target=runtime.model, top_k=top_k)
    from dspark.drafters.eagle3.serving import Eagle3ServingDrafter

    return Eagle3ServingDrafter.load(directory, target=runtime.model, top_k=top_k)


def _check_algo(name: str, directory: Path) -> None:
    # a clear error for a checkpoint of another drafter family (its config would not parse)
    from dspark.drafters.checkpoint_io import checkpoint_algo

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


__all__ = ["DRAFTERS", "TRAINED_DRAFTERS", "checkpoint_family", "DraftProposal", "DraftRequest", "Drafter", "NoDrafter", "drafter_capture_layers", "make_drafter"]
