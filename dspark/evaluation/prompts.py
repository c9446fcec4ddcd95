"""The paper's benchmark prompts (GSM8K, MATH500, AIME25, MBPP, HumanEval, LiveCodeBench,
MT-Bench, Arena-Hard): one JSON object per line with a "turns" list of user messages.

They live outside the repository (../shared/data/eval beside the checkout); `eval_dir()` finds
them: $DSPARK_EVAL_DIR if set, else ../shared/data/eval next to the repository, else
/work/shared/data/eval. They are for evaluation only, never for training data.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

BENCHMARKS = ("gsm8k", "math500", "aime25", "mbpp", "humaneval", "livecodebench", "mt-bench", "arena-hard-v2")


def eval_dir() -> Path:
    candidates = []
    if os.environ.get("DSPARK_EVAL_DIR"):
        candidates.append(Path(os.environ["DSPARK_EVAL_DIR"]))
    candidates += [Path(__file__).resolve().parents[3] / "shared" / "data" / "eval", Path("/work/shared/data/eval")]
    for path in candidates:
        if (path / "humaneval.jsonl").exists():
            return path
    raise FileNotFoundError(
        f"benchmark prompts not found in any of {[str(p) for p in candidates]}; set DSPARK_EVAL_DIR"
    )


def load_turns(benchmark: str, *, limit: int | None = None) -> list[list[str]]:
    """The user turns of each prompt of `benchmark` (file name without .jsonl), first `limit` prompts."""
    path = eval_dir() / f"{benchmark}.jsonl"
    if not path.exists():
        raise FileNotFoundError(f"{path} not found; benchmarks available: {BENCHMARKS}")
    prompts = []
    with path.open() as f:
        for line in f:
            if line.strip():
                prompts.append(list(json.loads(line)["turns"]))
            if limit is not None and len(prompts) == limit:
                break
    return prompts


def load_first_turns(benchmark: str, *, limit: int | None = None) -> list[str]:
    """First user message of each prompt (single-turn use: latency benchmarks, smoke tests)."""
    return [turns[0] for turns in load_turns(benchmark, limit=limit)]
