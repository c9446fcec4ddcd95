"""Trained drafter checkpoints that ship inside the package (what `--drafter dspark` loads when
no `--drafter-path` is given).

    dspark/drafters/checkpoints/<name>/   config.json, model.safetensors (bf16), sts.json

docs/results/training.md gives the one command that reproduces each of them.
"""

from __future__ import annotations

from pathlib import Path

from dspark.model.model_store import DEFAULT_MODEL

CHECKPOINTS_DIR = Path(__file__).resolve().parent / "checkpoints"

# (drafter family, target model name) -> directory under CHECKPOINTS_DIR
SHIPPED: dict[tuple[str, str], str] = {
    ("dspark", DEFAULT_MODEL): "dspark-smollm2-135m-instruct",
}


def shipped_checkpoint(name: str, model: str = DEFAULT_MODEL) -> Path | None:
    """The packaged checkpoint of drafter family `name` for `model`, or None if none ships."""
    sub = SHIPPED.get((name, model))
    if sub is None:
        return None
    path = CHECKPOINTS_DIR / sub
    return path if (path / "config.json").exists() else None


__all__ = ["CHECKPOINTS_DIR", "SHIPPED", "shipped_checkpoint"]
