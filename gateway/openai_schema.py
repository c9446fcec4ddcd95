"""The OpenAI REST API's request and response bodies, as the gateway serves them (pydantic v2).

Requests accept the fields OpenAI clients send; fields we cannot honour with a non-default
value (n > 1, echo, penalties, ...) are rejected with a 400 naming the field, and unknown fields
are ignored. The published schema states exactly the values each field accepts (ranges, enums,
lengths; the served model's limits are filled in by `with_server_limits`), so a request that
fits it is served, except where no field alone decides: a prompt of text longer in tokens than
the server takes, or prompt + max_tokens over the context window (400 context_length_exceeded).
Responses have OpenAI's exact shape plus one extension, `speculative`, on the final response or
chunk.

Log-probabilities (`logprobs`, `top_logprobs`): of each emitted token, under the TARGET model's
own distribution at its position, log_softmax of its logits BEFORE temperature, top-k and top-p
(vLLM's default), so they do not depend on the sampling settings, nor on speculation: greedy
output and its log-probabilities are the same bit for bit with and without drafts
(dspark/sampling/logprobs.py; how they meet the text: gateway/logprobs.py).
"""

from __future__ import annotations

import copy
import time
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, WithJsonSchema, field_validator, model_serializer, model_validator

from dspark.sampling.params import MIN_TEMPERATURE, SEED_RANGE  # SEED_RANGE: what torch.Generator.manual_seed accepts

MAX_CHAT_TOP_LOGPROBS = 20  # OpenAI's limits: chat top_logprobs, completions logprobs
MAX_COMPLETION_LOGPROBS = 5


def _unicode(value):
    """`value` (a string, or a list of them, ids ignored) if it is valid Unicode. JSON may escape a
    lone UTF-16 surrogate ("\\ud800"): that is not text, and no tokenizer or UTF-8 encoder takes it."""
    for text in value if isinstance(value, list) else [value]:
        if isinstance(text, str):
            try:
                text.encode("utf-8")
            except UnicodeEncodeError as e:
                raise ValueError(f"not valid Unicode: a lone surrogate \\u{ord(text[e.start]):04x} at position {e.start}") from None
    return value


# ---- requests ----------------------------------------------------------------------------


# Requests are validated strictly: JSON types as the schema says (no "5" for 5, no false for 0.0),
# which is what the published OpenAPI schema promises to reject.
REQUEST_CONFIG = ConfigDict(extra="ignore", strict=True)


def _integral(value):
    """A JSON number with no fractional part (5.0) is an integer by JSON Schema's definition, as
    the published schema promises: take it as one (in lists too, for token ids); anything else
    is left to strict validation. A `before` field validator, so the fields' ranges stay in
    their schemas."""
    if isinstance(value, list):
        return [_integral(v) for v in value]
    return int(value) if isinstance(value, float) and value.is_integer() else value


class StreamOptions(BaseModel):
    model_config = REQUEST_CONFIG
    include_usage: bool = False


# Fields whose values are a union are checked by a validator (so that an error names the field,
# not a member of the union) and publish the schema that validator enforces.
_NON_EMPTY_STRING = {"type": "string", "minLength": 1}
_TOKEN_IDS = {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1}  # bounds: with_server_limits
_PROMPT_SCHEMA = {"anyOf": [
    _NON_EMPTY_STRING,
    _TOKEN_IDS,
    {"type": "array", "items": _NON_EMPTY_STRING, "minItems": 1, "maxItems": 1},
    {"type": "array", "items": _TOKEN_IDS, "minItems": 1, "maxItems": 1},
]}
_STOP_SCHEMA = {"anyOf": [_NON_EMPTY_STRING, {"type": "array", "items": _NON_EMPTY_STRING}, {"type": "null"}]}
_TEMPERATURE_SCHEMA = {"anyOf": [{"type": "number", "minimum": 0, "maximum": 0}, {"type": "number", "minimum": MIN_TEMPERATURE},
                                 {"type": "null"}]}


