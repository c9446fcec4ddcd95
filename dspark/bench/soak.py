"""`dspark bench soak`: a bounded soak of servers started here, on loopback, to show no leak.

    dspark bench soak                                   # `dspark serve` (embedded), 8 clients, 3 minutes
    dspark bench soak --distributed --redis redis://127.0.0.1:6379/0     # `dspark up --redis`: 4 processes
    dspark bench soak --duration 20 --concurrency 4 --model DIR --drafter ngram --sps-max-batch 0

The servers listen on 127.0.0.1 only, on free ports. Once /health answers, every client sends one
warm-up request (lazy allocations are not a leak), then each server process's resident memory is
read from /proc (the start), and `concurrency` closed-loop clients send requests for `duration`
seconds, each its next one when its last one is done: chat and plain completions, streamed and
not, greedy and sampled, in turn. Every response is checked (status 200, a well-formed body or
stream that finishes); anything else is an error, counted by its reason. Memory is sampled every
few seconds (the peak, and the one nearest half-time); the end is read after the last request.
Printed: requests served, errors, error rate, tokens per second, and per process its RSS at start,
half-time and end, peak, and growth over the whole soak and over its second half (a leak keeps
growing; allocator warm-up, new batch shapes, levels off). Exit
status 1 if any request failed or a server process died, 2 on bad arguments.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

from dspark.bench.serve_process import free_port, stop_process, wait_for_health

__all__ = ["ProcessMemory", "SoakConfig", "SoakReport", "add_soak_parser", "rss_bytes", "run_soak"]

HOST = "127.0.0.1"  # loopback only
MIB = 1 << 20
PROMPTS = (
    "Name three colours of the rainbow.",
    "Write a Python function that returns the square of a number.",
    "What is 17 times 23? Think step by step.",
    "Summarise in one sentence why the sky is blue, for a child of six years old who keeps asking why.",
)


@dataclass(frozen=True)
class SoakConfig:
    duration_s: float = 180.0
    concurrency: int = 8
    max_tokens: int = 64
    request_timeout_s: float = 300.0
    sample_every_s: float = 5.0  # RSS sampling period (the peak)

    def __post_init__(self) -> None:
        if not self.duration_s > 0:
            raise ValueError(f"duration must be > 0 s, got {self.duration_s}")
        if self.concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {self.concurrency}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")


@dataclass
class ProcessMemory:
    """Resident memory of one server process over the soak, in bytes."""

    name: str
    pid: int
    start: int
    end: int = 0
    peak: int = 0
    half: int = 0  # at half-time
    alive: bool = True

    @property
    def growth(self) -> int:
        return self.end - self.start

    @property
    def second_half_growth(self) -> int:
        return self.end - self.half


@dataclass
class SoakReport:
    config: SoakConfig
    seconds: float  # of load (the measured window)
    requests: int  # finished, well-formed responses
    errors: Counter = field(default_factory=Counter)  # reason -> count
    tokens: int = 0  # completion tokens of the served requests
    processes: list[ProcessMemory] = field(default_factory=list)

    @property
    def num_errors(self) -> int:
        return sum(self.errors.values())

    @property
    def error_rate(self) -> float:
        total = self.requests + self.num_errors
        return self.num_errors / total if total else 0.0

    @property
    def ok(self) -> bool:
        return self.num_errors == 0 and self.requests > 0 and all(p.alive for p in self.processes)

    def table(self) -> str:
        lines = [
            f"soak: {self.seconds:.0f} s, {self.config.concurrency} clients, max_tokens {self.config.max_tokens}",
            (f"requests served {self.requests}, errors {self.num_errors}, error rate {self.error_rate:.2%}, "
             f"{self.requests / self.seconds:.2f} requests/s, {self.tokens / self.seconds:.1f} tokens/s"),
        ]
        lines += [f"  error {reason!r}: {n}" for reason, n in self.errors.most_common()]
        lines += ["", "| process | pid | RSS start (MiB) | half-time | end | peak | growth | growth, 2nd half |",
                  "|---|---|---|---|---|---|---|---|"]
        for p in self.processes:
            lines.append(f"| {p.name}{'' if p.alive else ' (died)'} | {p.pid} | {p.start / MIB:.1f} | {p.half / MIB:.1f} | "
                         f"{p.end / MIB:.1f} | {p.peak / MIB:.1f} | {p.growth / MIB:+.1f} ({p.growth / p.start:+.1%}) | "
                         f"{p.second_half_growth / MIB:+.1f} |")
        return "\n".join(lines)

    def to_json(self) -> str:
        return json.dumps({"config": asdict(self.config), "seconds": self.seconds, "requests": self.requests,
                           "errors": dict(self.errors), "error_rate": self.error_rate, "tokens": self.tokens,
                           "processes": [asdict(p) | {"growth": p.growth, "second_half_growth": p.second_half_growth}
                                         for p in self.processes]}, indent=2)


def rss_bytes(pid: int) -> int | None:
    """Resident set size of `pid` (Linux /proc), or None if the process is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except (FileNotFoundError, ProcessLookupError):
        return None
    return None  # a zombie has no VmRSS


