"""The asyncio load generator: streamed requests against the OpenAI API, one load point at a time.

    prompts = load_prompt_mix()
    config = LoadConfig(max_tokens=128, temperature=0.0, requests=64)
    summaries = asyncio.run(run_sweep("http://127.0.0.1:8000", config, prompts, policy="dspark",
                                      concurrencies=(1, 2, 4, 8), temperatures=(0.0, 1.0)))

Two load modes (docs/method.md §10: the paper measures both regimes the scheduler adapts to):
- closed loop, concurrency C: C clients, each sends its next request when its last one is done,
  so C requests are always in flight. `warmup` requests (default C, one per client) run first and
  all finish before measuring starts: the measured window begins with C fresh streams, and its
  end has a tail where fewer than C are left (keep requests >> C; duration mode has the same tail).
- open loop, rate R: requests arrive as a Poisson process (exponential gaps, seeded), each sent
  at its arrival time whatever is in flight; the first `warmup` arrivals are not counted.

A point runs either `requests` measured requests (closed loop: at least 2 per client, or a
point at C = 64 with 32 requests would never have 64 in flight) or, with `duration_s`, sends new
ones until the duration is over (in flight ones finish and count). Request k of a point sends prompt k of the
mix with seed `seed + k` (temperature 1 is seeded, so reruns and other policies sample the same
requests); warm-up requests take prompts from the end of the mix and other seeds. Every request
is `stream: true` with `stream_options.include_usage`: output tokens come from `usage`, the
speculative statistics from the `speculative` extension of the final chunk (gateway/openai_schema.py).
The server's /metrics, if any, is read after the warm-up and after the point (serve_metrics.py).
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import json
import math
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import httpx

from dspark.bench.serve_metrics import fetch_metrics, verifier_batch_tokens
from dspark.bench.serve_prompts import BenchPrompt
from dspark.bench.serve_stats import PointSummary, RequestRecord, summarize

MIN_REQUESTS_PER_CLIENT = 2  # closed loop: measured requests per point >= this x concurrency
WARMUP_SEED_OFFSET = 1 << 20  # warm-up request k uses seed + this + k: never a measured request's seed
PATHS = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}


@dataclass(frozen=True)
class LoadConfig:
    """What every request of a point asks for, and how long a point runs."""

    max_tokens: int = 128
    temperature: float = 0.0
    seed: int = 0  # request k: seed + k
    requests: int | None = 32  # measured requests per point (closed loop: >= 2 per client); or None with duration_s
    duration_s: float | None = None  # send new requests for this long (instead of a count)
    warmup: int | None = None  # warm-up requests per point; None: C (closed loop) or ceil(R) (open loop)
    endpoint: Literal["chat", "completions"] = "chat"  # chat: the server applies the chat template
    model: str | None = None  # None: the first model of GET /v1/models
    request_timeout_s: float = 900.0
    batch_metric: str | None = None  # /metrics name of the verifier batch size (None: found by name)
    progress: bool = True

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if (self.requests is None) == (self.duration_s is None):
            raise ValueError(f"give exactly one of requests (got {self.requests}) and duration_s (got {self.duration_s})")
        if self.requests is not None and self.requests < 1:
            raise ValueError(f"requests must be >= 1, got {self.requests}")
        if self.duration_s is not None and not self.duration_s > 0:
            raise ValueError(f"duration_s must be > 0, got {self.duration_s}")
        if self.warmup is not None and self.warmup < 0:
            raise ValueError(f"warmup must be >= 0, got {self.warmup}")
        if self.endpoint not in PATHS:
            raise ValueError(f"endpoint must be one of {list(PATHS)}, got {self.endpoint!r}")


@dataclass(frozen=True)
class PointResult:
    summary: PointSummary
    records: list[RequestRecord]  # warm-up ones included (flagged)


# ---- one request -------------------------------------------------------------------------------


def request_body(config: LoadConfig, model: str, prompt: str, seed: int) -> dict:
    body = {"model": model, "max_tokens": config.max_tokens, "temperature": config.temperature, "seed": seed,
            "stream": True, "stream_options": {"include_usage": True}}
    if config.endpoint == "chat":
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    return body


def _error_message(body: str) -> str:
    try:
        return str(json.loads(body)["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return body[:300]


def _chunk_text(choice: dict, endpoint: str) -> str:
    if endpoint == "chat":
        return (choice.get("delta") or {}).get("content") or ""
    return choice.get("text") or ""


async def send_request(
    client: httpx.AsyncClient, config: LoadConfig, *, model: str, prompt: BenchPrompt, index: int, warmup: bool,
    clock: Callable[[], float],
) -> RequestRecord:
    """Send one streamed request and time its chunks; failures become a record with `error`."""
    seed = config.seed + (WARMUP_SEED_OFFSET if warmup else 0) + index
    body = request_body(config, model, prompt.text, seed)
    first = last = None
    text_chunks = 0
    usage_tokens: int | None = None
    stats: dict = {}
    error = None
    start = clock()
    try:
        async with client.stream("POST", PATHS[config.endpoint], json=body) as response:
            if response.status_code != 200:
                error = f"HTTP {response.status_code}: {_error_message((await response.aread()).decode(errors='replace'))}"
            else:
                async for line in response.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    payload = line[len("data:"):].strip()
                    if payload == "[DONE]":
                        break
                    now = clock()
                    chunk = json.loads(payload)
                    if "error" in chunk:  # in-band error after the headers (OpenAI's convention)
                        error = f"stream error: {_error_message(payload)}"
                        break
                    for choice in chunk.get("choices") or []:
                        if _chunk_text(choice, config.endpoint):
                            first = now if first is None else first
                            last = now
                            text_chunks += 1
                        elif choice.get("finish_reason") and first is not None:
                            last = now  # the finish chunk closes the last round
                    if chunk.get("usage"):
                        usage_tokens = int(chunk["usage"]["completion_tokens"])
                    if chunk.get("speculative"):
                        stats = chunk["speculative"]
    except (httpx.HTTPError, httpx.StreamError, ValueError, KeyError, TypeError) as e:  # connection trouble or a malformed chunk
        error = f"{type(e).__name__}: {e}"
    end = clock()
    return RequestRecord(
        index=index, benchmark=prompt.benchmark, warmup=warmup, start_s=start, end_s=end,
        first_token_s=first, last_token_s=last,
        output_tokens=usage_tokens if usage_tokens is not None else text_chunks,
        rounds=stats.get("rounds"), draft_tokens=stats.get("draft_tokens"), accepted_tokens=stats.get("accepted_tokens"),
        accepted_length=stats.get("mean_accepted_length"), error=error,
    )


# ---- load points -------------------------------------------------------------------------------


def _progress(config: LoadConfig, desc: str):
    from tqdm import tqdm

    return tqdm(total=config.requests, desc=desc, unit="req", disable=not config.progress, leave=False)


def _prompt(prompts: Sequence[BenchPrompt], index: int, warmup: bool) -> BenchPrompt:
    return prompts[-1 - index % len(prompts)] if warmup else prompts[index % len(prompts)]


async def _closed_loop_phase(
    client: httpx.AsyncClient, config: LoadConfig, prompts: Sequence[BenchPrompt], *, model: str, concurrency: int,
    count: int | None, duration_s: float | None, warmup: bool, clock: Callable[[], float], bar=None,
) -> list[RequestRecord]:
    """`concurrency` clients sending requests back to back until `count` are sent or `duration_s` is over."""
    records: list[RequestRecord] = []
    next_index = 0
    deadline = None if duration_s is None else clock() + duration_s

    async def client_loop() -> None:
        nonlocal next_index
        while (count is None or next_index < count) and (deadline is None or clock() < deadline):
            index = next_index
            next_index += 1  # one event loop: no other client runs between the check and this
            records.append(await send_request(client, config, model=model, prompt=_prompt(prompts, index, warmup),
                                              index=index, warmup=warmup, clock=clock))
            if bar is not None:
                bar.update(1)

    await asyncio.gather(*(client_loop() for _ in range(concurrency)))
    return sorted(records, key=lambda r: r.index)


async def run_closed_loop(
    client: httpx.AsyncClient, config: LoadConfig, prompts: Sequence[BenchPrompt], *, model: str, concurrency: int,
    desc: str = "",
) -> tuple[list[RequestRecord], float | None]:
    """Warm-up, then the measured phase. Returns (records, verifier batch size from /metrics)."""
    if concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, got {concurrency}")
    origin = time.perf_counter()

    def clock() -> float:
        return time.perf_counter() - origin

    warmup = concurrency if config.warmup is None else config.warmup
    records = await _closed_loop_phase(client, config, prompts, model=model, concurrency=min(concurrency, max(warmup, 1)),
                                       count=warmup, duration_s=None, warmup=True, clock=clock) if warmup else []
    before = await fetch_metrics(client)
    with _progress(config, desc) as bar:
        count = None if config.requests is None else max(config.requests, MIN_REQUESTS_PER_CLIENT * concurrency)
        bar.total = count
        records += await _closed_loop_phase(client, config, prompts, model=model, concurrency=concurrency,
                                            count=count, duration_s=config.duration_s, warmup=False,
                                            clock=clock, bar=bar)
    after = await fetch_metrics(client)
    return records, verifier_batch_tokens(before, after, metric=config.batch_metric)


async def run_open_loop(
    client: httpx.AsyncClient, config: LoadConfig, prompts: Sequence[BenchPrompt], *, model: str, rate: float,
    desc: str = "",
) -> tuple[list[RequestRecord], float | None]:
    """Poisson arrivals at `rate` requests/s (gaps ~ Exp(rate), seeded by config.seed). Returns
    (records, verifier batch size from /metrics, warm-up arrivals included in it)."""
    if not rate > 0:
        raise ValueError(f"rate must be > 0 requests/s, got {rate}")
    origin = time.perf_counter()

    def clock() -> float:
        return time.perf_counter() - origin

    rng = random.Random(config.seed)
    warmup = max(1, math.ceil(rate)) if config.warmup is None else config.warmup
    tasks: list[asyncio.Task] = []
    before = await fetch_metrics(client)
    arrival, measured_start = 0.0, None
    with _progress(config, desc) as bar:
        for i in itertools.count():
            warm = i < warmup
            index = i if warm else i - warmup
            if not warm:
                measured_start = arrival if measured_start is None else measured_start
                if config.requests is not None and index >= config.requests:
                    break
                if config.duration_s is not None and arrival - measured_start > config.duration_s:
                    break
            delay = arrival - clock()
            if delay > 0:
                await asyncio.sleep(delay)
            task = asyncio.create_task(send_request(client, config, model=model, prompt=_prompt(prompts, index, warm),
                                                    index=index, warmup=warm, clock=clock))
            if not warm:
                task.add_done_callback(lambda _t: bar.update(1))
            tasks.append(task)
            arrival += rng.expovariate(rate)
        records = list(await asyncio.gather(*tasks))
    after = await fetch_metrics(client)
    return records, verifier_batch_tokens(before, after, metric=config.batch_metric)


async def measure_point(
    client: httpx.AsyncClient, config: LoadConfig, prompts: Sequence[BenchPrompt], *, policy: str, model: str,
    concurrency: int | None = None, rate: float | None = None,
) -> PointResult:
    """One load point: closed loop at `concurrency` or open loop at `rate` (exactly one)."""
    if (concurrency is None) == (rate is None):
        raise ValueError("give exactly one of concurrency (closed loop) and rate (open loop)")
    if not prompts:
        raise ValueError("no prompts")
    load = f"C={concurrency}" if rate is None else f"R={rate:g}/s"
    desc = f"{policy} T={config.temperature:g} {load}"
    if rate is None:
        records, batch = await run_closed_loop(client, config, prompts, model=model, concurrency=concurrency, desc=desc)
    else:
        records, batch = await run_open_loop(client, config, prompts, model=model, rate=rate, desc=desc)
    measured = [r for r in records if not r.warmup]
    if not any(r.ok for r in measured):
        raise RuntimeError(f"{desc}: every measured request failed; first error: {measured[0].error if measured else None}")
    summary = summarize(records, policy=policy, temperature=config.temperature,
                        concurrency=float(concurrency) if rate is None else None, rate_req_s=rate, verifier_batch_tokens=batch)
    return PointResult(summary, records)


# ---- a sweep -----------------------------------------------------------------------------------


def make_client(url: str, *, api_key: str | None = None, timeout_s: float = 900.0) -> httpx.AsyncClient:
    """An HTTP client for `url` with no cap on connections (an open-loop point may exceed any)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    return httpx.AsyncClient(base_url=url.rstrip("/"), headers=headers,
                             timeout=httpx.Timeout(timeout_s, connect=30.0),
                             limits=httpx.Limits(max_connections=None, max_keepalive_connections=256))