class _GenerationParams(BaseModel):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model_config = REQUEST_CONFIG

    model: str
    max_tokens: int | None = Field(default=None, ge=1)  # maximum: the server's max_tokens_limit (with_server_limits)
    temperature: Annotated[float | None, WithJsonSchema(_TEMPERATURE_SCHEMA)] = Field(
        default=None, description=f"0 (greedy) or at least {MIN_TEMPERATURE:g}; default 1")
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=0)  # extension (vLLM's name); 0 = off
    seed: int | None = Field(default=None, ge=SEED_RANGE[0], le=SEED_RANGE[1])
    stop: Annotated[str | list[str] | None, WithJsonSchema(_STOP_SCHEMA)] = None
    n: int | None = Field(default=1, ge=1, le=1, description="Only 1: one choice per request")
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = Field(default=None, ge=0, le=0, description="Only 0: sampling stays exactly the target's")
    frequency_penalty: float | None = Field(default=None, ge=0, le=0, description="Only 0: sampling stays exactly the target's")
    logit_bias: dict[str, float] | None = Field(default=None, max_length=0, description="Only empty: sampling stays exactly the target's")
    user: str | None = None

    _text_is_unicode = field_validator("model", "stop")(_unicode)  # tokenised or echoed back
    _integers = field_validator("max_tokens", "top_k", "seed", "n", mode="before")(_integral)

    @field_validator("temperature")
    @classmethod
    def _greedy_or_sampled(cls, v: float | None) -> float | None:
        if v is not None and not (v == 0.0 or v >= MIN_TEMPERATURE):
            raise ValueError(f"temperature must be 0 (greedy) or >= {MIN_TEMPERATURE:g} (below it logits / temperature "
                             f"overflow), got {v}")
        return v

    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, v: str | list[str] | None) -> str | list[str] | None:
        for s in [v] if isinstance(v, str) else v or []:
            if not s:
                raise ValueError("stop strings must be non-empty")
        return v

    @property
    def stop_strings(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_GenerationParams):
    # one prompt: text or token ids (a batch of one is accepted, larger batches are not: n=1 only)
    prompt: Annotated[str | list[int] | list[str] | list[list[int]], WithJsonSchema(_PROMPT_SCHEMA)] = Field(
        description="One prompt, as text or token ids (or a batch of one)")
    echo: Literal[False] | None = Field(default=False, description="Only false")
    logprobs: int | None = Field(default=None, ge=0, le=MAX_COMPLETION_LOGPROBS, description=(
        "Log-probabilities of the emitted tokens with this many most likely alternatives each: the target model's "
        "own distribution, before temperature, top_k and top_p"))
    best_of: int | None = Field(default=None, ge=1, le=1, description="Only 1 (it must equal n)")
    suffix: str | None = Field(default=None, max_length=0, description="Only empty")

    _prompt_is_unicode = field_validator("prompt")(_unicode)
    _integers = field_validator("max_tokens", "top_k", "seed", "n", "logprobs", "best_of", "prompt", mode="before")(_integral)

    @field_validator("prompt")
    @classmethod
    def _single_prompt(cls, v):
        if isinstance(v, list) and v and isinstance(v[0], (str, list)):
            if len(v) != 1:
                raise ValueError(f"only one prompt per request is supported, got a batch of {len(v)}")
            return v[0]
        return v

    @field_validator("prompt")
    @classmethod
    def _non_empty_prompt(cls, v):
        if not v:  # after _single_prompt: "", [], or a batch of one of them
            raise ValueError("the prompt is empty; at least one token is needed")
        if isinstance(v, list) and any(t < 0 for t in v):
            raise ValueError(f"prompt token ids must be >= 0, got {[t for t in v if t < 0][:5]}")
        return v


class TextPart(BaseModel):
    model_config = REQUEST_CONFIG
    type: Literal["text"]
    text: str

    _text_is_unicode = field_validator("text")(_unicode)


class ChatMessage(BaseModel):
    model_config = REQUEST_CONFIG
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    _content_is_unicode = field_validator("content")(_unicode)

    @property
    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""


class ChatCompletionRequest(_GenerationParams):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)  # the newer name of max_tokens (max_tokens wins)
    logprobs: bool | None = Field(default=False, description=(
        "Return the log-probabilities of the emitted tokens: the target model's own distribution, before "
        "temperature, top_k and top_p"))
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_CHAT_TOP_LOGPROBS, description=(
        "Most likely alternatives per token, with logprobs: true (ignored without it)"))

    _integers = field_validator("max_tokens", "top_k", "seed", "n", "max_completion_tokens", "top_logprobs", mode="before")(_integral)

    @model_validator(mode="after")
    def _one_max_tokens(self) -> ChatCompletionRequest:
        if self.max_tokens is None:
            self.max_tokens = self.max_completion_tokens
        return self


# ---- responses ---------------------------------------------------------------------------


def now() -> int:
    return int(time.time())


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class SpeculativeStats(BaseModel):
    """Extension: how speculative decoding went for this request."""

    rounds: int
    mean_accepted_length: float
    draft_tokens: int
    accepted_tokens: int


class _WithSpeculativeStats(BaseModel):
    """A response object whose `speculative` extension is omitted (not null) when absent."""

    speculative: SpeculativeStats | None = None

    # (no return annotation: pydantic then documents the model's own fields, not `object`)
    @model_serializer(mode="wrap")
    def _drop_missing_extension(self, handler):
        out = handler(self)
        if out.get("speculative") is None:
            out.pop("speculative", None)
        return out


class TopLogprob(BaseModel):
    token: str  # the token's text, or "bytes:\\xe2\\x80" for part of a character; a special token's name
    logprob: float  # -9999.0 for a token the model rules out
    bytes: list[int] | None  # its UTF-8 bytes; null for a special token (not part of the text)


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]  # [top_logprobs] most likely first


class ChatChoiceLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None
    refusal: None = None


class CompletionLogprobs(BaseModel):
    """Parallel lists, one entry per emitted token."""

    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]  # the `logprobs` most likely tokens, and the emitted one
    text_offset: list[int]  # characters of the completion text before each token


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: Literal["stop", "length"] | None = None


