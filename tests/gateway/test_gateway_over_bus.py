"""The gateway over the bus, on both buses (in-memory and real Redis), with the tiny random model.

Specification: 32 concurrent streams all complete, each with exactly its single-request greedy
output (no token lost or duplicated); a streamed response resumes after any SSE event id
(Last-Event-ID) on another gateway replica with exactly the chunks that followed it; a client
that disconnects cancels its generation (the engine frees it); the W3C traceparent header
travels with the request; bad requests (malformed JSON, unknown model, max_tokens over the limit,
negative temperature, a prompt too long, a wrong or missing API key, a body too large, a bad
Last-Event-ID, a request the scheduler refuses) get a 4xx with OpenAI's error body; a full queue
or no scheduler gets a 503. With Redis unreachable (never there, or gone while the gateway runs),
every request that needs the bus (new, streamed, resumed) gets a 503 `bus_unavailable` with OpenAI's
error body and Retry-After within seconds, never a 500 or a hang; a stream cut mid-way ends with
that error in-band and resumes elsewhere from its last event.
"""

from __future__ import annotations

import asyncio
import functools
import json
import time
from dataclasses import dataclass

import httpx
import pytest

from dspark.bus.redis_bus import RedisBus
from dspark.bus.worker import run_worker
from dspark.drafters.ngram import NgramDrafter
from dspark.engine.async_engine import AsyncEngine
from dspark.engine.speculative import GenerationRequest, SpeculativeEngine
from dspark.sampling.params import SamplingParams
from gateway.app import create_app
from tests.bus.conftest import make_bus  # noqa: F401 - the parametrised bus fixture (memory, redis)
from tests.conftest import make_tiny_runtime
from tests.gateway.conftest import ByteTokenizer, live_server
from tests.polling import wait_until

pytestmark = pytest.mark.anyio

MODEL = "tiny-random"
MAX_TOKENS_LIMIT = 400
TOKENIZER = ByteTokenizer()
TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


@dataclass
class Stack:
    app: object  # FastAPI over the gateway's bus handle
    bus: object  # another handle on the same bus, for the test's own looks
    engine: AsyncEngine
    spec: SpeculativeEngine
    new_bus: object  # make_bus: more handles (gateway replicas)

    def replica(self, **app_kwargs):
        """Another gateway replica on the same bus (Redis: its own client)."""
        return make_app(self.new_bus(), self.engine, **app_kwargs)


def make_app(bus, engine: AsyncEngine, **kwargs):
    kwargs = {"model_name": MODEL, "max_model_len": engine.max_model_len, "vocab_size": 256,
              "max_tokens_limit": MAX_TOKENS_LIMIT, **kwargs}
    return create_app(bus, TOKENIZER, **kwargs)


@pytest.fixture
async def stack_factory(make_bus):  # noqa: F811 - the imported fixture
    stops, tasks, engines = [], [], []

    async def make(*, step_delay_s: float = 0.0, kv_budget_tokens: int = 8192, worker: bool = True,
                   bus_kwargs: dict | None = None, **app_kwargs) -> Stack:
        gateway_bus = make_bus(**(bus_kwargs or {}))
        spec = SpeculativeEngine(make_tiny_runtime(kv_budget_tokens=kv_budget_tokens), NgramDrafter(), num_speculative_tokens=3)
        if step_delay_s:
            step = spec.step

            def slow_step():
                time.sleep(step_delay_s)
                return step()

            spec.step = slow_step
        engine = AsyncEngine(spec, idle_poll_s=0.01).start()
        engines.append(engine)
        if worker:
            stop = asyncio.Event()
            stops.append(stop)
            tasks.append(asyncio.create_task(run_worker(make_bus(), engine, consumer="w", stop=stop, block_s=0.05)))
        return Stack(app=make_app(gateway_bus, engine, **app_kwargs), bus=make_bus(), engine=engine, spec=spec, new_bus=make_bus)

    yield make
    for stop in stops:
        stop.set()
    await asyncio.gather(*tasks, return_exceptions=True)
    for engine in engines:
        engine.shutdown()


def client_for(app, **kwargs) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gateway", timeout=120, **kwargs)


async def post(app, path: str, body, headers: dict | None = None) -> httpx.Response:
    async with client_for(app) as client:
        if isinstance(body, (bytes, str)):
            return await client.post(path, content=body, headers={"content-type": "application/json", **(headers or {})})
        return await client.post(path, json=body, headers=headers)


