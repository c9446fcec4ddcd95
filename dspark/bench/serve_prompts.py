"""The serving benchmark's prompts: first user turns of the math, code and chat sets of
../shared/data/eval (dspark.evaluation.prompts), interleaved so that any prefix is balanced.

    prompts = load_prompt_mix(("math", "code", "chat"), per_benchmark=64, max_chars=4000)
    prompts[0].benchmark, prompts[0].text

Request k of every load point sends prompts[k % len(prompts)] with seed base + k, so every
policy and every concurrency level sees the same requests in the same order.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TypeVar

from dspark.evaluation.prompts import BENCHMARKS, load_first_turns

# The paper's three domains, grouped as in dspark.evaluation.offline_eval.DOMAINS (a test keeps
# them equal; that module imports torch, which a load generator does not need).
PROMPT_SETS: dict[str, tuple[str, ...]] = {
    "math": ("gsm8k", "math500", "aime25"),
    "code": ("mbpp", "humaneval", "livecodebench"),
    "chat": ("mt-bench", "arena-hard-v2"),
}

T = TypeVar("T")


@dataclass(frozen=True)
class BenchPrompt:
    benchmark: str  # file name in ../shared/data/eval, e.g. "gsm8k"
    domain: str  # "math" | "code" | "chat"
    text: str  # the first user turn


def round_robin(groups: Sequence[Sequence[T]]) -> list[T]:
    """Items taken one per group in turn until every group is exhausted: [a0, b0, c0, a1, b1, ...]."""
    out: list[T] = []
    for i in range(max((len(g) for g in groups), default=0)):
        out.extend(g[i] for g in groups if i < len(g))
    return out


def resolve_sets(names: Iterable[str]) -> list[tuple[str, str]]:
    """(domain, benchmark) pairs for names that are domains ("math") or benchmarks ("gsm8k")."""
    pairs: list[tuple[str, str]] = []
    for name in names:
        if name in PROMPT_SETS:
            pairs.extend((name, b) for b in PROMPT_SETS[name])
        elif name in BENCHMARKS:
            pairs.append((next(d for d, bs in PROMPT_SETS.items() if name in bs), name))
        else:
            raise ValueError(f"unknown prompt set {name!r}; expected a domain ({', '.join(PROMPT_SETS)}) "
                             f"or a benchmark ({', '.join(BENCHMARKS)})")
    if not pairs:
        raise ValueError("no prompt sets given")
    return list(dict.fromkeys(pairs))


def load_prompt_mix(sets: Iterable[str] = ("math", "code", "chat"), *, per_benchmark: int = 64,
                    max_chars: int | None = 4000) -> list[BenchPrompt]:
    """Up to `per_benchmark` first turns of each benchmark of `sets`, those longer than `max_chars`
    left out (on this CPU a long prefill dominates a point; None keeps all), interleaved domain by
    domain and, within a domain, benchmark by benchmark."""
    if per_benchmark < 1:
        raise ValueError(f"per_benchmark must be >= 1, got {per_benchmark}")
    if max_chars is not None and max_chars < 1:
        raise ValueError(f"max_chars must be >= 1 or None, got {max_chars}")
    by_domain: dict[str, list[list[BenchPrompt]]] = {}
    for domain, benchmark in resolve_sets(sets):
        texts = [t for t in load_first_turns(benchmark) if max_chars is None or len(t) <= max_chars][:per_benchmark]
        by_domain.setdefault(domain, []).append([BenchPrompt(benchmark, domain, t) for t in texts])
    prompts = round_robin([round_robin(groups) for groups in by_domain.values()])
    if not prompts:
        raise ValueError(f"no prompt of the sets {list(sets)} is at most {max_chars} characters long")
    return prompts
