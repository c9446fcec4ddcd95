"""The OpenAI REST API's request and response bodies, as the gateway serves them (pydantic v2).

Requests accept the fields OpenAI clients send; fields we cannot honour with a non-default
value (n > 1, logprobs, echo, penalties, ...) are rejected with a 400 naming the field, and
unknown fields are ignored. Responses have OpenAI's exact shape plus one extension,
`speculative`, on the final response or chunk.
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_serializer, model_validator

SEED_RANGE = (-(2**63), 2**64 - 1)  # what torch.Generator.manual_seed accepts


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


class StreamOptions(BaseModel):
    model_config = REQUEST_CONFIG
    include_usage: bool = False


class _GenerationParams(BaseModel):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model_config = REQUEST_CONFIG

    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0)  # None = 1.0, OpenAI's default
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=0)  # extension (vLLM's name); 0 = off
    seed: int | None = Field(default=None, ge=SEED_RANGE[0], le=SEED_RANGE[1])
    stop: str | list[str] | None = None
    n: int | None = 1
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None

    _text_is_unicode = field_validator("model", "stop")(_unicode)  # tokenised or echoed back

    @field_validator("n")
    @classmethod
    def _only_one_choice(cls, v: int | None) -> int | None:
        if v is not None and v != 1:
            raise ValueError(f"only n=1 is supported, got n={v}")
        return v

    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, v: str | list[str] | None) -> str | list[str] | None:
        for s in [v] if isinstance(v, str) else v or []:
            if not s:
                raise ValueError("stop strings must be non-empty")
        return v

    @field_validator("presence_penalty", "frequency_penalty")
    @classmethod
    def _no_penalties(cls, v: float | None) -> float | None:
        if v:
            raise ValueError("penalties are not supported (sampling must stay exactly the target's); omit it or send 0")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _no_logit_bias(cls, v: dict | None) -> dict | None:
        if v:
            raise ValueError("logit_bias is not supported")
        return v

    @property
    def stop_strings(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_GenerationParams):
    # one prompt: text or token ids (a batch of one is accepted, larger batches are not: n=1 only)
    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool | None = False
    logprobs: int | None = None
    best_of: int | None = None
    suffix: str | None = None

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, v: bool | None) -> bool | None:
        if v:
            raise ValueError("echo is not supported")
        return v

    @field_validator("logprobs")
    @classmethod
    def _no_logprobs(cls, v: int | None) -> int | None:
        if v is not None:
            raise ValueError("logprobs are not supported")
        return v

    @field_validator("best_of")
    @classmethod
    def _one_best_of(cls, v: int | None) -> int | None:
        if v is not None and v != 1:
            raise ValueError(f"only best_of=1 is supported, got {v}")
        return v

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, v: str | None) -> str | None:
        if v:
            raise ValueError("suffix is not supported")
        return v

    _prompt_is_unicode = field_validator("prompt")(_unicode)

    @field_validator("prompt")
    @classmethod
    def _single_prompt(cls, v):
        if isinstance(v, list) and v and isinstance(v[0], (str, list)):
            if len(v) != 1:
                raise ValueError(f"only one prompt per request is supported, got a batch of {len(v)}")
            return v[0]
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
    max_completion_tokens: int | None = Field(default=None, ge=1)  # the newer name of max_tokens
    logprobs: bool | None = False
    top_logprobs: int | None = None

    @field_validator("logprobs")
    @classmethod
    def _no_logprobs(cls, v: bool | None) -> bool | None:
        if v:
            raise ValueError("logprobs are not supported")
        return v

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


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: None = None
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
    logprobs: None = None
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
    logprobs: None = None
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


def with_stream_chunk_schemas(openapi: dict[str, Any]) -> dict[str, Any]:
    """FastAPI's `openapi` with the stream chunks' schemas (and what they reference) added to its
    components: the event-stream responses point at them, FastAPI adds only JSON bodies' models."""
    schemas = openapi.setdefault("components", {}).setdefault("schemas", {})
    for chunk in (CompletionResponse, ChatCompletionChunk):
        schema = chunk.model_json_schema(ref_template=COMPONENT_REF, mode="serialization")
        for name, definition in {**schema.pop("$defs", {}), chunk.__name__: schema}.items():
            schemas.setdefault(name, definition)
    return openapi