def sse_events(text: str) -> list[tuple[str | None, str]]:
    """(id or None, data) of each SSE event of a body."""
    out = []
    for block in text.split("\n\n"):
        if not block.strip():
            continue
        fields = dict(line.split(": ", 1) for line in block.splitlines())
        out.append((fields.get("id"), fields["data"]))
    return out


def streamed_text(payloads: list, kind: str) -> str:
    out = []
    for p in payloads:
        if isinstance(p, dict) and p.get("choices"):
            c = p["choices"][0]
            out.append(c["delta"].get("content") or "" if kind == "chat" else c["text"])
    return "".join(out)


@functools.cache
def reference_engine() -> SpeculativeEngine:
    return SpeculativeEngine(make_tiny_runtime(), None)  # same seeded weights as the served one, plain decoding


def reference_text(prompt_ids: list[int], max_tokens: int) -> str:
    """The greedy output of the request run alone, on the engine directly."""
    (state,) = reference_engine().generate([GenerationRequest("ref", prompt_ids, max_tokens, SamplingParams(temperature=0.0))])
    return TOKENIZER.decode(state.output_ids)


def assert_error(r: httpx.Response, status: int, *, param: str | None = None, code: str | None = None) -> dict:
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json")
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["message"]
    assert body["error"]["param"] == param
    if code is not None:
        assert body["error"]["code"] == code
    return body["error"]


# ---- many streams ------------------------------------------------------------------------------


async def test_32_concurrent_streams_complete_each_with_its_single_request_output(stack_factory):
    stack = await stack_factory()
    requests = []
    for i in range(32):
        max_tokens = 12 + i % 7
        if i % 2:
            messages = [{"role": "user", "content": f"tell me about number {i}"}]
            body = {"messages": messages}
            path, kind, prompt = "/v1/chat/completions", "chat", TOKENIZER.encode_chat(messages)
        else:
            body = {"prompt": f"counting: {i}, {i + 1},"}
            path, kind, prompt = "/v1/completions", "completion", TOKENIZER.encode(body["prompt"])
        body.update(model=MODEL, max_tokens=max_tokens, temperature=0, stream=True, stream_options={"include_usage": True})
        requests.append((path, body, kind, prompt, max_tokens))

    async with client_for(stack.app) as client:
        responses = await asyncio.gather(*(client.post(path, json=body) for path, body, *_ in requests))

    for (path, body, kind, prompt, max_tokens), r in zip(requests, responses):
        assert r.status_code == 200, r.text
        assert r.text.endswith("data: [DONE]\n\n")
        events = sse_events(r.text)
        ids = [i for i, _ in events if i is not None]
        assert len(ids) == len(set(ids)) == len(events) - 1  # every chunk has its own id, [DONE] none
        payloads = [json.loads(d) for _, d in events[:-1]]
        assert payloads[-1]["usage"]["completion_tokens"] == max_tokens  # no token lost or duplicated
        assert payloads[-2]["choices"][0]["finish_reason"] == "length"
        assert streamed_text(payloads, kind) == reference_text(prompt, max_tokens)
    assert await asyncio.to_thread(wait_until, lambda: stack.spec.runtime.kv.reserved_tokens == 0, 10.0)
    assert await stack.bus.queue_depth() == 0


