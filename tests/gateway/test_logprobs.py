"""`logprobs` / `top_logprobs` through the gateway (embedded: in-memory bus, tiny random model).

Specification: a completion with `logprobs: k` and a chat completion with `logprobs: true,
top_logprobs: k` answer in OpenAI's shapes (completions: parallel `tokens`, `token_logprobs`,
`top_logprobs`, `text_offset`; chat: `content[]` of {token, logprob, bytes, top_logprobs[]}), one
entry per completion token, with the target's log-probabilities exactly as the engine computes
them (greedy speculative == plain); streamed, each chunk carries the entries of its own text and
together they are the non-streamed response's; a stop string cuts the entries with the text; a
token that is only part of a character is shown as OpenAI's "bytes:\\x.." with its bytes; a
request that does not ask gets `logprobs: null`; out-of-range values are 400s naming the field.
"""

from __future__ import annotations

import json

import httpx
import pytest

from dspark.drafters.ngram import NgramDrafter
from dspark.engine.async_engine import AsyncEngine
from dspark.engine.speculative import GenerationRequest, SpeculativeEngine
from dspark.sampling.params import SamplingParams
from gateway.app import parse_sse
from gateway.openai_schema import ChatCompletionChunk, ChatCompletionResponse, CompletionResponse
from gateway.server import embedded_gateway
from tests.conftest import make_tiny_runtime
from tests.gateway.conftest import ByteTokenizer

pytestmark = pytest.mark.anyio

MODEL = "tiny-random"
CHAT = [{"role": "user", "content": "abc abc abc"}]


class Utf8BytesTokenizer(ByteTokenizer):
    """A byte-level tokenizer over UTF-8 (token id = byte): the random model's bytes are often
    not whole characters, as with a real byte-level BPE."""

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, token_ids: list[int], *, skip_special_tokens: bool = True) -> str:
        return bytes(token_ids).decode("utf-8", errors="replace")

    def token_bytes(self, token_ids: list[int]) -> list[bytes | None]:
        return [bytes([t]) for t in token_ids]


@pytest.fixture(scope="module")
def gateways():
    """Two gateways over one engine (ngram drafter, γ = 3): Latin-1 bytes and UTF-8 bytes."""
    engine = AsyncEngine(SpeculativeEngine(make_tiny_runtime(), NgramDrafter(), num_speculative_tokens=3), idle_poll_s=0.01).start()
    latin1 = embedded_gateway(engine, ByteTokenizer(), model_name=MODEL, max_tokens_limit=64)
    utf8 = embedded_gateway(engine, Utf8BytesTokenizer(), model_name=MODEL, max_tokens_limit=64)
    yield {"latin-1": latin1.app, "utf-8": utf8.app}
    latin1.close()
    utf8.close()
    engine.shutdown()


@pytest.fixture
def app(gateways):
    return gateways["latin-1"]


async def post(app, path: str, body: dict) -> httpx.Response:
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gateway", timeout=60) as client:
        return await client.post(path, json={"model": MODEL, **body})


def plain_logprobs(prompt: list[int], n: int, k: int) -> tuple[list[int], list[float], list[list[int]]]:
    """Tokens, their logprobs and top-k ids of plain greedy decoding on the engine directly (the
    same seeded weights as the served model, on its own runtime)."""
    engine = SpeculativeEngine(make_tiny_runtime(), None)
    engine.add_request(GenerationRequest("reference", prompt, n, SamplingParams(temperature=0.0), logprobs=k))
    tokens, lps, top = [], [], []
    while engine.has_unfinished:
        for out in engine.step():
            tokens += out.new_token_ids
            lps += out.logprobs.logprobs
            top += out.logprobs.top_ids
    return tokens, lps, top


def chunks(response: httpx.Response) -> list[dict]:
    assert response.status_code == 200, response.text
    payloads = parse_sse(response.text)
    assert payloads[-1] == "[DONE]"
    return [p for p in payloads[:-1] if p["choices"]]