# ---- the load ------------------------------------------------------------------------------------


class BadResponse(Exception):
    """A response that is not a well-formed, finished completion; the message is the reason."""


def _request(k: int, model: str, max_tokens: int) -> tuple[str, dict]:
    """Request k of a client: chat / completions, streamed or not, greedy or sampled, in turn."""
    prompt = PROMPTS[k % len(PROMPTS)]
    body = {"model": model, "max_tokens": max_tokens, "stream": (k // 2) % 2 == 0}
    body |= {"temperature": 0.0} if k % 3 else {"temperature": 1.0, "seed": k}
    if body["stream"]:
        body["stream_options"] = {"include_usage": True}
    if k % 2 == 0:
        return "/v1/chat/completions", body | {"messages": [{"role": "user", "content": prompt}]}
    return "/v1/completions", body | {"prompt": prompt}


async def _send(client: httpx.AsyncClient, path: str, body: dict) -> int:
    """Send one request; its completion tokens, or BadResponse(reason)."""
    if not body["stream"]:
        response = await client.post(path, json=body)
        if response.status_code != 200:
            raise BadResponse(f"HTTP {response.status_code}: {response.text[:200]}")
        choice = response.json()["choices"][0]
        if choice["finish_reason"] not in ("stop", "length"):
            raise BadResponse(f"finish_reason {choice['finish_reason']!r}")
        return response.json()["usage"]["completion_tokens"]
    async with client.stream("POST", path, json=body) as response:
        if response.status_code != 200:
            raise BadResponse(f"HTTP {response.status_code}: {(await response.aread())[:200]!r}")
        payloads = [line[len("data: "):] async for line in response.aiter_lines() if line.startswith("data: ")]
    if not payloads or payloads[-1] != "[DONE]":
        raise BadResponse("stream did not end with [DONE]")
    chunks = [json.loads(p) for p in payloads[:-1]]
    if errors := [c["error"] for c in chunks if "error" in c]:
        raise BadResponse(f"in-band error: {errors[0].get('message')}")
    if not any(c["choices"] and c["choices"][0].get("finish_reason") in ("stop", "length") for c in chunks):
        raise BadResponse("stream without a finish_reason")
    return chunks[-1]["usage"]["completion_tokens"]


async def _client(client: httpx.AsyncClient, model: str, config: SoakConfig, first: int, stride: int, deadline: float,
                  report: SoakReport) -> None:
    k = first
    while time.monotonic() < deadline:
        path, body = _request(k, model, config.max_tokens)
        try:
            tokens = await _send(client, path, body)  # (not `report.tokens += await ...`: the read would predate the await)
            report.tokens += tokens
            report.requests += 1
        except BadResponse as e:
            report.errors[str(e)[:120]] += 1
        except (httpx.HTTPError, json.JSONDecodeError, KeyError, IndexError, TypeError) as e:
            report.errors[f"{type(e).__name__}: {e}"[:120]] += 1
        k += stride


async def _watch_memory(processes: list[ProcessMemory], every_s: float, half_time: float, stop: asyncio.Event) -> None:
    """Sample every `every_s`: the peak, and the sample nearest `half_time` (monotonic) as `half`."""
    nearest = {p.pid: float("inf") for p in processes}
    while not stop.is_set():
        now = time.monotonic()
        for p in processes:
            rss = rss_bytes(p.pid)
            if rss is None:
                p.alive = False
                continue
            p.peak = max(p.peak, rss)
            if abs(now - half_time) < nearest[p.pid]:
                nearest[p.pid], p.half = abs(now - half_time), rss
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), every_s)