# ---- resuming a stream ---------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["chat", "completion", "chat with logprobs", "completion with logprobs"])
async def test_a_stream_resumes_after_any_last_event_id_on_another_replica(stack_factory, kind):
    stack = await stack_factory()
    if kind.startswith("chat"):
        path, body = "/v1/chat/completions", {"messages": [{"role": "user", "content": "go on"}]}
        if kind.endswith("logprobs"):
            body.update(logprobs=True, top_logprobs=2)
    else:
        path, body = "/v1/completions", {"prompt": "resume me:"}
        if kind.endswith("logprobs"):
            body.update(logprobs=2)
    body.update(model=MODEL, max_tokens=30, temperature=0, stream=True, stream_options={"include_usage": True})
    full = sse_events((await post(stack.app, path, body)).text)
    assert len(full) >= 5 and full[-1] == (None, "[DONE]")
    with_logprobs = [json.loads(d)["choices"][0]["logprobs"] for _, d in full[:-1] if json.loads(d)["choices"]]
    assert any(with_logprobs) == kind.endswith("logprobs")  # the replica writes them from the replayed events

    replica = stack.replica()  # the first gateway "died": the client reconnects elsewhere
    for k in sorted({0, 1, len(full) // 2, len(full) - 3, len(full) - 2}):
        resumed = await post(replica, path, body, headers={"Last-Event-ID": full[k][0]})
        assert resumed.status_code == 200, resumed.text
        assert sse_events(resumed.text) == full[k + 1:], f"resuming after event {k}"


async def test_a_stream_cut_by_a_stop_string_resumes_to_the_same_end(stack_factory):
    stack = await stack_factory()
    body = {"model": MODEL, "prompt": "abc", "max_tokens": 40, "temperature": 0}
    text = (await post(stack.app, "/v1/completions", body)).json()["choices"][0]["text"]
    stop = text[len(text) // 2:][:2]
    assert stop and text.index(stop) > 0, repr(text)
    streamed = {**body, "stream": True, "stop": [stop]}
    full = sse_events((await post(stack.app, "/v1/completions", streamed)).text)
    payloads = [json.loads(d) for _, d in full[:-1]]
    assert streamed_text(payloads, "completion") == text[: text.index(stop)]
    assert payloads[-1]["choices"][0]["finish_reason"] == "stop"
    resumed = await post(stack.replica(), "/v1/completions", streamed, headers={"Last-Event-ID": full[0][0]})
    assert sse_events(resumed.text) == full[1:]


# ---- cancellation --------------------------------------------------------------------------------


async def test_a_client_that_disconnects_cancels_its_generation(stack_factory):
    stack = await stack_factory(step_delay_s=0.02)
    app = stack.replica()  # its bus handle is used only by the server's own event loop
    body = {"model": MODEL, "prompt": "never ending", "max_tokens": MAX_TOKENS_LIMIT, "temperature": 0, "stream": True}
    with live_server(app) as url:
        async with httpx.AsyncClient(base_url=url, timeout=60) as client, client.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line.startswith("id: "):
                    rid = line[4:].split("/")[0]
                if line.startswith("data: {") and json.loads(line[6:])["choices"][0]["text"]:
                    break  # leave mid-stream
        freed = await asyncio.to_thread(
            wait_until, lambda: stack.engine.num_running == 0 and stack.spec.runtime.kv.reserved_tokens == 0, 30.0)
    assert freed
    events = [e async for e in stack.bus.tail(rid)]
    assert events[-1].finish_reason == "cancelled" and events[-1].end < MAX_TOKENS_LIMIT


# ---- request metadata ----------------------------------------------------------------------------


async def test_the_traceparent_header_travels_with_the_request(stack_factory):
    stack = await stack_factory()
    r = await post(stack.app, "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 2},
                   headers={"traceparent": TRACEPARENT})
    assert r.status_code == 200, r.text
    assert (await stack.bus.lookup(r.json()["id"])).traceparent == TRACEPARENT
    r = await post(stack.app, "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 2},
                   headers={"traceparent": "garbage"})
    assert (await stack.bus.lookup(r.json()["id"])).traceparent is None  # an invalid one is dropped (W3C)


async def test_models_and_health(stack_factory):
    stack = await stack_factory()
    async with client_for(stack.app) as client:
        assert [m["id"] for m in (await client.get("/v1/models")).json()["data"]] == [MODEL]
        health = await client.get("/health")
        assert health.status_code == 200 and health.json()["status"] == "ok" and health.json()["queue_depth"] == 0


# ---- bad requests --------------------------------------------------------------------------------

CHAT = [{"role": "user", "content": "hi"}]
BAD_REQUESTS = [
    # (name, path, body, status, param, code)
    ("malformed json", "/v1/completions", b'{"model": "tiny-random", "prompt": ', 400, None, None),
    ("unknown model", "/v1/chat/completions", {"model": "gpt-9", "messages": CHAT}, 404, "model", "model_not_found"),
    ("max_tokens beyond the limit", "/v1/completions",
     {"model": MODEL, "prompt": "hi", "max_tokens": MAX_TOKENS_LIMIT + 1}, 400, "max_tokens", None),
    ("negative temperature", "/v1/chat/completions", {"model": MODEL, "messages": CHAT, "temperature": -1}, 400, "temperature", None),
    ("prompt too long", "/v1/completions", {"model": MODEL, "prompt": "x" * 600, "stream": True}, 400, "prompt",
     "context_length_exceeded"),
    ("prompt over the prompt limit", "/v1/completions", {"model": MODEL, "prompt": "x" * 200}, 400, "prompt", "prompt_too_long"),
    ("token id out of the vocabulary", "/v1/completions", {"model": MODEL, "prompt": [1, 300]}, 400, None, None),
    ("a request the scheduler refuses (KV budget), streamed", "/v1/completions",
     {"model": MODEL, "prompt": "hi", "max_tokens": 300, "stream": True}, 400, None, None),
]


@pytest.mark.parametrize("name,path,body,status,param,code", BAD_REQUESTS, ids=[b[0] for b in BAD_REQUESTS])
async def test_bad_requests_get_a_4xx_with_the_error_body(stack_factory, name, path, body, status, param, code):
    stack = await stack_factory(kv_budget_tokens=256, max_prompt_tokens=150)
    error = assert_error(await post(stack.app, path, body), status, param=param, code=code)
    assert error["type"] == "invalid_request_error"
    assert stack.spec.runtime.kv.reserved_tokens == 0


async def test_api_keys_are_required_when_configured(stack_factory):
    stack = await stack_factory(api_keys=["sk-right"])
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
    assert_error(await post(stack.app, "/v1/completions", body), 401, code="invalid_api_key")
    assert_error(await post(stack.app, "/v1/completions", body, headers={"Authorization": "Bearer sk-wrong"}), 401,
                 code="invalid_api_key")
    assert_error(await post(stack.app, "/v1/completions", b"{not json", headers={"Authorization": "Bearer sk-wrong"}), 401,
                 code="invalid_api_key")  # refused before the body is even parsed
    ok = await post(stack.app, "/v1/completions", body, headers={"Authorization": "Bearer sk-right"})
    assert ok.status_code == 200, ok.text
    async with client_for(stack.app) as client:
        assert (await client.get("/v1/models")).status_code == 401
        assert (await client.get("/health")).status_code == 200  # probes need no key


async def test_a_body_over_the_size_limit_gets_413(stack_factory):
    stack = await stack_factory(max_body_bytes=1000)
    big = {"model": MODEL, "prompt": "x" * 2000, "max_tokens": 2}
    assert_error(await post(stack.app, "/v1/completions", big), 413, code="request_too_large")

    async def chunks():  # no content-length: the limit holds for a chunked body too
        for _ in range(4):
            yield b" " * 400

    async with client_for(stack.app) as client:
        r = await client.post("/v1/completions", content=chunks(), headers={"content-type": "application/json"})
    assert_error(r, 413, code="request_too_large")


@pytest.mark.parametrize("header,status,code", [
    ("no-slashes", 400, "invalid_last_event_id"),
    ("chatcmpl-0123/1-0/0", 400, "invalid_last_event_id"),  # a chat id on the completions endpoint
    ("cmpl-unknown/1-0/0", 404, "request_not_found"),
])
async def test_a_bad_last_event_id_is_refused(stack_factory, header, status, code):
    stack = await stack_factory()
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 2, "stream": True}
    assert_error(await post(stack.app, "/v1/completions", body, headers={"Last-Event-ID": header}), status, code=code)


async def test_resuming_needs_a_streamed_request(stack_factory):
    stack = await stack_factory()
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 4, "stream": True}
    first_id = sse_events((await post(stack.app, "/v1/completions", body)).text)[0][0]
    r = await post(stack.app, "/v1/completions", {**body, "stream": False}, headers={"Last-Event-ID": first_id})
    assert_error(r, 400, param="stream")


async def test_without_a_scheduler_requests_time_out_and_a_full_queue_is_refused(stack_factory):
    stack = await stack_factory(worker=False, accept_timeout_s=0.3, bus_kwargs={"max_queue": 1})
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
    r = await post(stack.app, "/v1/completions", body)
    assert r.status_code == 503 and r.json()["error"]["code"] == "scheduler_timeout"
    r = await post(stack.app, "/v1/completions", body)  # the first still occupies the only queue slot
    assert r.status_code == 503 and r.json()["error"]["code"] == "overloaded"
    assert r.json()["error"]["type"] == "server_error"


# ---- Redis unreachable -----------------------------------------------------------------------------

NO_REDIS_URL = "redis://127.0.0.1:1/0"  # nothing listens on port 1: every connection is refused
PROMPTLY_S = 5.0  # "within seconds": an answer, not a hang


def assert_bus_unavailable(r: httpx.Response) -> None:
    error = assert_error(r, 503, code="bus_unavailable")
    assert error["type"] == "server_error"
    assert "127.0.0.1" not in error["message"]  # Redis's address stays in the log
    assert int(r.headers["retry-after"]) >= 1


class RedisRelay:
    """A TCP relay in front of the test Redis that can be cut: what a gateway sees when Redis goes
    away under it (its open connections drop, new ones are refused)."""

    def __init__(self, target_port: int = 6379):
        self.target_port = target_port
        self.server: asyncio.Server | None = None
        self.writers: list[asyncio.StreamWriter] = []

    async def start(self) -> str:
        self.server = await asyncio.start_server(self._relay, "127.0.0.1", 0)
        return f"redis://127.0.0.1:{self.server.sockets[0].getsockname()[1]}/0"

    async def _relay(self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        redis_reader, redis_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        self.writers += [client_writer, redis_writer]

        async def pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()

        await asyncio.gather(pump(client_reader, redis_writer), pump(redis_reader, client_writer), return_exceptions=True)

    def cut(self) -> None:
        self.server.close()  # new connections: refused
        for writer in self.writers:  # open ones: reset
            writer.transport.abort()


@pytest.mark.parametrize("make_bus", ["redis"], indirect=True)
async def test_without_redis_new_streamed_and_resumed_requests_get_503_promptly(stack_factory):
    stack = await stack_factory()
    streamed = {"model": MODEL, "prompt": "hi", "max_tokens": 4, "temperature": 0, "stream": True}
    resumable_id = sse_events((await post(stack.app, "/v1/completions", streamed)).text)[0][0]  # a real event id
    no_redis = RedisBus.from_url(NO_REDIS_URL, prefix=stack.new_bus.prefix)
    gateway = make_app(no_redis, stack.engine)  # a replica whose Redis is not there
    requests = [
        ("new", "/v1/completions", {**streamed, "stream": False}, None),
        ("new chat", "/v1/chat/completions", {"model": MODEL, "messages": CHAT}, None),
        ("streamed", "/v1/chat/completions", {"model": MODEL, "messages": CHAT, "stream": True}, None),
        ("resumed", "/v1/completions", streamed, {"Last-Event-ID": resumable_id}),
    ]
    try:
        for name, path, body, headers in requests:
            started = time.monotonic()
            r = await post(gateway, path, body, headers)
            assert time.monotonic() - started < PROMPTLY_S, name
            assert_bus_unavailable(r)
        async with client_for(gateway) as client:
            assert (await client.get("/health")).status_code == 503  # and the replica leaves the Service
    finally:
        await no_redis.close()


@pytest.mark.parametrize("make_bus", ["redis"], indirect=True)
async def test_redis_lost_mid_stream_ends_the_stream_with_a_503_event_and_it_resumes_elsewhere(stack_factory):
    stack = await stack_factory(step_delay_s=0.05)
    relay = RedisRelay()
    relayed = RedisBus.from_url(await relay.start(), prefix=stack.new_bus.prefix, reconnect_timeout_s=1.0, tail_block_s=0.5)
    gateway = make_app(relayed, stack.engine)
    prompt, max_tokens = "lost and found:", 40
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    try:
        streaming = asyncio.create_task(post(gateway, "/v1/completions", body))
        assert await asyncio.to_thread(wait_until, lambda: stack.engine.num_running == 1, 20.0)
        await asyncio.sleep(0.3)  # a few rounds out
        relay.cut()
        started = time.monotonic()
        r = await asyncio.wait_for(streaming, 30)
        assert time.monotonic() - started < PROMPTLY_S + relayed.reconnect_timeout_s
        events = sse_events(r.text)
        assert events[-1] == (None, "[DONE]")
        in_band = json.loads(events[-2][1])  # the headers were out: the error is the last event
        assert in_band["error"]["code"] == "bus_unavailable" and in_band["error"]["type"] == "server_error"
        chunks = [(i, json.loads(d)) for i, d in events[:-2]]
        assert chunks, "the stream was cut before its first chunk"

        for name, headers in (("new", None), ("resumed", {"Last-Event-ID": chunks[-1][0]})):
            started = time.monotonic()
            assert_bus_unavailable(await post(gateway, "/v1/completions", body, headers))
            assert time.monotonic() - started < PROMPTLY_S, name

        # The client retries from its last event on a replica that reaches Redis: nothing lost or repeated.
        resumed = await post(stack.replica(), "/v1/completions", body, headers={"Last-Event-ID": chunks[-1][0]})
        rest = [json.loads(d) for _, d in sse_events(resumed.text)[:-1]]
        text = streamed_text([c for _, c in chunks], "completion") + streamed_text(rest, "completion")
        assert text == reference_text(TOKENIZER.encode(prompt), max_tokens)
    finally:
        relay.cut()
        await relayed.close()