async def served_model(client: httpx.AsyncClient) -> str:
    """The id of the first model the server lists (GET /v1/models)."""
    try:
        r = await client.get("/v1/models")
        r.raise_for_status()
        return r.json()["data"][0]["id"]
    except (httpx.HTTPError, ValueError, KeyError, IndexError) as e:
        raise RuntimeError(f"cannot read the served model from {client.base_url}/v1/models: {e!r}") from None


def describe(summary: PointSummary) -> str:
    """One line per point for the console."""
    def f(x: float | None, spec: str = ".1f") -> str:
        return "-" if x is None else format(x, spec)

    load = f"C={summary.concurrency:g}" if summary.rate_req_s is None else f"R={summary.rate_req_s:g}/s (in flight {summary.concurrency:.1f})"
    return (f"{summary.policy} T={summary.temperature:g} {load}: {f(summary.throughput_tok_s)} tok/s aggregate, "
            f"{f(summary.per_user_tok_s)} tok/s/user (p50 {f(summary.p50_per_user_tok_s)}, p90 {f(summary.p90_per_user_tok_s)}), "
            f"TTFT {f(summary.ttft_s, '.2f')} s, budget {f(summary.verify_tokens_per_request, '.2f')}, "
            f"τ {f(summary.accepted_length, '.2f')}, verifier batch {f(summary.verifier_batch_tokens)}, "
            f"{summary.num_requests} requests, {summary.num_errors} errors")


