"""`dspark up` under faults, end to end: real processes (verifier, ngram drafter, scheduler, gateway)
on the tiny model (float32), a private Redis with an append-only file, clients streaming greedy
completions over HTTP. Each test injects one fault while three streams are in flight.

Specification: whichever process dies, `up` starts it again and reports it, and every stream in
flight completes with exactly the tokens of plain greedy decoding (none lost, none duplicated):
- drafter killed: rounds go on without drafts; once it is back, requests are drafted again;
- verifier killed: its requests are rebuilt on the restarted verifier from prompt + output;
- scheduler killed: the restarted scheduler takes its pending requests back from Redis and goes
  on from the tokens already published; the clients' streams just continue;
- gateway killed: the clients' connections drop; they resume with Last-Event-ID on the restarted gateway;
- Redis restarted: gateway and scheduler reconnect; the streams continue.
"""

from __future__ import annotations

import asyncio
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import torch

from dspark.engine.speculative import GenerationRequest, SpeculativeEngine
from dspark.sampling.params import SamplingParams
from services.grpc_common import check_health
from tests.conftest import make_tiny_runtime
from tests.faults.redis_server import RedisServer, free_port, redis_server_binary
from tests.faults.sse_client import Streamed, stream_completion

pytestmark = pytest.mark.processes  # every test runs against one `dspark up` deployment of processes

ROOT = Path(__file__).resolve().parents[2]
PROMPTS = [[5, 6, 7, 8] * 3, [1, 2, 3] * 4, list(range(40, 56))]
MAX_TOKENS = 240
FAULT_AFTER_TOKENS = 8  # per stream: the fault hits every stream mid-way
STARTUP_S = 600  # four Python processes importing torch on a busy 2-core machine