async def test_a_completion_reports_the_engines_logprobs_in_openais_shape(app):
    body = (await post(app, "/v1/completions", {"prompt": "abcabc", "max_tokens": 12, "temperature": 0, "logprobs": 3})).json()
    CompletionResponse.model_validate(body)
    choice = body["choices"][0]
    lp = choice["logprobs"]
    assert set(lp) == {"tokens", "token_logprobs", "top_logprobs", "text_offset"}
    tokens, expected, top = plain_logprobs(list(b"abcabc"), 12, 3)
    assert choice["text"] == bytes(tokens).decode("latin-1") == "".join(lp["tokens"])
    assert lp["token_logprobs"] == expected  # the engine's floats, exactly (JSON keeps every bit of a double)
    assert lp["text_offset"] == list(range(12))
    for alternatives, ids, token, logprob in zip(lp["top_logprobs"], top, lp["tokens"], expected):
        assert list(alternatives) == [chr(t) for t in ids]  # the emitted token is the most likely (greedy)
        assert alternatives[token] == logprob and all(v <= 0 for v in alternatives.values())
    assert body["usage"]["completion_tokens"] == len(lp["tokens"])


async def test_a_chat_completion_reports_content_logprobs_with_bytes_and_alternatives(app):
    body = (await post(app, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 10, "temperature": 0, "logprobs": True,
                                                      "top_logprobs": 2})).json()
    ChatCompletionResponse.model_validate(body)
    choice = body["choices"][0]
    content = choice["logprobs"]["content"]
    assert choice["logprobs"]["refusal"] is None
    prompt = ByteTokenizer().encode_chat(CHAT)
    tokens, expected, top = plain_logprobs(prompt, 10, 2)
    assert [c["logprob"] for c in content] == expected
    assert "".join(c["token"] for c in content) == choice["message"]["content"]
    for item, ids in zip(content, top):
        assert set(item) == {"token", "logprob", "bytes", "top_logprobs"}
        assert item["bytes"] == list(item["token"].encode("utf-8"))
        assert [a["token"] for a in item["top_logprobs"]] == [chr(t) for t in ids]
        assert all(set(a) == {"token", "logprob", "bytes"} for a in item["top_logprobs"])
    # logprobs alone: each token's own log-probability, no alternatives
    alone = (await post(app, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 10, "temperature": 0, "logprobs": True})).json()
    assert [c["logprob"] for c in alone["choices"][0]["logprobs"]["content"]] == expected
    assert all(c["top_logprobs"] == [] for c in alone["choices"][0]["logprobs"]["content"])


@pytest.mark.parametrize("path,fields", [
    ("/v1/completions", {"prompt": "abcab", "logprobs": 2}),
    ("/v1/chat/completions", {"messages": CHAT, "logprobs": True, "top_logprobs": 4}),
])
@pytest.mark.parametrize("stop", [None, "cut"])
async def test_streamed_chunks_carry_the_logprobs_of_their_own_text_and_add_up_to_the_response(app, path, fields, stop):
    body = {**fields, "max_tokens": 24, "temperature": 1.0, "seed": 11}  # seeded: the same tokens every time
    whole = (await post(app, path, body)).json()
    cut = None
    if stop == "cut":  # a stop string in the middle of the text, found there first
        text = whole["choices"][0].get("text", whole["choices"][0].get("message", {}).get("content"))
        cut = next(i for i in range(3, len(text) - 2) if text.find(text[i : i + 2]) == i)
        stop = text[cut : cut + 2]
        body["stop"] = [stop]
        whole = (await post(app, path, body)).json()
    streamed = chunks(await post(app, path, {**body, "stream": True}))
    if path == "/v1/completions":
        for c in streamed:
            CompletionResponse.model_validate(c)
        parts = [c["choices"][0] for c in streamed]
        lp = whole["choices"][0]["logprobs"]
        for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
            assert [x for p in parts for x in p["logprobs"][key]] == lp[key]
        for p in parts:  # each chunk: the tokens of its text, offsets into the whole text
            assert "".join(p["logprobs"]["tokens"]) == p["text"]
        text = whole["choices"][0]["text"]
    else:
        for c in streamed:
            ChatCompletionChunk.model_validate(c)
        parts = [c["choices"][0] for c in streamed if c["choices"][0]["logprobs"] is not None]
        assert [x for p in parts for x in p["logprobs"]["content"]] == whole["choices"][0]["logprobs"]["content"]
        for p in parts:
            assert "".join(x["token"] for x in p["logprobs"]["content"]) == p["delta"]["content"]
        text = whole["choices"][0]["message"]["content"]
        lp = {"tokens": [x["token"] for x in whole["choices"][0]["logprobs"]["content"]]}
    assert "".join(lp["tokens"]) == text  # one character per token here: exactly the text's tokens
    if stop:
        assert whole["choices"][0]["finish_reason"] == "stop" and len(text) == cut
        assert whole["usage"]["completion_tokens"] > len(lp["tokens"])  # tokens past the cut are not reported
    else:
        assert len(lp["tokens"]) == whole["usage"]["completion_tokens"] == 24


