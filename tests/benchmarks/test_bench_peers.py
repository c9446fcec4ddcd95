"""benchmarks/bench_peers.py: a llama.cpp peer that crashes costs its row, never the run.

Specification: before loading a GGUF in process, the script loads it and decodes a token in a
child process; a child killed by a signal or failing otherwise gives the reason the row is left
out, and a child that succeeds lets the in-process load go ahead. The child's `llama_cpp` here is
a stand-in package on PYTHONPATH, so the test needs neither llama.cpp nor a GGUF.
"""

from __future__ import annotations

import importlib
import re
import textwrap
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture
def bench(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))  # the scripts import their `common` module
    return importlib.import_module("bench_peers")


def fake_llama_cpp(root: Path, init_body: str) -> None:
    package = root / "llama_cpp"
    package.mkdir()
    (package / "__init__.py").write_text(textwrap.dedent(f"""
        import os, signal, sys
        class Llama:
            def __init__(self, **kwargs):
                {init_body}
            def generate(self, tokens, **kwargs):
                yield 42
    """))


@pytest.mark.parametrize(("init_body", "expected"), [
    ("os.kill(os.getpid(), signal.SIGSEGV)", r"in a child process \(signal 11"),
    ("raise ValueError('unknown model architecture')", r"exit status 1: ValueError: unknown model architecture"),
])
def test_a_gguf_that_crashes_llama_cpp_is_reported_not_fatal(bench, tmp_path, monkeypatch, init_body, expected):
    fake_llama_cpp(tmp_path, init_body)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    why_not = bench.llama_cpp_crash(gguf, threads=1)
    assert why_not is not None
    assert "model.gguf" in why_not
    assert re.search(expected, why_not), why_not


def test_a_gguf_that_loads_passes_the_probe(bench, tmp_path, monkeypatch):
    fake_llama_cpp(tmp_path, "self.kwargs = kwargs")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    assert bench.llama_cpp_crash(gguf, threads=1) is None
