"""benchmarks/bench_lockstep.py: engines stepped round by round in turn over one runtime.

Specification: every engine gets the same requests and runs until all are done; only decode
rounds are timed (the first round prefills); greedy engines emit the same tokens, a drafter's
engine in fewer rounds when its drafts are right. (The speeds themselves are the benchmark's
output, docs/results/serving.md; never timed in a test.)
"""

from __future__ import annotations

import importlib

import pytest

from dspark.drafters.ngram import NgramDrafter
from dspark.engine.speculative import SpeculativeEngine
from dspark.scheduling.policies import parse_policy
from tests.benchmarks.test_bench_serve_overhead import BENCHMARKS


@pytest.fixture
def bench(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    return importlib.import_module("bench_lockstep")


def test_engines_in_lockstep_emit_the_same_greedy_tokens_and_count_decode_rounds_only(bench, tiny_runtime):
    engines = [SpeculativeEngine(tiny_runtime, None),
               SpeculativeEngine(tiny_runtime, NgramDrafter(), num_speculative_tokens=3, policy=parse_policy("fixed:3"))]
    prompts = [[5, 6, 7, 5, 6, 7, 5, 6], [1, 2, 3, 1, 2, 3, 1, 2, 3]]
    stats = bench.lockstep(engines, prompts, batch=1, concurrency=2, max_tokens=12, temperature=0.0)
    assert stats[0]["outputs"] == stats[1]["outputs"] and all(len(o) == 12 for o in stats[0]["outputs"].values())
    assert stats[0]["rounds"] == 12 and stats[1]["rounds"] <= 12
    assert stats[0]["tokens"] == 2 * 11  # the prefill round's first tokens are not counted
    assert stats[0]["seconds"] > 0 and not any(e.has_unfinished for e in engines)