@dataclass
class Up:
    process: subprocess.Popen
    redis: RedisServer
    base_url: str
    model: str
    pids: dict[str, int]
    ports: dict[str, int]
    reports: queue.Queue  # the JSON lines `up` prints after "ready" (one per restart)
    log_path: Path

    def kill(self, service: str) -> None:
        os.kill(self.pids[service], signal.SIGKILL)

    def wait_restarted(self, service: str, timeout: float = 120.0) -> dict:
        """`up`'s report of `service`'s restart (its pid is updated)."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                report = self.reports.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(f"`up` reported no restart of {service} within {timeout} s; log: {self.log_tail()}") from None
            if report.get("restarted") == service:
                self.pids[service] = report["pid"]
                return report

    def wait_serving(self, service: str, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            if service == "gateway":
                try:
                    if httpx.get(f"http://127.0.0.1:{self.ports['gateway']}/health", timeout=2).status_code == 200:
                        return
                except httpx.TransportError:
                    pass
            else:
                import grpc

                with grpc.insecure_channel(f"127.0.0.1:{self.ports[service]}") as channel:
                    if check_health(channel, timeout=2):
                        return
            assert time.monotonic() < deadline, f"{service} not serving after {timeout} s; log: {self.log_tail()}"
            time.sleep(0.5)

    def log_tail(self, n: int = 3000) -> str:
        return self.log_path.read_text(errors="replace")[-n:]


@pytest.fixture(scope="module")
def up(served_model_dir, tmp_path_factory):
    if redis_server_binary() is None:
        pytest.skip("redis-server is not installed")
    tmp = tmp_path_factory.mktemp("dspark-up-faults")
    redis = RedisServer(tmp / "redis", persistent=True).start()
    ports = {name: free_port() for name in ("verifier", "drafter", "scheduler", "gateway")}
    env = {**os.environ, **{f"DSPARK_{name.upper()}_PORT": str(port) for name, port in ports.items()},
           "DSPARK_OBSERVABILITY_METRICS_PORT": str(free_port())}  # the scheduler's /metrics: not the default port
    cmd = [sys.executable, "-m", "dspark.cli", "up", "--model", str(served_model_dir), "--dtype", "float32", "--drafter", "ngram",
           "--gamma", "4", "--policy", "fixed:4", "--sps-max-batch", "0", "--redis", redis.url, "--log-level", "warning"]
    log_path = tmp / "up.log"
    with open(log_path, "w") as log_file:
        process = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=log_file, text=True)
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(json.loads(line)) for line in process.stdout if line.startswith("{")],
                     daemon=True).start()
    try:
        try:
            ready = lines.get(timeout=STARTUP_S)
        except queue.Empty:
            pytest.fail(f"`dspark up` not ready after {STARTUP_S} s (exit {process.poll()}): {log_path.read_text()[-3000:]}")
        assert set(ready["ready"]) == {"verifier", "drafter", "scheduler", "gateway"}, ready
        base_url = ready["endpoints"]["gateway"]
        model = httpx.get(f"{base_url}/models", timeout=10).json()["data"][0]["id"]
        yield Up(process=process, redis=redis, base_url=base_url, model=model, pids=dict(ready["ready"]), ports=ports,
                 reports=lines, log_path=log_path)
    finally:
        process.send_signal(signal.SIGINT)
        try:
            process.wait(60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        redis.stop()


@pytest.fixture(scope="module")
def greedy() -> list[list[int]]:
    """Plain greedy decoding of PROMPTS on the same model, in this process."""
    engine = SpeculativeEngine(make_tiny_runtime(compute_dtype=torch.float32), None)
    states = engine.generate([GenerationRequest(f"p{i}", p, MAX_TOKENS, SamplingParams(temperature=0.0)) for i, p in enumerate(PROMPTS)])
    return [s.output_ids for s in states]


def stream_through(up: Up, fault: Callable[[], None]) -> tuple[list[Streamed], list[int]]:
    """Three concurrent streams; `fault()` runs (on a thread) once each has FAULT_AFTER_TOKENS
    tokens. Returns the streams and how many tokens each had when the fault hit."""

    async def main() -> tuple[list[Streamed], list[int]]:
        counts = [0] * len(PROMPTS)
        enough = asyncio.Event()

        def progress(i: int) -> Callable[[Streamed], None]:
            def on_text(s: Streamed) -> None:
                counts[i] = len(s.text)
                if min(counts) >= FAULT_AFTER_TOKENS:
                    enough.set()
            return on_text

        async with httpx.AsyncClient(timeout=httpx.Timeout(120.0, connect=5.0)) as client:
            streams = [asyncio.create_task(stream_completion(client, up.base_url, model=up.model, prompt_ids=p, max_tokens=MAX_TOKENS,
                                                             on_text=progress(i)))
                       for i, p in enumerate(PROMPTS)]
            await asyncio.wait_for(enough.wait(), 120)
            at_fault = list(counts)
            await asyncio.to_thread(fault)
            return list(await asyncio.wait_for(asyncio.gather(*streams), 300)), at_fault

    return asyncio.run(main())


def check_and_record(ledger, kind: str, streams: list[Streamed], at_fault: list[int], greedy: list[list[int]]) -> None:
    ledger.record(kind, faults=1, received=[s.token_ids for s in streams], expected=greedy)
    assert all(n < MAX_TOKENS for n in at_fault), f"a stream had finished before the fault: {at_fault}"
    for s, want in zip(streams, greedy):
        assert not s.errors and s.finish_reason == "length", (s.errors, s.finish_reason)
        assert s.token_ids == want  # nothing lost, nothing duplicated


def test_a_killed_drafter_is_restarted_and_streams_keep_plain_greedy_output(up, greedy, fault_ledger):
    streams, at_fault = stream_through(up, lambda: up.kill("drafter"))
    check_and_record(fault_ledger, "drafter killed (SIGKILL)", streams, at_fault, greedy)
    assert up.wait_restarted("drafter")["exit_status"] == -signal.SIGKILL
    up.wait_serving("drafter")

    async def drafts_again() -> bool:  # a request once the drafter is back is drafted again
        async with httpx.AsyncClient(timeout=60) as client:
            for _ in range(10):
                s = await stream_completion(client, up.base_url, model=up.model, prompt_ids=PROMPTS[0], max_tokens=MAX_TOKENS)
                assert s.token_ids == greedy[0]
                if s.speculative and s.speculative["draft_tokens"] > 0:
                    return True
                await asyncio.sleep(1.0)
        return False

    assert asyncio.run(drafts_again())


def test_a_killed_verifier_is_restarted_and_its_requests_are_rebuilt_on_it(up, greedy, fault_ledger):
    streams, at_fault = stream_through(up, lambda: up.kill("verifier"))
    check_and_record(fault_ledger, "verifier killed (SIGKILL)", streams, at_fault, greedy)
    assert up.wait_restarted("verifier")["exit_status"] == -signal.SIGKILL


def test_a_killed_scheduler_is_restarted_and_resumes_its_requests_from_redis(up, greedy, fault_ledger):
    streams, at_fault = stream_through(up, lambda: up.kill("scheduler"))
    check_and_record(fault_ledger, "scheduler killed (SIGKILL)", streams, at_fault, greedy)
    assert up.wait_restarted("scheduler")["exit_status"] == -signal.SIGKILL


def test_a_killed_gateway_is_restarted_and_clients_resume_with_last_event_id(up, greedy, fault_ledger):
    streams, at_fault = stream_through(up, lambda: up.kill("gateway"))
    check_and_record(fault_ledger, "gateway killed (SIGKILL), clients resume with Last-Event-ID", streams, at_fault, greedy)
    assert all(s.resumes >= 1 for s in streams)  # every connection dropped and was resumed
    assert up.wait_restarted("gateway")["exit_status"] == -signal.SIGKILL


def test_a_redis_restart_is_ridden_out_by_gateway_and_scheduler(up, greedy, fault_ledger):
    def restart_redis() -> None:
        up.redis.stop()  # SIGTERM: Redis syncs its append-only file and exits
        time.sleep(1.0)
        up.redis.start()

    streams, at_fault = stream_through(up, restart_redis)
    check_and_record(fault_ledger, "Redis restarted (append-only file)", streams, at_fault, greedy)
    assert up.process.poll() is None and up.reports.empty()  # nothing had to be restarted


def test_the_round_view_follows_the_scheduler_processs_rounds_over_redis(up, greedy):
    """The distributed round view: the gateway's /ui/events carries the scheduler process's rounds
    (relayed onto Redis while the page watches), token for token what the client received."""
    root = f"http://127.0.0.1:{up.ports['gateway']}"

    async def main() -> tuple[list[dict], Streamed]:
        messages: list[dict] = []

        async def watch(client: httpx.AsyncClient) -> None:
            async with client.stream("GET", f"{root}/ui/events") as response:
                assert response.status_code == 200
                async for line in response.aiter_lines():
                    if line.startswith("data: "):
                        messages.append(json.loads(line[6:]))

        async with httpx.AsyncClient(timeout=httpx.Timeout(120.0, connect=5.0)) as client:
            page = asyncio.create_task(watch(client))
            deadline = time.monotonic() + 60
            while not any(m["type"] == "source" for m in messages):  # the scheduler relays from now on
                assert time.monotonic() < deadline and not page.done(), f"no scheduler announced itself: {messages}"
                await asyncio.sleep(0.1)
            streamed = await stream_completion(client, up.base_url, model=up.model, prompt_ids=PROMPTS[1], max_tokens=32)
            while not any(r["finish_reason"] for m in messages if m["type"] == "round" for r in m["requests"]):
                assert time.monotonic() < deadline, "the request's last round did not reach the page"
                await asyncio.sleep(0.1)
            page.cancel()
            await asyncio.gather(page, return_exceptions=True)
        return messages, streamed

    messages, streamed = asyncio.run(main())
    (source,) = {m["source"] for m in messages if m["type"] == "source"}
    assert source.startswith("scheduler-")
    rounds = [m for m in messages if m["type"] == "round"]
    assert {m["source"] for m in rounds} == {source}
    mine = [r for m in rounds for r in m["requests"]]  # the only request in flight
    assert [t for r in mine for t in r["emitted"]] == streamed.token_ids == greedy[1][:32]
    assert sum(r["admitted"] for r in mine) == streamed.speculative["draft_tokens"] > 0