class CompletionResponse(_WithSpeculativeStats):
    """Both the non-streamed response and each streamed chunk of /v1/completions."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=now)
    model: str
    system_fingerprint: str | None = None
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ChatMessageOut(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str
    refusal: None = None


class ChatChoice(BaseModel):
    index: int = 0
    message: ChatMessageOut
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: Literal["stop", "length"]


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=now)
    model: str
    system_fingerprint: str | None = None
    choices: list[ChatChoice]
    usage: Usage
    speculative: SpeculativeStats


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None

    @model_serializer(mode="wrap")
    def _drop_none(self, handler):  # unannotated: see _WithSpeculativeStats
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: ChatDelta
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: Literal["stop", "length"] | None = None


class ChatCompletionChunk(_WithSpeculativeStats):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=now)
    model: str
    system_fingerprint: str | None = None
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=now)
    owned_by: str = "dspark"


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorDetail


# ---- the gateway's own endpoints and the OpenAPI description of the responses ----------------


class HealthStatus(BaseModel):
    """GET /health (readiness): "ok" with 200 or "unavailable" with 503, and the checks' details."""

    model_config = ConfigDict(extra="allow")
    status: Literal["ok", "unavailable"]


class LiveStatus(BaseModel):
    """GET /live (liveness): the process answers."""

    status: Literal["ok"]


# Every route's error statuses, so that the OpenAPI schema says what clients get (not FastAPI's 422).
ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    "4XX": {"model": ErrorResponse, "description": "The request is invalid, unauthorised, too large or names no model here"},
    "5XX": {"model": ErrorResponse, "description": "The server cannot answer now (overloaded, no scheduler, a failed generation)"},
}


COMPONENT_REF = "#/components/schemas/{model}"


def json_or_event_stream(model: type[BaseModel], chunk: type[BaseModel]) -> dict[int | str, dict[str, Any]]:
    """The 200 response of a generation route: `model` as JSON, or with `stream: true` server-sent
    events, each `data:` a `chunk` (or an error body, once the headers are out), then `[DONE]`.
    (OpenAPI 3.1: an event stream's `schema` describes one event.)"""
    payload = {"type": "string", "contentMediaType": "application/json",
               "contentSchema": {"anyOf": [{"$ref": COMPONENT_REF.format(model=m.__name__)} for m in (chunk, ErrorResponse)]}}
    event = {"type": "object", "required": ["data"], "properties": {
        "id": {"type": "string", "description": "<request id>/<event id>/<chunk>: send it as Last-Event-ID to resume"},
        "data": {"anyOf": [{"const": "[DONE]"}, payload]},
    }}
    return {200: {"model": model, "description": "The completion (JSON), or its chunks as server-sent events",
                  "content": {"text/event-stream": {"schema": event}}}}


def with_server_limits(openapi: dict[str, Any], *, max_tokens_limit: int, prompt_limit: int, vocab_size: int | None) -> dict[str, Any]:
    """`openapi` with the limits of this server in the request schemas: max_tokens (and
    max_completion_tokens) up to `max_tokens_limit`; a token-id prompt of at most `prompt_limit`
    ids, each below `vocab_size` (when the gateway knows it). A copy: the schemas' parts may be
    shared with the models' own (and other apps')."""
    openapi = copy.deepcopy(openapi)
    schemas = openapi["components"]["schemas"]
    for model, fields in (("CompletionRequest", ("max_tokens",)), ("ChatCompletionRequest", ("max_tokens", "max_completion_tokens"))):
        for name in fields:
            for branch in schemas[model]["properties"][name]["anyOf"]:
                if branch.get("type") == "integer":
                    branch["maximum"] = max_tokens_limit
        # FastAPI's OpenAPI model writes bounds as floats: 2**64 - 1 would read 2**64 (and -2**63 - 191
        # would pass for -2**63). The seed's bounds, exactly:
        for branch in schemas[model]["properties"]["seed"]["anyOf"]:
            if branch.get("type") == "integer":
                branch["minimum"], branch["maximum"] = SEED_RANGE
    for branch in schemas["CompletionRequest"]["properties"]["prompt"]["anyOf"]:
        token_ids = branch if branch["type"] == "array" and branch["items"]["type"] == "integer" else branch.get("items")
        if isinstance(token_ids, dict) and token_ids.get("items", {}).get("type") == "integer":
            token_ids["maxItems"] = prompt_limit
            if vocab_size is not None:
                token_ids["items"]["maximum"] = vocab_size - 1
    return openapi


def with_stream_chunk_schemas(openapi: dict[str, Any]) -> dict[str, Any]:
    """FastAPI's `openapi` with the stream chunks' schemas (and what they reference) added to its
    components: the event-stream responses point at them, FastAPI adds only JSON bodies' models."""
    schemas = openapi.setdefault("components", {}).setdefault("schemas", {})
    for chunk in (CompletionResponse, ChatCompletionChunk):
        schema = chunk.model_json_schema(ref_template=COMPONENT_REF, mode="serialization")
        for name, definition in {**schema.pop("$defs", {}), chunk.__name__: schema}.items():
            schemas.setdefault(name, definition)
    return openapi
