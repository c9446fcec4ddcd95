"""benchmarks/bench_service_split.py end to end, --quick, on a tiny random model and DSpark drafter.

Specification: the script starts `dspark verifier` and `dspark drafter` processes, runs the same
requests in process and over them (it would stop on a single differing token), and prints one
row per kind of draft rows and concurrency; every round sends and receives bytes to and from
both services; dense rows weigh more on the wire than top-k rows, in the drafter's replies and in
the verifier's requests, and point masses (temperature 0) least.
"""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest

from dspark.model.transformer import Transformer
from tests.evaluation.conftest import save_tiny_dspark_checkpoint, write_byte_tokenizer
from tests.services.conftest import write_tiny_model_dir

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture
def bench(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))  # the scripts import their `common` module
    return importlib.import_module("bench_service_split")


@pytest.fixture
def tiny_model_and_drafter(tmp_path) -> tuple[Path, Path]:
    """A tiny random Llama with a byte-level chat tokenizer, and a tiny random DSpark drafter for it."""
    model = tmp_path / "tiny-model"
    model.mkdir()
    write_tiny_model_dir(model, vocab_size=write_byte_tokenizer(model), max_position_embeddings=2048)
    return model, save_tiny_dspark_checkpoint(Transformer.from_dir(model), tmp_path / "dspark")


def test_quick_run_prints_every_row_with_bytes_growing_from_point_to_sparse_to_dense(bench, tiny_model_and_drafter, capsys):
    model, drafter = tiny_model_and_drafter
    cells = bench.main(["--model", str(model), "--drafter", "dspark", "--drafter-path", str(drafter), "--quick", "--threads", "1"])

    assert [(c.rows, c.concurrency) for c in cells] == [(kind, c) for kind in ("point", "sparse-32", "dense") for c in (1, 4)]
    table = capsys.readouterr().out.splitlines()
    header = next(i for i, line in enumerate(table) if line.split() == bench.HEADERS)
    assert [line.split()[:2] for line in table[header + 1 :]] == [[c.rows, str(c.concurrency)] for c in cells]
    for c in cells:
        assert c.rounds > 1 and c.inproc_s > 0 and c.split_s > 0
        assert min(c.to_verifier, c.from_verifier, c.to_drafter, c.from_drafter) > 0
    by = {(c.rows, c.concurrency): c for c in cells}
    for n in (1, 4):
        point, sparse, dense = by["point", n], by["sparse-32", n], by["dense", n]
        assert dense.from_drafter > sparse.from_drafter > point.from_drafter
        assert dense.to_verifier > sparse.to_verifier > point.to_verifier


def test_a_drafter_without_probability_rows_is_refused(bench):
    with pytest.raises(SystemExit):
        bench.main(["--drafter", "ngram", "--quick"])
