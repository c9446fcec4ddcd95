"""The round view's server side (gateway/round_view.py) over a real uvicorn server, tiny random model.

Specification: the page and its files are served without a key, the event stream only with the
API key when keys are set, and an open stream takes no request slot of the key; a page gets a
hello, then its scheduler's announcement, then one round message per engine round, with each
token's text: the text a request got concatenates to the API's answer, and the per-request sums
of the round numbers are the request's statistics in that answer; with no page open nothing is
published (the engine's feed is unwatched), and once the last page leaves the engine stops being
watched; a page that does not read is dropped without slowing anyone; over Redis (the
distributed mode) the rounds reach the page from the scheduler's worker the same way.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import uuid

import httpx
import pytest

from dspark.bus.memory_bus import MemoryBus
from dspark.bus.redis_bus import RedisBus
from dspark.bus.worker import run_worker
from dspark.drafters.ngram import NgramDrafter
from dspark.engine.async_engine import AsyncEngine
from dspark.engine.speculative import SpeculativeEngine
from gateway.app import create_app
from gateway.rate_limit import MemoryRateLimiter, RateLimits
from gateway.round_view import RoundRelay
from gateway.server import embedded_gateway
from tests.bus.conftest import REDIS_URL, redis_reachable
from tests.conftest import make_tiny_runtime
from tests.gateway.conftest import ByteTokenizer, live_server

pytestmark = pytest.mark.anyio

MODEL = "tiny-random"
KEY = "sk-round-view-test"
PROMPT = "abcabcabcabc"  # the n-gram drafter finds matches in it


@pytest.fixture
def anyio_backend():
    return "asyncio"


@contextlib.contextmanager
def embedded(**kwargs):
    engine = AsyncEngine(SpeculativeEngine(make_tiny_runtime(), NgramDrafter(), num_speculative_tokens=3), idle_poll_s=0.01).start()
    gateway = embedded_gateway(engine, ByteTokenizer(), model_name=MODEL, bus=MemoryBus(round_watch_ttl_s=0.5), **kwargs)
    try:
        with live_server(gateway.app) as url:
            yield url, engine, gateway
    finally:
        gateway.close()
        engine.shutdown()


class Page:
    """What a page reads from /ui/events, collected by a background task."""

    def __init__(self, client: httpx.AsyncClient, headers: dict | None = None):
        self.client, self.headers = client, headers or {}
        self.messages: list[dict] = []
        self.status: int | None = None
        self.task: asyncio.Task | None = None

    async def __aenter__(self) -> Page:
        self.task = asyncio.create_task(self._read())
        await wait_until_async(lambda: self.status is not None)
        return self

    async def __aexit__(self, *exc) -> None:
        self.task.cancel()
        await asyncio.gather(self.task, return_exceptions=True)

    async def _read(self) -> None:
        async with self.client.stream("GET", "/ui/events", headers=self.headers) as response:
            self.status = response.status_code
            async for line in response.aiter_lines():
                if line.startswith("data: "):
                    self.messages.append(json.loads(line[6:]))

    def of(self, kind: str) -> list[dict]:
        return [m for m in self.messages if m["type"] == kind]


async def wait_until_async(condition, timeout: float = 20.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.02)


async def chat(client: httpx.AsyncClient, content: str, max_tokens: int, headers: dict | None = None) -> dict:
    r = await client.post("/v1/chat/completions", headers=headers, json={
        "model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens, "temperature": 0})
    assert r.status_code == 200, r.text
    return r.json()


def request_view(page: Page, request_id: str) -> dict:
    """What the page can show of one request, summed over its rounds."""
    parts = [r for m in page.of("round") for r in m["requests"] if r["request_id"] == request_id]
    decode = [r for r in parts if not r["prefill"]]
    return {
        "text": "".join(t for r in parts for t in r["emitted_text"]),
        "rounds": len(decode), "draft_tokens": sum(r["admitted"] for r in decode),
        "accepted_tokens": sum(r["accepted"] for r in decode),
        "mean_accepted_length": sum(len(r["emitted"]) for r in decode) / len(decode),
        "tokens": sum(len(r["emitted"]) for r in parts), "finish": parts[-1]["finish_reason"], "first_is_prefill": parts[0]["prefill"],
    }


async def test_the_page_is_open_and_its_events_need_the_key_but_no_request_slot():
    limiter = MemoryRateLimiter(RateLimits(requests_per_minute=0, burst=0, max_concurrent=1))
    with embedded(api_keys=(KEY,), rate_limiter=limiter) as (url, _, _):
        async with httpx.AsyncClient(base_url=url, timeout=30) as client:
            for path, kind in (("/ui", "text/html"), ("/ui/app.js", "text/javascript"), ("/ui/style.css", "text/css")):
                r = await client.get(path)
                assert r.status_code == 200 and r.headers["content-type"].startswith(kind), path
            assert "round view" in (await client.get("/ui")).text
            assert (await client.get("/ui/events")).status_code == 401
            assert (await client.get("/ui/events", headers={"Authorization": "Bearer wrong"})).status_code == 401
            auth = {"Authorization": f"Bearer {KEY}"}
            async with Page(client, auth) as page:
                assert page.status == 200
                # max_concurrent=1: the open stream must not hold the key's only slot
                answer = await chat(client, PROMPT, 4, headers=auth)
                assert answer["usage"]["completion_tokens"] == 4
                await wait_until_async(lambda: page.of("hello"))
                assert page.of("hello")[0]["model"] == MODEL


async def test_a_page_sees_every_round_and_its_sums_are_the_answers_statistics():
    with embedded() as (url, engine, _):
        feed = engine.engine.round_feed
        async with httpx.AsyncClient(base_url=url, timeout=60) as client:
            await chat(client, "warm up", 3)
            assert not feed.watched and feed.published == 0  # no page: nothing built, nothing published
            async with Page(client) as page:
                await wait_until_async(lambda: page.of("source"))  # the worker relays from now on
                assert feed.watched and page.of("source")[0]["source"] == "embedded"
                answers = await asyncio.gather(*(chat(client, PROMPT + str(i), 24) for i in range(3)))
                steps = engine.engine.counters.steps
                await wait_until_async(lambda: page.of("round") and page.of("round")[-1]["round_id"] == steps - 1)
                round_ids = [m["round_id"] for m in page.of("round")]
                assert round_ids == list(range(round_ids[0], steps))  # none missed
                for answer in answers:
                    view = request_view(page, answer["id"])
                    spec = answer["speculative"]
                    assert view["text"] == answer["choices"][0]["message"]["content"]
                    assert view["first_is_prefill"] and view["finish"] == "length" and view["tokens"] == 24
                    assert (view["rounds"], view["draft_tokens"], view["accepted_tokens"]) == (
                        spec["rounds"], spec["draft_tokens"], spec["accepted_tokens"])
                    assert view["mean_accepted_length"] == pytest.approx(spec["mean_accepted_length"])
                    assert spec["accepted_tokens"] > 0  # not vacuous: drafts were accepted
                for m in page.of("round"):
                    for r in m["requests"]:
                        assert len(r["drafted_text"]) == len(r["drafted"]) and len(r["emitted_text"]) == len(r["emitted"])
            await wait_until_async(lambda: not feed.watched, timeout=10)  # the last page left: the worker unsubscribes
            published = feed.published
            await chat(client, PROMPT, 8)
            assert feed.published == published


async def test_a_page_that_does_not_read_is_dropped_and_the_relay_stops_without_pages():
    bus = MemoryBus()
    relay = RoundRelay(bus, ByteTokenizer().decode, page_queue=4)
    slow, fast = relay.open(), relay.open()
    await wait_until_async(lambda: bus._round_watchers == 1)  # one relay, whatever the number of pages
    round_message = {"type": "round", "source": "s", "requests": [
        {"request_id": "r", "prefill": True, "drafted": [], "confidences": [], "admitted": 0, "accepted": 0,
         "emitted": [104], "finish_reason": None}]}
    for i in range(10):
        await bus.publish_rounds([json.dumps({**round_message, "round_id": i})])
        while not fast.queue.empty():
            fast.queue.get_nowait()  # the fast page reads everything
        await asyncio.sleep(0.01)
    assert slow.dropped and not fast.dropped and relay.dropped_pages == 1 and relay.pages == 1
    relay.close(fast)
    assert not relay.running
    await wait_until_async(lambda: bus._round_watchers == 0)


@pytest.mark.skipif(not redis_reachable(), reason=f"no Redis at {REDIS_URL}")
async def test_over_redis_the_schedulers_rounds_reach_the_page():
    prefix = f"dspark-test-rounds-{uuid.uuid4().hex[:12]}"
    engine = AsyncEngine(SpeculativeEngine(make_tiny_runtime(), NgramDrafter(), num_speculative_tokens=3), idle_poll_s=0.01).start()
    stop = asyncio.Event()
    worker = asyncio.create_task(run_worker(RedisBus.from_url(REDIS_URL, prefix=prefix), engine, consumer="scheduler-a",
                                            stop=stop, block_s=0.05))
    gateway_bus = RedisBus.from_url(REDIS_URL, prefix=prefix, round_watch_ttl_s=1.0)
    app = create_app(gateway_bus, ByteTokenizer(), model_name=MODEL, max_model_len=engine.max_model_len, vocab_size=256)
    try:
        with live_server(app) as url:
            async with httpx.AsyncClient(base_url=url, timeout=60) as client, Page(client) as page:
                await wait_until_async(lambda: page.of("source"))
                answer = await chat(client, PROMPT, 16)
                await wait_until_async(lambda: any(r["finish_reason"] for m in page.of("round") for r in m["requests"]))
                assert {m["source"] for m in page.of("round")} == {"scheduler-a"}
                assert request_view(page, answer["id"])["text"] == answer["choices"][0]["message"]["content"]
    finally:
        stop.set()
        await asyncio.wait_for(worker, 20)
        engine.shutdown()
        cleanup = RedisBus.from_url(REDIS_URL, prefix=prefix)  # (the gateway's client lived on the server's loop)
        await cleanup.redis.delete(*[k async for k in cleanup.redis.scan_iter(f"{prefix}:*")])
        await cleanup.close()
