"""Shared helpers of the benchmark scripts: medians, tables and the CPU's name (prompts: dspark.evaluation.prompts)."""

from __future__ import annotations

import platform
import statistics
from pathlib import Path

from dspark.evaluation.prompts import load_first_turns


def load_prompts(benchmark: str, limit: int) -> list[str]:
    """First-turn user messages of a benchmark of ../shared/data/eval."""
    return load_first_turns(benchmark, limit=limit)


def median(xs: list[float]) -> float:
    return statistics.median(xs)


def print_table(headers: list[str], rows: list[list]) -> None:
    cells = [[f"{c:.3f}" if isinstance(c, float) else str(c) for c in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) for i, h in enumerate(headers)]
    print("  ".join(h.rjust(w) for h, w in zip(headers, widths)))
    for r in cells:
        print("  ".join(c.rjust(w) for c, w in zip(r, widths)))


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"
