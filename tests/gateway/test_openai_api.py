"""The embedded OpenAI-compatible server: the incremental detokeniser (pure) and the REST API on
the real default model (slow, one module-scoped model), through the in-memory bus and its
worker. AsyncEngine itself: tests/engine; the bus: tests/bus; the gateway on both buses with a
tiny model: test_gateway_over_bus.py."""

from __future__ import annotations

import asyncio
import json
import random

import httpx
import pytest

from dspark.engine.async_engine import AsyncEngine
from dspark.engine.speculative import GenerationRequest, SpeculativeEngine
from dspark.model.target_runtime import TargetRuntime
from dspark.sampling.params import SamplingParams
from gateway.app import TextStream, parse_sse
from gateway.server import embedded_gateway
from tests.polling import wait_until

GREEDY = SamplingParams(temperature=0.0)


# ---- TextStream: stable text, UTF-8 hold-back, stop strings across pushes -----------------


def byte_decode(ids: list[int]) -> str:
    return bytes(ids).decode("utf-8", errors="replace")


def test_text_stream_holds_back_incomplete_utf8():
    stream = TextStream(byte_decode)
    pieces = [stream.push([b]) for b in "a日".encode()]
    assert pieces == ["a", "", "", "日"]
    assert stream.push(list("é".encode())[:1]) == ""
    assert stream.finish() == "\ufffd"  # an unfinished sequence at the very end is released as decoded


def test_text_stream_cuts_at_stop_string_split_across_pushes():
    stream = TextStream(byte_decode, ["END"])
    assert stream.push(list(b"abcE")) == "abc"  # "E" might start "END": held back
    assert stream.push(list(b"N")) == ""
    assert stream.push(list(b"Dxyz")) == "" and stream.stopped
    assert stream.text == "abc"


def test_text_stream_releases_a_false_stop_prefix():
    stream = TextStream(byte_decode, ["END"])
    assert stream.push(list(b"xEN")) == "x"
    assert stream.push(list(b"d")) == "ENd"
    assert stream.finish() == "" and not stream.stopped


@pytest.mark.parametrize("seed", range(20))
def test_text_stream_equals_one_shot_cut_for_any_split(seed):
    rng = random.Random(seed)
    alphabet = ["a", "b", " ", "é", "日", "🎉", "\n"]
    text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 40)))
    stops = [rng.choice(["b ", "日a", "ab", "🎉\n", "zz"]) for _ in range(rng.randint(0, 2))]
    data = list(text.encode())
    stream, out = TextStream(byte_decode, stops), []
    i = 0
    while i < len(data):
        k = rng.randint(1, 4)
        out.append(stream.push(data[i : i + k]))
        i += k
        if stream.stopped:
            break
    out.append(stream.finish())
    cuts = [text.find(s) for s in stops if s in text]
    assert "".join(out) == (text[: min(cuts)] if cuts else text)
    assert stream.stopped == bool(cuts)


# ---- the REST API on the real default model ------------------------------------------------

CHAT = [{"role": "user", "content": "Name three colours of the rainbow."}]
REPEAT = [{"role": "user", "content": "Repeat this line three times: the red fox jumps over the lazy dog."}]


def client_for(app) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gateway", timeout=120)


async def post(app, path: str, body) -> httpx.Response:
    async with client_for(app) as client:
        if isinstance(body, (bytes, str)):
            return await client.post(path, content=body, headers={"content-type": "application/json"})
        return await client.post(path, json=body)


def stream_text(payloads: list, key: str) -> str:
    out = []
    for p in payloads:
        if isinstance(p, dict) and p["choices"]:
            c = p["choices"][0]
            out.append(c["delta"].get("content", "") if key == "delta" else c["text"])
    return "".join(out)


