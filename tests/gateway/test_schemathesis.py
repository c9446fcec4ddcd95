"""The gateway's OpenAPI schema, fuzzed with schemathesis: in-process (ASGI), tiny random model.

Specification: for every request schemathesis derives from the schema the gateway publishes at
/openapi.json, on every route, valid bodies and deliberately invalid ones alike, the gateway
  * never answers 5xx;
  * answers every 4xx with OpenAI's error body `{"error": {message, type, param, code}}`;
  * answers with a status code, content type and body the schema documents;
  * rejects schema-violating data with a 4xx, and serves schema-valid data (every check of
    schemathesis runs, positive_data_acceptance too): the schema states exactly the values each
    field accepts, logprobs and top_logprobs included.
Strings the schema allows but that are not text (JSON's escaped lone surrogates, "\\ud800", which
schemathesis does not generate) get a 400 naming the field, wherever they are; so does a
temperature so small that logits / temperature overflow, while a top_p below float32's range
samples the most likely token.
What no field alone decides is outside the schema: the model's name (another is a 404, which
schemathesis accepts), and a text prompt's or chat's length in tokens against the context window
(400 context_length_exceeded). Here the window is a real model's (4,096 tokens, 8 times the tiny
model's own: a random model has no use for positions, RoPE takes any) and token-id prompts are
limited to the window minus MAX_TOKENS_LIMIT, so no request within the published ranges overflows
it: the bodies schemathesis generates are far shorter than that in tokens.

    pytest tests/gateway/test_schemathesis.py -q --hypothesis-show-statistics   # 318 cases, ~10 s idle (a minute loaded)
"""

from __future__ import annotations

import json

import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode

from dspark.bus.memory_bus import MemoryBus
from dspark.bus.worker import start_worker_thread
from dspark.drafters.ngram import NgramDrafter
from dspark.engine.async_engine import AsyncEngine
from dspark.engine.speculative import SpeculativeEngine
from gateway.app import create_app
from gateway.openai_schema import ErrorResponse
from tests.conftest import make_tiny_runtime
from tests.gateway.conftest import ByteTokenizer


class Utf8ByteTokenizer(ByteTokenizer):
    """The byte tokenizer over UTF-8 (any text encodes, as with a real byte-level BPE)."""

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))


MODEL = "tiny-random"
MAX_TOKENS_LIMIT = 8  # every generation is short: a few ms on the tiny model
EXAMPLES_PER_OPERATION = 100  # per route, valid and invalid bodies together: seconds on an idle machine

# schemathesis reads the schema when the module is collected (its fixture-based loader does not
# run on pytest 9), so the app exists at import; the engine behind its bus starts in a fixture.
BUS = MemoryBus()
MAX_MODEL_LEN = 4096
APP = create_app(BUS, Utf8ByteTokenizer(), model_name=MODEL, max_model_len=MAX_MODEL_LEN, vocab_size=ByteTokenizer.vocab_size,
                 max_tokens_limit=MAX_TOKENS_LIMIT, max_prompt_tokens=MAX_MODEL_LEN - MAX_TOKENS_LIMIT)
schema = schemathesis.openapi.from_asgi("/openapi.json", APP)
schema.config.generation.update(modes=[GenerationMode.POSITIVE, GenerationMode.NEGATIVE], max_examples=EXAMPLES_PER_OPERATION)


# OpenAI fields this server accepts only at their default values (the schema says so; a 400 otherwise)
DEFAULT_ONLY_FIELDS = ("n", "presence_penalty", "frequency_penalty", "logit_bias", "echo", "best_of", "suffix")


def steer_towards_generation(body, variant: str, stream: bool) -> None:
    """A random `model` is answered 404 and an unsupported field 400 before anything else runs, and
    an optional `stream` is rarely generated: in most cases name the served model, in some drop
    those fields too, in half of those stream, so that tokenisation, the limits, sampling and
    generation, streamed or not, are reached. In place: schemathesis re-judges whether an edited
    body is schema-valid (dropping the one invalid field makes a negative case positive)."""
    if not isinstance(body, dict) or "model" not in body or variant == "as generated":
        return
    body["model"] = MODEL
    if stream:
        body["stream"] = True
    if variant == "servable":
        for field in DEFAULT_ONLY_FIELDS:
            body.pop(field, None)