async def run_soak(url: str, pids: dict[str, int], config: SoakConfig) -> SoakReport:
    """Warm up, then load `url` for config.duration_s with config.concurrency closed-loop clients,
    watching the memory of the processes `pids` (name -> pid)."""
    limits = httpx.Limits(max_connections=config.concurrency, max_keepalive_connections=config.concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=config.request_timeout_s, limits=limits) as client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]
        try:  # one request per client; a server that fails these is broken, not leaking
            await asyncio.gather(*[_send(client, *_request(c, model, config.max_tokens)) for c in range(config.concurrency)])
        except (BadResponse, httpx.HTTPError) as e:
            raise RuntimeError(f"a warm-up request failed: {e}") from None
        processes = []
        for name, pid in pids.items():
            rss = rss_bytes(pid)
            if rss is None:
                raise RuntimeError(f"the {name} process (pid {pid}) is not running")
            processes.append(ProcessMemory(name=name, pid=pid, start=rss, peak=rss))
        report = SoakReport(config=config, seconds=0.0, requests=0, processes=processes)
        stop = asyncio.Event()
        t0 = time.monotonic()
        watcher = asyncio.create_task(_watch_memory(processes, config.sample_every_s, t0 + config.duration_s / 2, stop))
        await asyncio.gather(*[_client(client, model, config, c, config.concurrency, t0 + config.duration_s, report)
                               for c in range(config.concurrency)])
        report.seconds = time.monotonic() - t0
        stop.set()
        await watcher
    for p in processes:
        rss = rss_bytes(p.pid)
        p.alive = p.alive and rss is not None
        p.end = rss or 0
        p.peak = max(p.peak, p.end)
    return report


# ---- the servers ---------------------------------------------------------------------------------


@contextlib.contextmanager
def embedded_server(server_args: list[str], *, log_path: Path, start_timeout_s: float) -> Iterator[tuple[str, dict[str, int]]]:
    """`dspark serve` on a free loopback port; yields (url, {"serve": pid})."""
    port = free_port(HOST)
    url = f"http://{HOST}:{port}"
    cmd = [sys.executable, "-m", "dspark.cli", "serve", "--host", HOST, "--port", str(port), *server_args]
    with log_path.open("w") as log:
        process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        try:
            wait_for_health(url, process, timeout_s=start_timeout_s, log_path=log_path)
            yield url, {"serve": process.pid}
        finally:
            stop_process(process)


@contextlib.contextmanager
def distributed_servers(up_args: list[str], *, redis_url: str, log_path: Path,
                        start_timeout_s: float) -> Iterator[tuple[str, dict[str, int]]]:
    """`dspark up --redis` with every service on a free loopback port; yields (gateway url, name -> pid)."""
    env = os.environ | {"DSPARK_CONFIG": ""}  # nothing but these variables and the flags configures it
    for service in ("verifier", "drafter", "scheduler", "gateway"):
        env |= {f"DSPARK_{service.upper()}_HOST": HOST, f"DSPARK_{service.upper()}_PORT": str(free_port(HOST))}
        if service != "gateway":  # gRPC services are dialled at host:port
            env[f"DSPARK_{service.upper()}_ADDRESS"] = ""
    cmd = [sys.executable, "-m", "dspark.cli", "up", "--redis", redis_url, *up_args]
    with log_path.open("w") as log:
        process = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, stdin=subprocess.DEVNULL, env=env, text=True)
        try:
            ready = _await_ready_line(process, start_timeout_s, log_path)
            # the children share `up`'s stdout (uvicorn's access log goes there): keep the pipe drained
            threading.Thread(target=_copy_lines, args=(process.stdout, log), daemon=True).start()
            url = ready["endpoints"]["gateway"].removesuffix("/v1")
            wait_for_health(url, process, timeout_s=start_timeout_s, log_path=log_path)
            yield url, dict(ready["ready"])
        finally:
            stop_process(process, grace_s=60.0)  # SIGTERM: `up` stops its children


