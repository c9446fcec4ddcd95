"""The gateway's guard (gateway/guard.py) in front of the real app, bus, worker and tiny engine.

Specification: with keys configured, a missing or wrong key is 401 and a key configured by its
hash (or as plain text) is served, the probes need none; over the rate a client gets 429 with
OpenAI's `rate_limit_exceeded` body and a Retry-After header, and is served again after that
wait; buckets are per key, or per client address without keys; with one request in flight
allowed, a second is 429 while a stream runs, and the slot is free again as soon as the stream
has ended or its client has disconnected; two gateway replicas with one Redis share the limits;
a limiter whose Redis is unreachable makes requests 503, not unlimited; no key (nor its hash)
appears in the logs or the traces.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import threading
import time
import uuid

import httpx
import pytest

from dspark.bus.memory_bus import MemoryBus
from dspark.bus.worker import run_worker
from dspark.drafters.ngram import NgramDrafter
from dspark.engine.async_engine import AsyncEngine
from dspark.engine.speculative import SpeculativeEngine
from gateway.api_keys import hash_api_key
from gateway.app import create_app
from gateway.rate_limit import MemoryRateLimiter, RateLimits, RedisRateLimiter
from tests.bus.conftest import REDIS_URL, redis_reachable
from tests.conftest import make_tiny_runtime
from tests.gateway.conftest import ByteTokenizer, live_server
from tests.polling import wait_until

pytestmark = pytest.mark.anyio

MODEL = "tiny-random"
SHORT = {"model": MODEL, "prompt": "hi", "max_tokens": 2, "temperature": 0}
ENDLESS = {"model": MODEL, "prompt": "go on", "max_tokens": 400, "temperature": 0, "stream": True}


class Gateway:
    """One engine behind an in-memory bus with its worker; `app(**kwargs)` makes a gateway app
    (a replica) on that bus."""

    def __init__(self, engine: AsyncEngine, paused: threading.Event):
        self.engine, self.bus = engine, MemoryBus()
        self.paused = paused  # set: the engine takes no step (a running stream cannot end meanwhile)

    def app(self, **kwargs):
        return create_app(self.bus, ByteTokenizer(), model_name=MODEL, max_model_len=self.engine.max_model_len, vocab_size=256,
                          max_tokens_limit=400, **kwargs)


@pytest.fixture
async def gateway():
    spec = SpeculativeEngine(make_tiny_runtime(kv_budget_tokens=4096), NgramDrafter(), num_speculative_tokens=3)
    step = spec.step
    paused = threading.Event()

    def slow_step():  # ~50 steps a second: a 400-token stream runs long enough to overlap other requests
        time.sleep(0.02)
        while paused.is_set():
            time.sleep(0.005)
        return step()

    spec.step = slow_step
    engine = AsyncEngine(spec, idle_poll_s=0.01).start()
    made = Gateway(engine, paused)
    stop = asyncio.Event()
    worker = asyncio.create_task(run_worker(made.bus, engine, consumer="w", stop=stop, block_s=0.05))
    yield made
    stop.set()
    await asyncio.gather(worker, return_exceptions=True)
    engine.shutdown()


def client_for(app, *, address: str = "127.0.0.1", key: str | None = None) -> httpx.AsyncClient:
    headers = {"Authorization": f"Bearer {key}"} if key is not None else {}
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app, client=(address, 50000)), base_url="http://gateway",
                             headers=headers, timeout=60)


async def complete(app, **client_kwargs) -> httpx.Response:
    async with client_for(app, **client_kwargs) as client:
        return await client.post("/v1/completions", json=SHORT)


def assert_rate_limited(r: httpx.Response) -> dict:
    assert r.status_code == 429, r.text
    assert int(r.headers["retry-after"]) >= 1
    error = r.json()["error"]
    assert error["type"] == "rate_limit_error" and error["code"] == "rate_limit_exceeded" and error["message"]
    return error


async def first_not_limited(client: httpx.AsyncClient, url: str, timeout_s: float = 30.0) -> httpx.Response:
    """POST SHORT until the answer is not a 429 (a slot freed by another request that ended)."""
    deadline = time.monotonic() + timeout_s
    while (r := await client.post(url, json=SHORT)).status_code == 429 and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
    return r


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


# ---- API keys -------------------------------------------------------------------------------------


async def test_a_key_configured_by_its_hash_is_served_and_a_wrong_or_missing_one_is_401(gateway):
    app = gateway.app(api_keys=[hash_api_key("sk-hashed"), "sk-plain"])
    assert (await complete(app, key="sk-hashed")).status_code == 200
    assert (await complete(app, key="sk-plain")).status_code == 200
    for key in (None, "sk-wrong", hash_api_key("sk-hashed")):  # the hash itself is not a key
        r = await complete(app, key=key)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert r.headers["www-authenticate"] == "Bearer"
    async with client_for(app) as client:
        assert (await client.get("/health")).status_code == 200


# ---- the rate ------------------------------------------------------------------------------------


async def test_over_the_rate_a_client_gets_429_with_retry_after_then_is_served_again(gateway):
    clock = Clock()
    limiter = MemoryRateLimiter(RateLimits(requests_per_minute=30, burst=2), clock=clock)  # a token every 2 s
    app = gateway.app(api_keys=["sk-a", "sk-b"], rate_limiter=limiter)
    assert [(await complete(app, key="sk-a")).status_code for _ in range(2)] == [200, 200]
    error = assert_rate_limited(await complete(app, key="sk-a"))
    assert "30 requests per minute" in error["message"]
    r = await complete(app, key="sk-a")
    assert r.headers["retry-after"] == "2"
    assert (await complete(app, key="sk-b")).status_code == 200  # another key, another bucket
    clock.now += 2.0
    assert (await complete(app, key="sk-a")).status_code == 200
    assert_rate_limited(await complete(app, key="sk-a"))


async def test_without_keys_each_client_address_has_its_own_bucket(gateway):
    app = gateway.app(rate_limiter=MemoryRateLimiter(RateLimits(requests_per_minute=1), clock=Clock()))
    assert (await complete(app, address="10.0.0.1")).status_code == 200
    assert_rate_limited(await complete(app, address="10.0.0.1"))
    assert (await complete(app, address="10.0.0.2")).status_code == 200
    async with client_for(app, address="10.0.0.1") as client:
        assert (await client.get("/health")).status_code == 200  # probes are never limited


# ---- requests in flight --------------------------------------------------------------------------


async def test_a_stream_holds_its_slot_until_it_has_ended(gateway):
    app = gateway.app(api_keys=["sk-a"], rate_limiter=MemoryRateLimiter(RateLimits(max_concurrent=1)))
    with live_server(app) as url:  # a real server: the ASGI test transport would buffer the whole stream
        async with httpx.AsyncClient(base_url=url, headers={"Authorization": "Bearer sk-a"}, timeout=60) as client:
            async with client.stream("POST", "/v1/completions", json=ENDLESS) as stream:
                assert stream.status_code == 200
                lines = stream.aiter_lines()  # kept: a dropped iterator is closed, and with it the stream
                assert (await anext(lines)).startswith("id: ")
                error = assert_rate_limited(await client.post("/v1/completions", json=SHORT))  # while the stream runs
                assert "in flight" in error["message"]
                rest = [line async for line in lines]
            assert "data: [DONE]" in rest
            r = await client.post("/v1/completions", json=SHORT)  # ended: the slot is free
            assert r.status_code == 200, r.text


async def test_a_client_that_disconnects_mid_stream_frees_its_slot(gateway):
    app = gateway.app(api_keys=["sk-a"], rate_limiter=MemoryRateLimiter(RateLimits(max_concurrent=1)))
    with live_server(app) as url:
        headers = {"Authorization": "Bearer sk-a"}
        async with httpx.AsyncClient(base_url=url, headers=headers, timeout=60) as client, \
                client.stream("POST", "/v1/completions", json=ENDLESS) as stream:
            lines = stream.aiter_lines()  # kept: a dropped iterator is closed, and with it the stream
            while not ((line := await anext(lines)).startswith("data: {") and json.loads(line[6:])["choices"][0]["text"]):
                pass  # read up to the first text, then stop reading mid-stream
            gateway.paused.set()  # however fast the machine, the stream cannot finish before the check
            assert_rate_limited(await client.post("/v1/completions", json=SHORT))  # still held: the stream runs
            gateway.paused.clear()
        # the connection is closed: the gateway notices at its next chunk, cancels and releases
        async with httpx.AsyncClient(base_url=url, headers=headers, timeout=60) as client:
            r = await first_not_limited(client, f"{url}/v1/completions")
        assert r.status_code == 200, r.text
        assert await asyncio.to_thread(wait_until, lambda: gateway.engine.num_running == 0, 30.0)


# ---- Redis: replicas share the limits ------------------------------------------------------------


@contextlib.asynccontextmanager
async def redis_limiters(limits: RateLimits, n: int):
    """`n` limiters on one fresh Redis namespace, each with its own client (one per replica)."""
    import redis.asyncio as aioredis

    if not redis_reachable():
        pytest.skip(f"no Redis at {REDIS_URL}")
    prefix = f"dspark-test-{uuid.uuid4().hex[:12]}"
    limiters = [RedisRateLimiter.from_url(REDIS_URL, prefix=prefix, limits=limits) for _ in range(n)]
    try:
        yield limiters
    finally:
        for limiter in limiters:
            with contextlib.suppress(Exception):  # its connections belong to a server's (stopped) event loop
                await limiter.close()
        client = aioredis.Redis.from_url(REDIS_URL)
        keys = [k async for k in client.scan_iter(match=f"{prefix}:*")]
        if keys:
            await client.delete(*keys)
        await client.aclose()


async def test_two_gateway_replicas_share_one_limit_in_redis(gateway):
    async with redis_limiters(RateLimits(requests_per_minute=6, burst=3, max_concurrent=1), 2) as (one, two):
        headers = {"Authorization": "Bearer sk-a"}
        with live_server(gateway.app(api_keys=["sk-a"], rate_limiter=one)) as url_one, \
                live_server(gateway.app(api_keys=["sk-a"], rate_limiter=two)) as url_two:
            async with httpx.AsyncClient(headers=headers, timeout=60) as client, \
                    client.stream("POST", f"{url_one}/v1/completions", json=ENDLESS) as stream:
                assert stream.status_code == 200
                lines = stream.aiter_lines()  # kept: a dropped iterator is closed, and with it the stream
                assert (await anext(lines)).startswith("id: ")
                error = assert_rate_limited(await client.post(f"{url_two}/v1/completions", json=SHORT))
                assert "in flight" in error["message"]
            # the stream was left early: the first replica releases its slot once it notices
            async with httpx.AsyncClient(headers=headers, timeout=60) as client:
                r = await first_not_limited(client, f"{url_two}/v1/completions")
                assert r.status_code == 200, r.text
                for _ in range(100):  # the request just answered by replica two may still hold the key's one slot
                    r = await client.post(f"{url_one}/v1/completions", json=SHORT)
                    if r.status_code != 429 or "in flight" not in assert_rate_limited(r)["message"]:
                        break
                    await asyncio.sleep(0.05)
                assert r.status_code == 200, r.text
                for _ in range(100):  # a slot is released just after its response is sent: wait for the last one's
                    error = assert_rate_limited(await client.post(f"{url_two}/v1/completions", json=SHORT))
                    if "in flight" not in error["message"]:
                        break
                    await asyncio.sleep(0.05)
                assert "per minute" in error["message"]  # three tokens taken, on both replicas


async def test_a_limiter_without_its_redis_makes_requests_503_not_unlimited(gateway):
    limiter = RedisRateLimiter.from_url("redis://127.0.0.1:1/0", prefix="dspark-test", limits=RateLimits(requests_per_minute=60))
    try:
        r = await complete(gateway.app(rate_limiter=limiter))
        assert r.status_code == 503 and r.json()["error"]["code"] == "rate_limiter_unavailable"
    finally:
        await limiter.close()


# ---- secrets ------------------------------------------------------------------------------------


def span_text(spans) -> str:
    """Everything a span records: names, attributes, events, links (what an exporter sends)."""
    return "\n".join(s.to_json() for s in spans)


async def test_no_api_key_appears_in_logs_or_traces(gateway, caplog):
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from dspark.observability import tracing
    from tests.observability.conftest import in_memory_provider

    exporter = InMemorySpanExporter()
    app = gateway.app(api_keys=["sk-secret-right"], rate_limiter=MemoryRateLimiter(RateLimits(requests_per_minute=1)))
    with caplog.at_level(logging.DEBUG), tracing.use_tracer_provider(in_memory_provider(exporter)):
        assert (await complete(app, key="sk-secret-right")).status_code == 200
        assert_rate_limited(await complete(app, key="sk-secret-right"))
        assert (await complete(app, key="sk-secret-wrong")).status_code == 401
    recorded = span_text(exporter.get_finished_spans())
    assert "POST" in recorded  # the requests were traced
    for secret in ("sk-secret-right", "sk-secret-wrong", hash_api_key("sk-secret-right")):
        assert secret not in caplog.text and secret not in recorded
