"""Shared helpers of the benchmark scripts: prompts from ../shared/data/eval, medians, tables."""

from __future__ import annotations

import json
import os
import statistics
from pathlib import Path

EVAL_DIR = Path(os.environ.get("DSPARK_EVAL_DIR", Path(__file__).resolve().parents[2] / "shared" / "data" / "eval"))


def load_prompts(benchmark: str, limit: int) -> list[str]:
    """First-turn user messages of a benchmark file (one JSON object per line with "turns")."""
    path = EVAL_DIR / f"{benchmark}.jsonl"
    if not path.exists():
        raise FileNotFoundError(f"{path} not found; set DSPARK_EVAL_DIR to the folder of the benchmark .jsonl files")
    prompts = []
    with path.open() as f:
        for line in f:
            prompts.append(json.loads(line)["turns"][0])
            if len(prompts) == limit:
                break
    return prompts


def median(xs: list[float]) -> float:
    return statistics.median(xs)


def print_table(headers: list[str], rows: list[list]) -> None:
    cells = [[f"{c:.3f}" if isinstance(c, float) else str(c) for c in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) for i, h in enumerate(headers)]
    print("  ".join(h.rjust(w) for h, w in zip(headers, widths)))
    for r in cells:
        print("  ".join(c.rjust(w) for c, w in zip(r, widths)))