def _copy_lines(source, sink) -> None:
    for line in source:
        sink.write(line)


def _await_ready_line(process: subprocess.Popen, timeout_s: float, log_path: Path) -> dict:
    """The JSON line `dspark up` prints once every service answers."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        line = process.stdout.readline()
        if not line:
            raise RuntimeError(f"`dspark up` exited with code {process.wait()}; see {log_path}")
        with contextlib.suppress(json.JSONDecodeError):
            message = json.loads(line)
            if isinstance(message, dict) and "ready" in message:
                return message
    raise TimeoutError(f"`dspark up` was not ready after {timeout_s:.0f} s; see {log_path}")


# ---- the command -------------------------------------------------------------------------------


def add_soak_parser(sub) -> None:
    s = sub.add_parser("soak", help="bounded soak on loopback: requests, errors, memory of each server process",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    s.add_argument("--duration", type=float, default=180.0, help="seconds of load (default 180)")
    s.add_argument("--concurrency", type=int, default=8, help="closed-loop clients (default 8)")
    s.add_argument("--max-tokens", type=int, default=64)
    s.add_argument("--distributed", action="store_true", help="`dspark up --redis` (verifier, drafter, scheduler, gateway)")
    s.add_argument("--redis", default="redis://127.0.0.1:6379/0", help="Redis URL for --distributed")
    s.add_argument("--model", default=None, help="served model (default: the servers' default)")
    s.add_argument("--drafter", default=None, help="drafter (default: the servers' default)")
    s.add_argument("--policy", default=None, help="scheduling policy (default: the servers' default)")
    s.add_argument("--sps-max-batch", type=int, default=None, help="SPS(B) profile bound at start (0 skips it)")
    s.add_argument("--kv-budget-mb", type=int, default=None, help="KV cache memory (default: the servers' default)")
    s.add_argument("--start-timeout", type=float, default=900.0, help="seconds to wait for the servers")
    s.add_argument("--log", default=None, help="the servers' log file (default: a temporary file)")
    s.add_argument("--json", default=None, help="also write the report here as JSON")
    s.set_defaults(func=cmd_bench_soak)


def cmd_bench_soak(args) -> int:
    try:
        config = SoakConfig(duration_s=args.duration, concurrency=args.concurrency, max_tokens=args.max_tokens)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    server_args = []
    for flag, value in (("--model", args.model), ("--drafter", args.drafter), ("--policy", args.policy),
                        ("--sps-max-batch", args.sps_max_batch), ("--kv-budget-mb", args.kv_budget_mb)):
        if value is not None:
            server_args += [flag, str(value)]
    log_path = Path(args.log or tempfile.mkstemp(prefix="dspark-soak-", suffix=".log")[1])
    print(f"starting {'dspark up --redis' if args.distributed else 'dspark serve'} on {HOST} (log {log_path})",
          file=sys.stderr, flush=True)
    servers = (distributed_servers(server_args, redis_url=args.redis, log_path=log_path, start_timeout_s=args.start_timeout)
               if args.distributed else embedded_server(server_args, log_path=log_path, start_timeout_s=args.start_timeout))
    try:
        with servers as (url, pids):
            print(f"soaking {url} for {config.duration_s:g} s with {config.concurrency} clients", file=sys.stderr, flush=True)
            report = asyncio.run(run_soak(url, pids, config))
    except (RuntimeError, TimeoutError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(report.table(), flush=True)
    if args.json:
        Path(args.json).write_text(report.to_json())
    return 0 if report.ok else 1
