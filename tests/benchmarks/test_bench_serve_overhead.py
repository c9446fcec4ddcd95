"""benchmarks/bench_serve_overhead.py: a setup it cannot compare is refused before anything loads.

Specification: the speculative setup takes a drafter the server and the engine build the same
way (dspark or dspark-lookup); another name exits with status 2 and says which it takes,
without loading the model or starting a server. (The measurement itself is the benchmark's
run, docs/results/serving.md; never timed in a test.)
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture
def bench(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))  # the scripts import their `common` module
    return importlib.import_module("bench_serve_overhead")


def test_an_unsupported_drafter_is_refused_before_loading_anything(bench, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["bench_serve_overhead.py", "--drafter", "ngram"])
    monkeypatch.setattr(bench.TargetRuntime, "load", lambda *a, **k: pytest.fail("the model was loaded"))
    assert bench.main() == 2
    assert "--drafter takes dspark or dspark-lookup, got 'ngram'" in capsys.readouterr().err