def write_records(path: str | Path, result: PointResult) -> None:
    """Append a point's request records (JSON lines, the summary's key fields on each) to `path`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    s = result.summary
    with path.open("a") as f:
        for r in result.records:
            f.write(json.dumps({"policy": s.policy, "temperature": s.temperature, "concurrency": s.concurrency,
                                "rate_req_s": s.rate_req_s, **dataclasses.asdict(r)}) + "\n")


async def run_sweep(
    url_or_client: str | httpx.AsyncClient,
    config: LoadConfig,
    prompts: Sequence[BenchPrompt],
    *,
    policy: str,  # the label the server's policy is recorded under
    temperatures: Sequence[float] = (0.0,),
    concurrencies: Sequence[int] = (),
    rates: Sequence[float] = (),
    api_key: str | None = None,
    on_point: Callable[[PointResult], None] | None = None,  # called after each point (write it out)
) -> list[PointSummary]:
    """Every (temperature, load) point against one server, in order: temperatures outer, loads
    inner, closed-loop concurrencies then open-loop rates."""
    if not concurrencies and not rates:
        raise ValueError("give at least one concurrency or rate")
    own = isinstance(url_or_client, str)
    client = make_client(url_or_client, api_key=api_key, timeout_s=config.request_timeout_s) if own else url_or_client
    summaries = []
    try:
        model = config.model or await served_model(client)
        for temperature in temperatures:
            point_config = dataclasses.replace(config, temperature=temperature)
            loads = [{"concurrency": c} for c in concurrencies] + [{"rate": r} for r in rates]
            for load in loads:
                result = await measure_point(client, point_config, prompts, policy=policy, model=model, **load)
                summaries.append(result.summary)
                if on_point is not None:
                    on_point(result)
    finally:
        if own:
            await client.aclose()
    return summaries