def assert_usage_and_stats(body: dict) -> None:
    u = body["usage"]
    assert set(u) == {"prompt_tokens", "completion_tokens", "total_tokens"}
    assert u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"] and u["prompt_tokens"] > 0
    s = body["speculative"]
    assert set(s) == {"rounds", "mean_accepted_length", "draft_tokens", "accepted_tokens"}
    assert 0 <= s["accepted_tokens"] <= s["draft_tokens"]


@pytest.mark.slow
@pytest.mark.anyio
async def test_completion_has_openai_shape(served):
    r = await post(served.app, "/v1/completions",
                   {"model": served.model_name, "prompt": "The capital of France is", "max_tokens": 16, "temperature": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["id"].startswith("cmpl-") and body["object"] == "text_completion"
    assert isinstance(body["created"], int) and body["model"] == served.model_name
    (choice,) = body["choices"]
    assert set(choice) == {"index", "text", "logprobs", "finish_reason"}
    assert choice["index"] == 0 and choice["logprobs"] is None and choice["finish_reason"] in ("stop", "length")
    assert choice["text"].strip()
    assert_usage_and_stats(body)
    assert body["usage"]["prompt_tokens"] == len(served.tokenizer.encode("The capital of France is"))
    assert 1 <= body["usage"]["completion_tokens"] <= 16


@pytest.mark.slow
@pytest.mark.anyio
async def test_streamed_chat_ends_with_done_and_equals_the_non_streamed_text(served):
    req = {"model": served.model_name, "messages": CHAT, "max_tokens": 24, "temperature": 0}
    plain = await post(served.app, "/v1/chat/completions", req)
    assert plain.status_code == 200, plain.text
    body = plain.json()
    assert body["id"].startswith("chatcmpl-") and body["object"] == "chat.completion"
    (choice,) = body["choices"]
    assert set(choice) == {"index", "message", "logprobs", "finish_reason"}
    assert choice["message"]["role"] == "assistant" and choice["message"]["content"]
    assert_usage_and_stats(body)

    streamed = await post(served.app, "/v1/chat/completions", {**req, "stream": True})
    assert streamed.status_code == 200 and streamed.headers["content-type"].startswith("text/event-stream")
    assert streamed.text.endswith("data: [DONE]\n\n")
    payloads = parse_sse(streamed.text)
    assert payloads[-1] == "[DONE]"
    chunks = payloads[:-1]
    assert all(c["object"] == "chat.completion.chunk" and c["id"] == chunks[0]["id"] for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert stream_text(chunks, "delta") == choice["message"]["content"]
    final = chunks[-1]
    assert final["choices"][0]["finish_reason"] == choice["finish_reason"] and final["choices"][0]["delta"] == {}
    assert final["speculative"]["rounds"] == body["speculative"]["rounds"]
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])


@pytest.mark.slow
@pytest.mark.anyio
async def test_include_usage_adds_a_usage_chunk_before_done(served):
    req = {"model": served.model_name, "prompt": "Once upon a time", "max_tokens": 16, "temperature": 0}
    plain = (await post(served.app, "/v1/completions", req)).json()
    r = await post(served.app, "/v1/completions", {**req, "stream": True, "stream_options": {"include_usage": True}})
    payloads = parse_sse(r.text)
    assert payloads[-1] == "[DONE]"
    usage_chunk = payloads[-2]
    assert usage_chunk["choices"] == [] and usage_chunk["usage"] == plain["usage"]
    assert_usage_and_stats(usage_chunk)
    assert all(p["usage"] is None for p in payloads[:-2])
    assert payloads[-3]["choices"][0]["finish_reason"] == plain["choices"][0]["finish_reason"]
    assert stream_text(payloads[:-1], "text") == plain["choices"][0]["text"]


@pytest.mark.slow
@pytest.mark.anyio
async def test_greedy_api_output_is_the_same_with_ngram_none_and_the_engine_directly(served):
    req = {"model": served.model_name, "messages": REPEAT, "max_tokens": 32, "temperature": 0}
    with_ngram = (await post(served.app, "/v1/chat/completions", req)).json()

    # A second engine without a drafter; it shares the weights, not the KV cache or the thread.
    plain_engine = AsyncEngine(SpeculativeEngine(TargetRuntime(served.runtime.model, kv_budget_tokens=1024), None)).start()
    gateway = embedded_gateway(plain_engine, served.tokenizer, model_name=served.model_name, max_tokens_limit=served.max_tokens_limit)
    try:
        without = (await post(gateway.app, "/v1/chat/completions", req)).json()
    finally:
        gateway.close()
        plain_engine.shutdown()

    prompt = served.tokenizer.encode_chat(REPEAT)
    direct = SpeculativeEngine(TargetRuntime(served.runtime.model, kv_budget_tokens=1024), None)
    (state,) = direct.generate([GenerationRequest("d", prompt, 32, GREEDY, stop_token_ids=served.tokenizer.eos_token_ids)])

    text = with_ngram["choices"][0]["message"]["content"]
    assert text == without["choices"][0]["message"]["content"] == served.tokenizer.decode(state.output_ids)
    assert with_ngram["usage"] == without["usage"]
    assert with_ngram["speculative"]["draft_tokens"] > 0, "the n-gram drafter never drafted: the test would be vacuous"
    assert without["speculative"]["draft_tokens"] == 0
    assert with_ngram["speculative"]["rounds"] < without["speculative"]["rounds"]


@pytest.mark.slow
@pytest.mark.anyio
async def test_stop_strings_cut_the_text_in_plain_and_streamed_responses(served):
    req = {"model": served.model_name, "messages": CHAT, "max_tokens": 24, "temperature": 0}
    reference = (await post(served.app, "/v1/chat/completions", req)).json()["choices"][0]["message"]["content"]
    assert len(reference) >= 20, reference
    stop = reference[len(reference) // 2 :][:4]  # a (likely multi-token) string in the middle of the output
    expected = reference[: reference.index(stop)]

    plain = (await post(served.app, "/v1/chat/completions", {**req, "stop": ["never-appears", stop]})).json()
    assert plain["choices"][0]["message"]["content"] == expected
    assert plain["choices"][0]["finish_reason"] == "stop"

    streamed = parse_sse((await post(served.app, "/v1/chat/completions", {**req, "stop": stop, "stream": True})).text)
    assert stream_text(streamed[:-1], "delta") == expected
    assert streamed[-2]["choices"][0]["finish_reason"] == "stop"
    assert await asyncio.to_thread(wait_until, lambda: served.runtime.kv.reserved_tokens == 0, 10.0)


@pytest.mark.slow
@pytest.mark.anyio
async def test_logprobs_on_the_default_model_are_plain_decodings_and_their_bytes_spell_the_text(served):
    """With the real byte-level BPE: speculation (ngram) changes no logprob, and the tokens' bytes
    concatenate to the text (multi-byte characters included: "ü", "→")."""
    messages = [{"role": "user", "content": "Repeat exactly: über → naïve café, über → naïve café"}]
    req = {"model": served.model_name, "messages": messages, "max_tokens": 32, "temperature": 0, "logprobs": True, "top_logprobs": 3}
    body = (await post(served.app, "/v1/chat/completions", req)).json()
    choice = body["choices"][0]
    content = choice["logprobs"]["content"]
    assert body["speculative"]["accepted_tokens"] > 0, "no draft was accepted: the comparison would be vacuous"

    direct = SpeculativeEngine(TargetRuntime(served.runtime.model, kv_budget_tokens=1024), None)
    direct.add_request(GenerationRequest("d", served.tokenizer.encode_chat(messages), 32, GREEDY,
                                         stop_token_ids=served.tokenizer.eos_token_ids, logprobs=3))
    expected = []
    while direct.has_unfinished:
        for out in direct.step():
            expected += out.logprobs.logprobs
    assert [c["logprob"] for c in content] == expected  # the stop token (if any) included, as in usage
    assert len(content) == body["usage"]["completion_tokens"]
    text = bytes(b for c in content if c["bytes"] is not None for b in c["bytes"]).decode("utf-8")
    assert text == choice["message"]["content"]
    assert all(len(c["top_logprobs"]) == 3 and c["top_logprobs"][0]["logprob"] >= c["logprob"] for c in content)

    completion = (await post(served.app, "/v1/completions", {"model": served.model_name, "prompt": "über → naïve café, über",
                                                             "max_tokens": 16, "temperature": 0, "logprobs": 2})).json()
    lp, text = completion["choices"][0]["logprobs"], completion["choices"][0]["text"]
    assert lp["text_offset"] == sorted(lp["text_offset"]) and all(0 <= o <= len(text) for o in lp["text_offset"])
    assert all(len(top) <= 3 and token in top for token, top in zip(lp["tokens"], lp["top_logprobs"]))


def _too_long(served) -> dict:
    ctx = served.runtime.max_model_len
    return {"model": served.model_name, "prompt": [28] * (ctx - 10), "max_tokens": 32}


BAD_INPUTS = [
    # (name, path, body or body factory, status, param)
    ("malformed json", "/v1/completions", b'{"model": "x", "prompt": ', 400, None),
    ("body not an object", "/v1/chat/completions", b"[1, 2]", 400, None),
    ("missing prompt", "/v1/completions", lambda s: {"model": s.model_name}, 400, "prompt"),
    ("wrong type", "/v1/completions", lambda s: {"model": s.model_name, "prompt": "hi", "max_tokens": "many"}, 400, "max_tokens"),
    ("unknown model", "/v1/completions", {"model": "gpt-9", "prompt": "hi"}, 404, "model"),
    ("unknown model, streamed chat", "/v1/chat/completions",
     {"model": "gpt-9", "messages": CHAT, "stream": True}, 404, "model"),
    ("max_tokens over the limit", "/v1/completions",
     lambda s: {"model": s.model_name, "prompt": "hi", "max_tokens": s.max_tokens_limit + 1}, 400, "max_tokens"),
    ("zero max_tokens", "/v1/completions", lambda s: {"model": s.model_name, "prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    ("prompt + max_tokens over the context", "/v1/completions", _too_long, 400, "max_tokens"),
    ("prompt over the context, streamed", "/v1/completions",
     lambda s: {**_too_long(s), "prompt": [28] * s.runtime.max_model_len, "max_tokens": None, "stream": True}, 400, "prompt"),
    ("negative temperature", "/v1/chat/completions",
     lambda s: {"model": s.model_name, "messages": CHAT, "temperature": -0.5}, 400, "temperature"),
    ("top_p out of range", "/v1/completions", lambda s: {"model": s.model_name, "prompt": "hi", "top_p": 0}, 400, "top_p"),
    ("empty prompt", "/v1/completions", lambda s: {"model": s.model_name, "prompt": ""}, 400, "prompt"),
    ("empty token list", "/v1/completions", lambda s: {"model": s.model_name, "prompt": []}, 400, "prompt"),
    ("token id out of vocab", "/v1/completions", lambda s: {"model": s.model_name, "prompt": [1, 10**6]}, 400, None),
    ("batch of prompts", "/v1/completions", lambda s: {"model": s.model_name, "prompt": ["a", "b"]}, 400, "prompt"),
    ("no messages", "/v1/chat/completions", lambda s: {"model": s.model_name, "messages": []}, 400, "messages"),
    ("bad role", "/v1/chat/completions",
     lambda s: {"model": s.model_name, "messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages.0.role"),
    ("n = 2", "/v1/chat/completions", lambda s: {"model": s.model_name, "messages": CHAT, "n": 2}, 400, "n"),
    ("empty stop string", "/v1/completions", lambda s: {"model": s.model_name, "prompt": "hi", "stop": [""]}, 400, "stop"),
    ("too many top_logprobs", "/v1/chat/completions",
     lambda s: {"model": s.model_name, "messages": CHAT, "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs"),
    ("completion logprobs over 5", "/v1/completions", lambda s: {"model": s.model_name, "prompt": "hi", "logprobs": 6}, 400, "logprobs"),
]


@pytest.mark.slow
@pytest.mark.anyio
@pytest.mark.parametrize("name,path,body,status,param", BAD_INPUTS, ids=[b[0] for b in BAD_INPUTS])
async def test_bad_input_gets_an_openai_error_body(served, name, path, body, status, param):
    r = await post(served.app, path, body(served) if callable(body) else body)
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json")
    err = r.json()
    assert set(err) == {"error"} and set(err["error"]) == {"message", "type", "param", "code"}
    assert err["error"]["type"] == "invalid_request_error" and err["error"]["message"]
    assert err["error"]["param"] == param
    if name.startswith("unknown model"):
        assert err["error"]["code"] == "model_not_found"
    assert served.runtime.kv.reserved_tokens == 0


@pytest.mark.slow
@pytest.mark.anyio
async def test_models_health_and_unknown_routes(served):
    async with client_for(served.app) as client:
        models = (await client.get("/v1/models")).json()
        assert models["object"] == "list"
        assert [(m["id"], m["object"], m["owned_by"]) for m in models["data"]] == [(served.model_name, "model", "dspark")]
        assert (await client.get(f"/v1/models/{served.model_name}")).json()["id"] == served.model_name
        health = await client.get("/health")
        assert health.status_code == 200 and health.json()["status"] == "ok"
        missing = await client.get("/v1/embeddings")
        assert missing.status_code == 404 and set(missing.json()["error"]) == {"message", "type", "param", "code"}


@pytest.mark.slow
@pytest.mark.anyio
async def test_eight_concurrent_requests_all_complete(served):
    async def one(i: int) -> httpx.Response:
        if i % 2:
            body = {"messages": [{"role": "user", "content": f"Tell me fact number {i} about cats."}]}
            path = "/v1/chat/completions"
        else:
            body = {"prompt": f"Fact {i} about the ocean:"}
            path = "/v1/completions"
        return await post(served.app, path, {**body, "model": served.model_name, "max_tokens": 16,
                                             "temperature": 0.8, "seed": i, "stream": i % 3 == 0})

    responses = await asyncio.gather(*(one(i) for i in range(8)))
    assert [r.status_code for r in responses] == [200] * 8
    for i, r in enumerate(responses):
        if i % 3 == 0:
            assert r.text.endswith("data: [DONE]\n\n")
            assert parse_sse(r.text)[-2]["choices"][0]["finish_reason"] in ("stop", "length")
        else:
            body = r.json()
            assert body["choices"][0]["finish_reason"] in ("stop", "length")
            assert body["usage"]["completion_tokens"] <= 16
    assert await asyncio.to_thread(wait_until, lambda: served.runtime.kv.reserved_tokens == 0, 10.0)


@pytest.mark.slow
@pytest.mark.anyio
async def test_a_disconnected_stream_is_aborted_and_frees_its_kv(served, live_url):
    body = {"model": served.model_name, "prompt": "1, 2, 3, 4, 5, 6, 7, 8, 9, 10,", "max_tokens": served.max_tokens_limit,
            "temperature": 0, "stream": True}
    got_text, aborted, abort = False, [], served.engine.engine.abort

    def recording_abort(request_id):  # runs on the engine thread
        aborted.append(request_id)
        abort(request_id)

    served.engine.engine.abort = recording_abort
    async with httpx.AsyncClient(base_url=live_url, timeout=60) as client, client.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                assert chunk["choices"][0]["finish_reason"] is None  # still generating when we leave
                got_text = got_text or bool(chunk["choices"][0]["text"])
                if got_text:
                    break
    assert got_text
    try:
        # the engine thread frees the KV in the abort, and refreshes num_running after it
        freed = await asyncio.to_thread(
            wait_until, lambda: served.runtime.kv.reserved_tokens == 0 and served.engine.num_running == 0, 60.0)
    finally:
        served.engine.engine.abort = abort
    assert freed
    assert [r for r in aborted if r.startswith("cmpl-")], "the request finished by itself: nothing was cancelled"


@pytest.mark.slow
def test_the_official_openai_client_works_against_a_live_server(served, live_url):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=f"{live_url}/v1", api_key="unused", max_retries=0)
    assert [m.id for m in client.models.list()] == [served.model_name]
    chat = client.chat.completions.create(model=served.model_name, messages=CHAT, max_tokens=8, temperature=0)
    text = chat.choices[0].message.content
    assert text and chat.usage.completion_tokens <= 8 and chat.model_extra["speculative"]["rounds"] >= 0
    chunks = list(client.chat.completions.create(model=served.model_name, messages=CHAT, max_tokens=8, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert chunks[-1].usage.completion_tokens == chat.usage.completion_tokens
    completion = client.completions.create(model=served.model_name, prompt="Hello", max_tokens=4, temperature=0)
    assert completion.choices[0].finish_reason in ("stop", "length")
    scored = client.chat.completions.create(model=served.model_name, messages=CHAT, max_tokens=8, temperature=0, logprobs=True,
                                            top_logprobs=2)
    spelled = bytes(b for t in scored.choices[0].logprobs.content if t.bytes is not None for b in t.bytes).decode("utf-8")
    assert spelled == scored.choices[0].message.content == text
    assert all(len(t.top_logprobs) == 2 for t in scored.choices[0].logprobs.content)
    scored = client.completions.create(model=served.model_name, prompt="Hello", max_tokens=4, temperature=0, logprobs=1)
    assert len(scored.choices[0].logprobs.token_logprobs) == scored.usage.completion_tokens
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-9", prompt="Hello", max_tokens=4)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=served.model_name, messages=CHAT, n=2)


@pytest.mark.slow
@pytest.mark.anyio
async def test_the_distributed_gateway_over_redis_answers_like_the_embedded_one(served):
    """`dspark gateway` (tokenizer + config only, no weights) over real Redis, with a scheduler
    worker on the served engine: the greedy answer equals the embedded server's."""
    from dspark.bus.redis_bus import RedisBus
    from dspark.bus.worker import run_worker
    from gateway.cli import build_gateway_app
    from tests.bus.conftest import REDIS_URL, BusFactory, redis_reachable

    if not redis_reachable():
        pytest.skip("no Redis reachable")
    factory = BusFactory("redis")
    app = build_gateway_app(redis_url=REDIS_URL, model=served.model_name, prefix=factory.prefix,
                            max_tokens_limit=served.max_tokens_limit)
    stop = asyncio.Event()
    worker = asyncio.create_task(run_worker(RedisBus.from_url(REDIS_URL, prefix=factory.prefix), served.engine,
                                            consumer="scheduler-0", stop=stop, block_s=0.1))
    try:
        req = {"model": served.model_name, "messages": CHAT, "max_tokens": 16, "temperature": 0}
        distributed = await post(app, "/v1/chat/completions", req)
        streamed = await post(app, "/v1/chat/completions", {**req, "stream": True})
        embedded = await post(served.app, "/v1/chat/completions", req)
    finally:
        stop.set()
        await asyncio.wait_for(worker, 10)
        await app.state.bus.close()
        await factory.cleanup()
    assert distributed.status_code == 200, distributed.text
    text = distributed.json()["choices"][0]["message"]["content"]
    assert text and text == embedded.json()["choices"][0]["message"]["content"]
    assert distributed.json()["usage"] == embedded.json()["usage"]
    assert stream_text(parse_sse(streamed.text)[:-1], "delta") == text