@pytest.fixture(scope="module", autouse=True)
def engine_behind_the_bus():
    """The tiny model's engine, fed from BUS by a worker thread (the embedded gateway's wiring)."""
    runtime = make_tiny_runtime(kv_budget_tokens=1 << 14, max_position_embeddings=MAX_MODEL_LEN)  # any request fits its KV
    engine = AsyncEngine(SpeculativeEngine(runtime, NgramDrafter(), num_speculative_tokens=3), idle_poll_s=0.01).start()
    worker = start_worker_thread(lambda: BUS, engine, consumer="schemathesis")
    yield engine
    worker.stop()
    engine.shutdown()


def error_body_is_openai_s(ctx, response, case) -> bool | None:
    """Every 4xx and 5xx is OpenAI's error body (validated, not merely parsed)."""
    if response.status_code >= 400:
        ErrorResponse.model_validate(response.json())
    return None


@schema.parametrize()
@schema.given(variant=st.sampled_from(["servable", "served model", "as generated"]), stream=st.booleans())
@settings(deadline=None, suppress_health_check=list(HealthCheck))
def test_gateway_conforms_to_its_openapi_schema(case, variant, stream):
    steer_towards_generation(case.body, variant, stream)
    assert case.meta is not None  # reading it re-judges the edited body (call() would take it as generated)
    response = case.call_and_validate(additional_checks=[error_body_is_openai_s])  # and every check schemathesis has
    assert response.status_code < 500, response.text


LONE_SURROGATE = "\ud800"


@pytest.mark.parametrize(("path", "fields", "param"), [
    ("/v1/completions", {"prompt": LONE_SURROGATE}, "prompt"),
    ("/v1/completions", {"prompt": ["a" + LONE_SURROGATE]}, "prompt"),
    ("/v1/completions", {"prompt": "a", "stop": ["x", LONE_SURROGATE]}, "stop"),
    ("/v1/completions", {"prompt": "a", "model": LONE_SURROGATE}, "model"),
    ("/v1/completions", {"prompt": "a", "logit_bias": {LONE_SURROGATE: "x"}}, "logit_bias."),  # the key: in the path
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": LONE_SURROGATE}]}, "messages.0.content"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text", "text": LONE_SURROGATE}]}]},
     "messages.0.content"),
])
def test_a_lone_surrogate_anywhere_is_a_400_naming_the_field(path, fields, param):
    from starlette.testclient import TestClient

    body = json.dumps({"model": MODEL, "max_tokens": 2, **fields})  # ensure_ascii: the surrogate travels as "\\ud800"
    response = TestClient(APP).post(path, content=body, headers={"content-type": "application/json"})
    assert response.status_code == 400, response.text
    error = ErrorResponse.model_validate(response.json()).error
    assert error.type == "invalid_request_error"
    assert error.param.startswith(param)


@pytest.mark.parametrize(("fields", "status"), [
    ({"temperature": 1e-300}, 400),  # logits / temperature would overflow: NaN probabilities
    ({"temperature": 1.0, "top_p": 1e-300}, 200),  # rounds to 0 in fp32: the most likely token is still kept
    ({"temperature": 1.0, "top_p": 5e-324}, 200),
])
def test_sampling_values_at_the_edge_of_float_range_are_served_or_refused_never_a_500(fields, status):
    from starlette.testclient import TestClient

    response = TestClient(APP).post("/v1/completions", json={"model": MODEL, "prompt": "abc", "max_tokens": 3, **fields})
    assert response.status_code == status, response.text
    if status == 400:
        assert "temperature" in ErrorResponse.model_validate(response.json()).error.message
    else:
        assert response.json()["usage"]["completion_tokens"] == 3
