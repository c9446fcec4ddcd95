"""The load generator end to end, against the real gateway (embedded: in-memory bus, worker
thread, AsyncEngine) on the tiny random model behind a live uvicorn server.

Specification: a closed-loop point keeps exactly C requests in flight, runs its warm-up first and
leaves it out; every measured request streams all its tokens, with TTFT, decode speed and the
speculative statistics of the `speculative` extension; the point's verification budget and τ
are the pooled ones of its requests; an open-loop point records its rate and mean in-flight
count; the points land in the CSVs; the verifier batch size comes from the gateway's /metrics
(a server without it leaves the column empty: tests/bench/test_serve_metrics.py); a request the server refuses makes the point fail with the server's message.
"""

from __future__ import annotations

import asyncio
import csv
import json

import pytest

from dspark.bench.serve_csv import open_loop_path, record_points
from dspark.bench.serve_load import LoadConfig, run_sweep
from dspark.bench.serve_prompts import BenchPrompt
from dspark.cli import main
from dspark.drafters.ngram import NgramDrafter
from dspark.engine.async_engine import AsyncEngine
from dspark.engine.speculative import SpeculativeEngine
from dspark.scheduling.policies import parse_policy
from gateway.server import embedded_gateway
from tests.conftest import make_tiny_runtime
from tests.gateway.conftest import ByteTokenizer, live_server

MODEL = "tiny-random"
MAX_TOKENS = 12
# ASCII prompts that repeat themselves, so the n-gram drafter finds continuations to propose
PROMPTS = [BenchPrompt("synthetic", d, f"{w} {w} {w} {w}") for d, w in
           [("math", "one plus one is two"), ("code", "def f(x): return x"), ("chat", "hello there, how are you")]]


@pytest.fixture(scope="module")
def url():
    """The embedded gateway over the tiny model, n-gram drafter, fixed:2 (two drafts verified per round)."""
    spec = SpeculativeEngine(make_tiny_runtime(kv_budget_tokens=8192), NgramDrafter(), num_speculative_tokens=3,
                             policy=parse_policy("fixed:2"))
    engine = AsyncEngine(spec).start()
    gateway = embedded_gateway(engine, ByteTokenizer(), model_name=MODEL, max_tokens_limit=64)
    try:
        with live_server(gateway.app) as base_url:
            yield base_url
    finally:
        gateway.close()
        engine.shutdown()


def max_in_flight(records) -> int:
    events = sorted([(r.start_s, 1) for r in records] + [(r.end_s, -1) for r in records], key=lambda e: (e[0], e[1]))
    now = peak = 0
    for _, step in events:
        now += step
        peak = max(peak, now)
    return peak


