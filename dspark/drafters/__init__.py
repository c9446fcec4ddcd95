"""Drafters: propose draft tokens + the distribution rows they were sampled from (base.py).

`make_drafter(name, ...)` is the one registry the CLI and the servers build drafters from.
"""

from __future__ import annotations

from pathlib import Path

from dspark.drafters.base import DraftProposal, DraftRequest, Drafter, NoDrafter

DRAFTERS = ("none", "ngram", "dspark")


def drafter_capture_layers(name: str, path: str | Path | None) -> tuple[int, ...] | None:
    """Target layers a drafter reads (the runtime must capture them), or None if it reads none."""
    if name != "dspark":
        return None
    from dspark.drafters.dspark.config import DSparkConfig

    return tuple(DSparkConfig.from_json((Path(_require_path(name, path)) / "config.json").read_text()).target_layer_ids)


def make_drafter(name: str, *, runtime=None, path: str | Path | None = None, top_k: int = 0) -> Drafter | None:
    """A drafter by name; None for plain decoding. `dspark` needs the target runtime (shared
    embedding and LM head) and a checkpoint directory."""
    if name == "none":
        return None
    if name == "ngram":
        from dspark.drafters.ngram import NgramDrafter

        return NgramDrafter()
    if name == "dspark":
        from dspark.drafters.dspark.serving import DSparkServingDrafter

        if runtime is None:
            raise ValueError("the dspark drafter shares the target's embedding and LM head: pass runtime=")
        return DSparkServingDrafter.load(_require_path(name, path), target=runtime.model, top_k=top_k)
    raise ValueError(f"unknown drafter {name!r}; expected one of {DRAFTERS}")


def _require_path(name: str, path: str | Path | None) -> str | Path:
    if path is None:
        raise ValueError(
            f"the {name} drafter needs a checkpoint directory (--drafter-path DIR); no trained checkpoint "
            "for the default target is shipped yet (train one with `dspark train`, issue #3)"
        )
    return path


__all__ = ["DRAFTERS", "DraftProposal", "DraftRequest", "Drafter", "NoDrafter", "drafter_capture_layers", "make_drafter"]
