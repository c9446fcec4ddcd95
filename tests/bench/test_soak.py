"""`dspark bench soak` (dspark/bench/soak.py): a bounded soak that counts requests and errors and
follows each server process's memory.

Specification: against the tiny gateway, every client request of a short soak is served and
checked, none fails, and the memory of the watched process is read at start and end; a server
that refuses the warm-up is an error, not a soak; the command starts `dspark serve` itself on
loopback (a tiny model directory here), reports the table and JSON, and exits 0 when nothing
failed. A process that has exited has no memory to read.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys

import pytest

from dspark.bench.soak import SoakConfig, rss_bytes, run_soak
from dspark.cli import main
from dspark.drafters.ngram import NgramDrafter
from dspark.engine.async_engine import AsyncEngine
from dspark.engine.speculative import SpeculativeEngine
from gateway.server import embedded_gateway
from tests.conftest import make_tiny_runtime
from tests.evaluation.conftest import write_byte_tokenizer
from tests.gateway.conftest import ByteTokenizer, live_server
from tests.services.conftest import write_tiny_model_dir


@pytest.fixture(scope="module")
def tiny_gateway_url():
    engine = AsyncEngine(SpeculativeEngine(make_tiny_runtime(), NgramDrafter(), num_speculative_tokens=3), idle_poll_s=0.01).start()
    gateway = embedded_gateway(engine, ByteTokenizer(), model_name="tiny-random", max_tokens_limit=16)
    with live_server(gateway.app) as url:
        yield url
    gateway.close()
    engine.shutdown()


@pytest.mark.processes
def test_rss_is_read_from_proc_and_none_once_a_process_has_exited():
    assert rss_bytes(os.getpid()) > 10 * 2**20
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    assert rss_bytes(process.pid) is None


def test_a_short_soak_serves_and_checks_every_request_and_reads_memory(tiny_gateway_url):
    config = SoakConfig(duration_s=2.0, concurrency=3, max_tokens=8, sample_every_s=0.5)
    report = asyncio.run(run_soak(tiny_gateway_url, {"this process": os.getpid()}, config))
    assert report.requests >= config.concurrency and report.num_errors == 0 and report.ok
    assert report.tokens == 8 * report.requests  # the byte tokenizer has no end-of-sequence: every request runs to max_tokens
    (memory,) = report.processes
    assert memory.alive and min(memory.start, memory.half, memory.end) > 0
    assert memory.peak >= max(memory.start, memory.half, memory.end)
    assert "requests served" in report.table() and "| this process |" in report.table()


def test_a_server_that_refuses_the_warm_up_is_an_error_not_a_soak(tiny_gateway_url):
    config = SoakConfig(duration_s=1.0, concurrency=2, max_tokens=64)  # over the server's max_tokens_limit of 16
    with pytest.raises(RuntimeError, match="warm-up request failed: HTTP 400"):
        asyncio.run(run_soak(tiny_gateway_url, {"this process": os.getpid()}, config))


@pytest.mark.processes
def test_the_command_soaks_dspark_serve_on_loopback_and_exits_0(tmp_path, capsys):
    model_dir = tmp_path / "tiny-model"
    model_dir.mkdir()
    write_tiny_model_dir(model_dir, vocab_size=write_byte_tokenizer(model_dir))
    out = tmp_path / "soak.json"
    code = main(["bench", "soak", "--duration", "3", "--concurrency", "2", "--max-tokens", "8", "--model", str(model_dir),
                 "--drafter", "ngram", "--policy", "fixed:2", "--sps-max-batch", "0", "--kv-budget-mb", "16",
                 "--start-timeout", "300", "--log", str(tmp_path / "serve.log"), "--json", str(out)])
    printed = capsys.readouterr().out
    assert code == 0, printed + (tmp_path / "serve.log").read_text()[-3000:]
    report = json.loads(out.read_text())
    assert report["requests"] > 0 and report["errors"] == {} and report["error_rate"] == 0.0
    (serve,) = report["processes"]
    assert serve["name"] == "serve" and serve["alive"] and serve["start"] > 0 and serve["half"] > 0 and serve["end"] > 0
    assert "| serve |" in printed