async def test_a_token_that_is_part_of_a_character_shows_its_bytes(gateways):
    app = gateways["utf-8"]
    found_partial = False
    for seed in range(6):  # sampled random bytes: many are not whole UTF-8 characters
        body = {"prompt": "é€😀", "max_tokens": 32, "temperature": 1.0, "seed": seed, "logprobs": 1}
        whole = (await post(app, "/v1/completions", body)).json()
        choice = whole["choices"][0]
        lp = choice["logprobs"]
        raw = []
        for token in lp["tokens"]:
            if token.startswith("bytes:"):
                found_partial = True
                raw.append(bytes(int(h, 16) for h in token[len("bytes:"):].split("\\x")[1:]))
            else:
                raw.append(token.encode("utf-8"))
        assert b"".join(raw).decode("utf-8", errors="replace") == choice["text"]
        assert lp["text_offset"] == sorted(lp["text_offset"]) and lp["text_offset"][-1] <= len(choice["text"])
        streamed = chunks(await post(app, "/v1/completions", {**body, "stream": True}))
        assert [t for c in streamed for t in c["choices"][0]["logprobs"]["tokens"]] == lp["tokens"]
        assert [o for c in streamed for o in c["choices"][0]["logprobs"]["text_offset"]] == lp["text_offset"]
        chat = (await post(app, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 16, "temperature": 1.0, "seed": seed,
                                                          "logprobs": True})).json()
        content = chat["choices"][0]["logprobs"]["content"]
        assert bytes(b for c in content for b in c["bytes"]).decode("utf-8", errors="replace") == chat["choices"][0]["message"]["content"]
    assert found_partial


async def test_a_request_that_does_not_ask_gets_null_logprobs(app):
    completion = (await post(app, "/v1/completions", {"prompt": "abc", "max_tokens": 4})).json()
    assert completion["choices"][0]["logprobs"] is None
    chat = (await post(app, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 4, "top_logprobs": 3})).json()
    assert chat["choices"][0]["logprobs"] is None  # top_logprobs without logprobs: true is ignored
    streamed = chunks(await post(app, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 4, "stream": True}))
    assert all(c["choices"][0]["logprobs"] is None for c in streamed)


@pytest.mark.parametrize("path,fields,param", [
    ("/v1/completions", {"prompt": "a", "logprobs": 6}, "logprobs"),
    ("/v1/completions", {"prompt": "a", "logprobs": -1}, "logprobs"),
    ("/v1/chat/completions", {"messages": CHAT, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("/v1/completions", {"prompt": "a", "best_of": 2}, "best_of"),
    ("/v1/completions", {"prompt": "a", "best_of": 0}, "best_of"),
    ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 2, "max_completion_tokens": 65}, "max_completion_tokens"),
])
async def test_values_out_of_the_published_ranges_are_400s_naming_the_field(app, path, fields, param):
    r = await post(app, path, fields)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


async def test_the_published_ranges_are_the_accepted_ones(app):
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gateway") as client:
        schemas = (await client.get("/openapi.json")).json()["components"]["schemas"]
    completion, chat = schemas["CompletionRequest"]["properties"], schemas["ChatCompletionRequest"]["properties"]
    assert completion["logprobs"]["anyOf"][0] == {"type": "integer", "minimum": 0, "maximum": 5}
    assert chat["top_logprobs"]["anyOf"][0] == {"type": "integer", "minimum": 0, "maximum": 20}
    assert completion["best_of"]["anyOf"][0] == {"type": "integer", "minimum": 1, "maximum": 1}
    assert completion["max_tokens"]["anyOf"][0]["maximum"] == chat["max_completion_tokens"]["anyOf"][0]["maximum"] == 64
    for fields in ({"prompt": "a", "best_of": 1, "max_tokens": 64}, {"prompt": [1], "logprobs": 5, "max_tokens": 1}):
        assert (await post(app, "/v1/completions", fields)).status_code == 200
    r = await post(app, "/v1/chat/completions", {"messages": CHAT, "max_completion_tokens": 64, "logprobs": True, "top_logprobs": 20})
    assert r.status_code == 200, r.text
    assert len(json.loads(r.text)["choices"][0]["logprobs"]["content"][0]["top_logprobs"]) == 20