def test_a_closed_loop_point_measures_every_request_and_writes_the_csv(url, tmp_path):
    results = []

    def on_point(result):
        results.append(result)
        record_points(tmp_path / "serving.csv", [result.summary])

    config = LoadConfig(max_tokens=MAX_TOKENS, requests=6, warmup=2, progress=False)
    summaries = asyncio.run(run_sweep(url, config, PROMPTS, policy="fixed:2", temperatures=(0.0, 1.0),
                                      concurrencies=(2,), on_point=on_point))
    assert [s.temperature for s in summaries] == [0.0, 1.0]
    for result in results:
        s, records = result.summary, result.records
        warm = [r for r in records if r.warmup]
        measured = [r for r in records if not r.warmup]
        assert (len(warm), len(measured)) == (2, 6)
        assert max(r.end_s for r in warm) <= min(r.start_s for r in measured)  # warm-up done before measuring
        assert max_in_flight(measured) == 2
        assert [r.index for r in measured] == list(range(6))
        for r in measured:
            assert r.ok, r.error
            assert r.output_tokens == MAX_TOKENS  # the byte tokenizer has no EOS: every request runs to max_tokens
            assert r.start_s < r.first_token_s <= r.last_token_s <= r.end_s
            assert r.rounds >= 1 and r.draft_tokens <= 2 * r.rounds  # fixed:2 verifies at most two drafts a round
            assert r.accepted_length * r.rounds + 1 == pytest.approx(MAX_TOKENS)  # the prefill token + τ per round
        assert (s.num_requests, s.num_errors, s.concurrency) == (6, 0, 2.0)
        assert s.output_tokens == 6 * MAX_TOKENS
        assert s.throughput_tok_s == pytest.approx(s.output_tokens / s.duration_s)
        rounds = sum(r.rounds for r in measured)
        assert s.verify_tokens_per_request == pytest.approx(sum(r.draft_tokens for r in measured) / rounds)
        assert s.accepted_length == pytest.approx((6 * MAX_TOKENS - 6) / rounds)
        assert s.per_user_tok_s > 0 and s.ttft_s > 0
        assert s.verifier_batch_tokens >= 1  # read from the gateway's /metrics (dspark_verify_batch_tokens)
    assert sum(r.draft_tokens for res in results for r in res.records) > 0  # drafts were verified: not vacuous
    with open(tmp_path / "serving.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert [(r["policy"], r["temperature"], r["concurrency"]) for r in rows] == [("fixed:2", "0", "2"), ("fixed:2", "1", "2")]


def test_an_open_loop_point_records_its_rate_and_mean_in_flight(url, tmp_path):
    config = LoadConfig(max_tokens=MAX_TOKENS, requests=5, warmup=1, seed=3, progress=False)
    (s,) = asyncio.run(run_sweep(url, config, PROMPTS, policy="fixed:2", rates=(20.0,),
                                 on_point=lambda r: record_points(tmp_path / "serving.csv", [r.summary])))
    assert (s.rate_req_s, s.num_requests, s.num_errors) == (20.0, 5, 0)
    assert s.concurrency > 0
    with open(open_loop_path(tmp_path / "serving.csv"), newline="") as f:
        (row,) = csv.DictReader(f)
    assert row["rate_req_s"] == "20"


def test_a_refused_request_fails_the_point_with_the_servers_message(url):
    config = LoadConfig(max_tokens=100, requests=2, warmup=0, progress=False)  # the server allows 64
    with pytest.raises(RuntimeError, match="HTTP 400: max_tokens is 100, this server allows at most 64"):
        asyncio.run(run_sweep(url, config, PROMPTS, policy="none", concurrencies=(1,)))


def test_the_cli_loads_a_running_server_with_eval_prompts(url, tmp_path, capsys):
    csv_path = tmp_path / "serving.csv"
    code = main(["bench", "serve", "--url", url, "--policies", "fixed:2", "--concurrency", "1,2", "--temperature", "0",
                 "--max-tokens", "8", "--requests-per-point", "3", "--prompt-sets", "mbpp", "--max-prompt-chars", "150",
                 "--csv", str(csv_path), "--records-dir", str(tmp_path / "records"), "--no-progress"])
    assert code == 0, capsys.readouterr().err
    with open(csv_path, newline="") as f:
        rows = list(csv.DictReader(f))
    assert [r["concurrency"] for r in rows] == ["1", "2"]
    assert all(float(r["throughput_tok_s"]) > 0 for r in rows)
    records = [json.loads(line) for line in (tmp_path / "records" / "fixed_2.jsonl").read_text().splitlines()]
    measured = [(r["concurrency"], r["index"]) for r in records if not r["warmup"]]
    # C=1: the 3 asked for; C=2: 4, since a closed-loop point has at least 2 measured requests per client
    assert measured == [(1.0, 0), (1.0, 1), (1.0, 2), (2.0, 0), (2.0, 1), (2.0, 2), (2.0, 3)]
    assert len(records) - len(measured) == 1 + 2  # warm-up: one per client
    out = capsys.readouterr()
    assert "fixed:2 T=0 C=2" in out.out
    assert "no verifier batch size at /metrics" not in out.err  # the gateway's /metrics has it


def test_the_cli_refuses_bad_arguments_with_a_message(capsys):
    assert main(["bench", "serve", "--url", "http://127.0.0.1:1", "--policies", "none,dspark"]) == 2
    assert "exactly one" in capsys.readouterr().err
    assert main(["bench", "serve", "--policies", "fixed:x"]) == 2
    assert "fixed:K needs an integer" in capsys.readouterr().err
    assert main(["bench", "serve", "--policies", "none", "--concurrency", "0"]) == 2
    assert "--concurrency levels must be >= 1" in capsys.readouterr().err
    assert main(["bench", "plot", "--csv", "/nonexistent/serving.csv"]) == 2
    assert "no rows" in capsys.readouterr().err
