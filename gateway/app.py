"""The OpenAI-compatible REST surface over a Bus: FastAPI app factory.

    app = create_app(bus, tokenizer, model_name="smollm2-135m-instruct", max_model_len=8192)
    uvicorn.run(app)     # gateway/server.py (embedded, MemoryBus) or gateway/cli.py (RedisBus)

Endpoints: POST /v1/completions, POST /v1/chat/completions (both with `stream: true` as
server-sent events ending in `data: [DONE]`), GET /v1/models, GET /health (readiness: the bus and
the schedulers answer; 503 otherwise) and GET /live (liveness: the process answers, nothing else
is checked, so a restart is never the cure for a dependency that is down), GET /metrics
(Prometheus; open like the probes), GET /ui (the live round view, gateway/round_view.py; its event
stream /ui/events needs the API key). Every request is a span continuing the client's W3C
`traceparent`; the bus request carries that span's context on (dspark/observability).

A request is validated and tokenised here, submitted to the bus, and answered from its output
stream (gateway/responses.py). The gateway holds no engine and no per-request state: every SSE
event carries `id: <request id>/<event id>/<chunk>`, and a client that reconnects with that
`Last-Event-ID` (same endpoint, `stream: true`) gets the rest of the same response, on any
replica. A client that disconnects, or a stop string that ends the text, cancels the generation
on the bus. Every 4xx/5xx body is OpenAI's `{"error": {message, type, param, code}}`; bad input
never reaches a scheduler. A bus that cannot be reached (Redis down) is a 503 with Retry-After
for every request that needs it, resumes included (gateway/errors.py `bus_unavailable`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from typing import Any, Protocol

import anyio
import jinja2
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from dspark.bus.base import Bus, BusFull, BusUnavailable, DuplicateRequest, UnknownRequest
from dspark.bus.messages import BusRequest, OutputEvent
from dspark.observability import tracing
from dspark.observability.asgi import TelemetryMiddleware
from dspark.observability.metrics import exposition, gateway_metrics
from dspark.sampling.params import SamplingParams
from dspark.serving_config import GatewaySection
from gateway.api_keys import ApiKeys
from gateway.errors import ApiError, bus_unavailable, error_body, error_json
from gateway.guard import RequestGuard
from gateway.logprobs import Detokenizer, chat_logprobs, completion_logprobs
from gateway.openai_schema import (
    ERROR_RESPONSES,
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatMessageOut,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    HealthStatus,
    LiveStatus,
    ModelCard,
    ModelList,
    _GenerationParams,
    json_or_event_stream,
    with_server_limits,
    with_stream_chunk_schemas,
)
from gateway.rate_limit import RateLimiter
from gateway.responses import ID_PREFIX, ChunkWriter, ResponseSpec, collect_text, event_error, speculative, usage
from gateway.round_view import EVENTS_PATH, OPEN_PATHS, add_round_view
from gateway.text_stream import TextStream

__all__ = ["ApiError", "TextStream", "create_app", "parse_sse"]

log = logging.getLogger(__name__)

DEFAULT_MAX_TOKENS = 256
HealthCheck = Callable[[], Awaitable[tuple[bool, dict[str, Any]]]]


class GatewayTokenizer(Detokenizer, Protocol):
    """What the gateway needs of a tokenizer (dspark.model.tokenizer.Tokenizer has it)."""

    eos_token_ids: frozenset[int]

    def encode(self, text: str) -> list[int]: ...
    def encode_chat(self, messages: list[dict[str, str]]) -> list[int]: ...


class _ClientDisconnected(Exception):
    pass


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errors = exc.errors()
    if not errors:
        return "invalid request body", None
    err = errors[0]
    loc = [p for p in err.get("loc", ()) if p != "body"]
    if err.get("type") == "json_invalid":
        return f"the request body is not valid JSON: {err.get('ctx', {}).get('error', err.get('msg'))}", None
    param = ".".join(str(p) for p in loc if isinstance(p, (str, int))) or None
    msg = str(err.get("msg", "invalid value")).removeprefix("Value error, ")
    return (f"{param}: {msg}" if param else msg), param


def _parse_last_event_id(value: str) -> tuple[str, str, int]:
    """`<request id>/<event id>/<chunk index>` -> its parts; ApiError 400 if malformed."""
    parts = value.strip().rsplit("/", 2)
    if len(parts) != 3 or not parts[0] or not parts[1] or not parts[2].isdigit():
        raise ApiError(400, f"Last-Event-ID {value[:100]!r} is not an event id this server sent "
                            "(<request id>/<event id>/<chunk>)", code="invalid_last_event_id")
    return parts[0], parts[1], int(parts[2])


async def _chain(first: OutputEvent, rest: AsyncIterator[OutputEvent]) -> AsyncIterator[OutputEvent]:
    yield first
    async for event in rest:
        yield event


# ---- the app ---------------------------------------------------------------------------------


def create_app(
    bus: Bus,
    tokenizer: GatewayTokenizer,
    *,
    model_name: str,
    max_model_len: int,  # the model's context window: prompt + completion tokens
    vocab_size: int | None = None,  # token ids in a token-id prompt must be below it (None: the scheduler checks)
    max_tokens_limit: int = GatewaySection.max_tokens_limit,
    default_max_tokens: int = DEFAULT_MAX_TOKENS,
    max_prompt_tokens: int | None = None,  # None: the context window minus one
    max_body_bytes: int = GatewaySection.max_body_bytes,
    api_keys: ApiKeys | Iterable[str] = (),  # plain keys or sha256:<hex> hashes (gateway/api_keys.py); empty: no authentication
    rate_limiter: RateLimiter | None = None,  # per-client limits (gateway/rate_limit.py); None: none
    accept_timeout_s: float | None = None,  # how long a request may wait for a scheduler to accept it
    health: HealthCheck | None = None,  # default: the bus answers
    lifespan=None,
) -> FastAPI:
    """An app serving one model over `bus`; the caller runs the schedulers (workers) on it."""
    if max_tokens_limit < 1:
        raise ValueError(f"max_tokens_limit must be >= 1, got {max_tokens_limit}")
    if max_model_len < 2:
        raise ValueError(f"max_model_len must be >= 2, got {max_model_len}")
    if max_prompt_tokens is not None and max_prompt_tokens < 1:
        raise ValueError(f"max_prompt_tokens must be >= 1, got {max_prompt_tokens}")
    app = FastAPI(title="dspark", summary="OpenAI-compatible API over DSpark speculative decoding", lifespan=lifespan,
                  responses=ERROR_RESPONSES)
    default_max_tokens = min(default_max_tokens, max_tokens_limit)
    prompt_limit = min(max_prompt_tokens or max_model_len - 1, max_model_len - 1)

    def openapi() -> dict[str, Any]:  # FastAPI's "extending OpenAPI" recipe, with this server's limits
        if app.openapi_schema is None:
            app.openapi_schema = with_server_limits(with_stream_chunk_schemas(FastAPI.openapi(app)), max_tokens_limit=max_tokens_limit,
                                                    prompt_limit=prompt_limit, vocab_size=vocab_size)
        return app.openapi_schema

    app.openapi = openapi
    app.state.bus = bus
    app.add_middleware(RequestGuard, api_keys=api_keys if isinstance(api_keys, ApiKeys) else tuple(api_keys),
                       max_body_bytes=max_body_bytes, rate_limiter=rate_limiter,
                       open_paths=("/health", "/live", "/metrics", *OPEN_PATHS), unmetered_paths=(EVENTS_PATH,))
    app.add_middleware(TelemetryMiddleware)  # outermost: a span and metrics for every request, refused ones too

    @app.exception_handler(RequestValidationError)
    async def _on_validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(exc)
        return JSONResponse(error_body(message, type="invalid_request_error", param=param), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _on_http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
        code = "not_found" if exc.status_code == 404 else None
        return JSONResponse(error_body(str(exc.detail), type=kind, code=code), status_code=exc.status_code,
                            headers=exc.headers)  # e.g. 405's `Allow`

    @app.exception_handler(ApiError)
    async def _on_api_error(request: Request, exc: ApiError) -> JSONResponse:
        return JSONResponse(error_body(exc.message, type=exc.type, param=exc.param, code=exc.code), status_code=exc.status,
                            headers=exc.headers)

    @app.exception_handler(BusUnavailable)
    async def _on_bus_unavailable(request: Request, exc: BusUnavailable) -> JSONResponse:
        return await _on_api_error(request, bus_unavailable(exc))  # any bus call of any endpoint: 503, not 500

    @app.exception_handler(Exception)
    async def _on_unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error")
        return JSONResponse(error_body(f"internal error: {exc!r}", type="server_error"), status_code=500)

    # ---- helpers closing over the served model ----

    def check_model(name: str) -> None:
        if name != model_name:
            raise ApiError(404, f"The model `{name}` does not exist; this server serves `{model_name}`.",
                           param="model", code="model_not_found")

    def build_request(spec: ResponseSpec, body: _GenerationParams, prompt_ids: list[int], prompt_param: str,
                      traceparent: str | None) -> BusRequest:
        if not prompt_ids:
            raise ApiError(400, f"{prompt_param} is empty; at least one token is needed", param=prompt_param)
        if vocab_size is not None:
            bad = [t for t in prompt_ids if not 0 <= t < vocab_size]
            if bad:
                raise ApiError(400, f"prompt token ids must be in [0, {vocab_size}), got {bad[:5]}")
        if len(prompt_ids) >= max_model_len:
            raise ApiError(400, f"This model's maximum context length is {max_model_len} tokens; the {prompt_param} has "
                                f"{len(prompt_ids)} tokens, leaving no room for a completion.",
                           param=prompt_param, code="context_length_exceeded")
        if len(prompt_ids) > prompt_limit:
            raise ApiError(400, f"The {prompt_param} has {len(prompt_ids)} tokens; this server accepts at most {prompt_limit}.",
                           param=prompt_param, code="prompt_too_long")
        for name in ("max_tokens", "max_completion_tokens"):  # both are bounded, whichever is used
            value = getattr(body, name, None)
            if value is not None and value > max_tokens_limit:
                raise ApiError(400, f"{name} is {value}, this server allows at most {max_tokens_limit}", param=name)
        if body.max_tokens is None:
            max_tokens = min(default_max_tokens, max_model_len - len(prompt_ids))
        else:
            max_tokens = body.max_tokens
            if len(prompt_ids) + max_tokens > max_model_len:
                raise ApiError(400, f"This model's maximum context length is {max_model_len} tokens. However, you "
                                    f"requested {len(prompt_ids) + max_tokens} tokens ({len(prompt_ids)} in the "
                                    f"{prompt_param}, {max_tokens} in the completion).",
                               param="max_tokens", code="context_length_exceeded")
        try:
            params = SamplingParams(
                temperature=1.0 if body.temperature is None else body.temperature,
                top_p=1.0 if body.top_p is None else body.top_p,
                top_k=body.top_k or 0,
                seed=body.seed,
            )
        except ValueError as e:
            raise ApiError(400, str(e)) from None
        return BusRequest(spec.request_id, prompt_ids, max_tokens, params, stop_token_ids=tokenizer.eos_token_ids,
                          traceparent=traceparent, metadata=spec.to_metadata(), logprobs=spec.logprobs)

    def new_spec(kind: str, body: _GenerationParams, logprobs: int | None) -> ResponseSpec:
        request_id = f"{ID_PREFIX[kind]}{uuid.uuid4().hex}"
        tracing.set_attributes({"dspark.request_id": request_id})  # find a response's trace by its id
        return ResponseSpec(kind=kind, request_id=request_id, model=model_name, created=int(time.time()),
                            stop=tuple(body.stop_strings), include_usage=body.include_usage, logprobs=logprobs)

    async def submit(bus_request: BusRequest) -> None:
        try:
            await bus.submit(bus_request)
        except BusFull as e:
            raise ApiError(503, f"the server is overloaded: {e}; retry later", type="server_error", code="overloaded") from None
        except DuplicateRequest as e:  # uuid4 ids: practically never
            raise ApiError(409, str(e)) from None
        except OSError as e:  # BusUnavailable, or a bus of another kind losing its connection
            raise bus_unavailable(e) from None

    async def cancel_quietly(request_id: str, events: AsyncIterator[OutputEvent] | None = None) -> None:
        """Cancel on the bus and close the tail, even while the caller is being cancelled."""
        with anyio.move_on_after(5, shield=True):
            if events is not None:
                try:
                    await events.aclose()
                except Exception:
                    log.debug("closing the tail of %r failed", request_id, exc_info=True)
            try:
                await bus.cancel(request_id)
            except Exception:
                log.exception("cancelling request %r on the bus failed", request_id)

    async def unless_disconnected(request: Request, work: Awaitable):
        """Await `work`, raising _ClientDisconnected (and cancelling it) if the client leaves first."""

        async def disconnected() -> None:
            while (await request.receive())["type"] != "http.disconnect":
                pass

        task, watch = asyncio.ensure_future(work), asyncio.ensure_future(disconnected())
        try:
            await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED, timeout=None)
        finally:
            watch.cancel()
            if not task.done():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        if task.cancelled():
            raise _ClientDisconnected
        return task.result()

    async def first_event(events: AsyncIterator[OutputEvent]) -> OutputEvent:
        try:
            if accept_timeout_s is None:
                return await anext(events)
            return await asyncio.wait_for(anext(events), accept_timeout_s)
        except TimeoutError:
            raise ApiError(503, f"no scheduler accepted the request within {accept_timeout_s} s", type="server_error",
                           code="scheduler_timeout") from None
        except StopAsyncIteration:
            raise ApiError(500, "the request's output stream ended without any event", type="server_error") from None
        except UnknownRequest as e:
            raise ApiError(500, f"the request disappeared from the bus: {e}", type="server_error") from None

    async def run(request: Request, spec: ResponseSpec, bus_request: BusRequest, stream: bool):
        """Submit and answer: the whole body, or the SSE response (after the first event, so a
        request the scheduler refuses still gets its 4xx status)."""
        await submit(bus_request)
        events = bus.tail(spec.request_id)
        done = False
        try:
            first = await unless_disconnected(request, first_event(events))
            if first.finish_reason in ("error", "cancelled"):
                done = True
                raise event_error(first)
            if stream:
                done = True  # the SSE generator owns the request from here
                return sse_response(spec, _chain(first, events), resume=None)
            collected = await unless_disconnected(request, collect_text(_chain(first, events), spec, tokenizer))
            done = collected.reached_final_event
        except _ClientDisconnected:
            raise ApiError(499, "client disconnected") from None
        finally:
            if not done:
                await cancel_quietly(spec.request_id, events)
        entries = collected.logprobs
        if spec.kind == "completion":
            logprobs = None if entries is None else completion_logprobs(entries, tokenizer)
            return CompletionResponse(
                id=spec.request_id, model=model_name, created=spec.created,
                choices=[CompletionChoice(text=collected.text, logprobs=logprobs, finish_reason=collected.finish_reason)],
                usage=usage(collected.stats), speculative=speculative(collected.stats),
            ).model_dump()
        logprobs = None if entries is None else chat_logprobs(entries, tokenizer)
        return ChatCompletionResponse(
            id=spec.request_id, model=model_name, created=spec.created,
            choices=[ChatChoice(message=ChatMessageOut(content=collected.text), logprobs=logprobs,
                                finish_reason=collected.finish_reason)],
            usage=usage(collected.stats), speculative=speculative(collected.stats),
        ).model_dump()

    def sse_response(spec: ResponseSpec, events: AsyncIterator[OutputEvent], *, resume: tuple[str, int] | None) -> StreamingResponse:
        return StreamingResponse(sse(spec, events, resume), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    async def sse(spec: ResponseSpec, events: AsyncIterator[OutputEvent], resume: tuple[str, int] | None) -> AsyncIterator[str]:
        """The SSE body. With `resume = (event id, chunk)`, the events up to there are replayed
        through the writer silently and only what follows that chunk is sent."""
        writer = ChunkWriter(spec, tokenizer)
        finished = False  # the request's final event was seen: nothing to cancel
        try:
            async for event in events:
                payloads = list(enumerate(writer.chunks(event)))
                finished = finished or event.final
                if resume is not None:
                    if event.event_id != resume[0]:
                        if writer.done:
                            break
                        continue
                    payloads = [(i, p) for i, p in payloads if i > resume[1]]
                    resume = None
                for i, payload in payloads:
                    yield f"id: {spec.request_id}/{event.event_id}/{i}\ndata: {payload}\n\n"
                if writer.done:
                    break
            if resume is not None:
                yield f"data: {error_json(ApiError(400, 'Last-Event-ID names no event of this response', code='invalid_last_event_id'))}\n\n"
        except UnknownRequest as e:
            yield f"data: {error_json(ApiError(404, str(e), code='request_not_found'))}\n\n"
        except BusUnavailable as e:  # the bus went away mid-stream (after the tail's retries): resume later
            yield f"data: {error_json(bus_unavailable(e))}\n\n"
        except Exception as e:  # headers are out: report in-band, as OpenAI does
            log.exception("streaming %s failed", spec.request_id)
            yield f"data: {error_json(ApiError(500, str(e), type='server_error'))}\n\n"
        finally:
            if not finished:
                await cancel_quietly(spec.request_id, events)
        yield "data: [DONE]\n\n"

    async def resume(request: Request, kind: str, body: _GenerationParams, last_event_id: str) -> StreamingResponse:
        request_id, event_id, chunk = _parse_last_event_id(last_event_id)
        if not body.stream:
            raise ApiError(400, "Last-Event-ID resumes a streamed response: send stream: true", param="stream")
        if not request_id.startswith(ID_PREFIX[kind]):
            raise ApiError(400, f"Last-Event-ID names request {request_id!r}, not a response of this endpoint",
                           code="invalid_last_event_id")
        bus_request = await bus.lookup(request_id)
        if bus_request is None:
            raise ApiError(404, f"request {request_id!r} is unknown or expired; it cannot be resumed", code="request_not_found")
        try:
            spec = ResponseSpec.from_metadata(bus_request.metadata)
        except ValueError as e:
            raise ApiError(400, f"request {request_id!r} cannot be resumed here: {e}") from None
        # The response is replayed from its first event (the text state is rebuilt on the way), so
        # an event id that is not in the stream is reported in-band once the stream has been read.
        return sse_response(spec, bus.tail(request_id), resume=(event_id, chunk))

    # ---- endpoints ----

    add_round_view(app, bus, tokenizer.decode, model_name=model_name)  # /ui: the live round view (gateway/round_view.py)

    @app.get("/live", response_model=None, responses={200: {"model": LiveStatus}})
    async def live() -> dict:
        return {"status": "ok"}

    @app.get("/health", responses={200: {"model": HealthStatus}, 503: {"model": HealthStatus, "description": "Not ready"}})
    async def health_check() -> JSONResponse:
        try:
            ok, details = await health() if health is not None else (True, {"queue_depth": await bus.queue_depth()})
        except Exception as e:  # noqa: BLE001 - any failure of the check means unhealthy, with its reason
            ok, details = False, {"error": repr(e)}
        return JSONResponse({"status": "ok" if ok else "unavailable", **details}, status_code=200 if ok else 503)

    @app.get("/metrics", include_in_schema=False)
    async def metrics() -> Response:
        """Prometheus text format: the gateway's metrics, and the engine's when it runs in this process."""
        try:
            gateway_metrics().bus_queue_depth.set(await bus.queue_depth())
        except Exception:  # noqa: BLE001 - an unreachable bus must not hide the other metrics
            log.warning("reading the bus queue depth for /metrics failed", exc_info=True)
        body, content_type = exposition()
        return Response(body, media_type=content_type)

    @app.get("/v1/models", response_model=None, responses={200: {"model": ModelList}})
    async def models() -> dict:
        return ModelList(data=[ModelCard(id=model_name)]).model_dump()

    @app.get("/v1/models/{name:path}", response_model=None, responses={200: {"model": ModelCard}})
    async def model(name: str) -> dict:
        check_model(name)
        return ModelCard(id=model_name).model_dump()

    @app.post("/v1/completions", response_model=None, responses=json_or_event_stream(CompletionResponse, CompletionResponse))
    async def completions(body: CompletionRequest, request: Request):
        check_model(body.model)
        if (last_event_id := request.headers.get("last-event-id")) is not None:
            return await resume(request, "completion", body, last_event_id)
        prompt_ids = tokenizer.encode(body.prompt) if isinstance(body.prompt, str) else list(body.prompt)
        spec = new_spec("completion", body, body.logprobs)
        bus_request = build_request(spec, body, prompt_ids, "prompt", tracing.current_traceparent())
        return await run(request, spec, bus_request, bool(body.stream))

    @app.post("/v1/chat/completions", response_model=None, responses=json_or_event_stream(ChatCompletionResponse, ChatCompletionChunk))
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        check_model(body.model)
        if (last_event_id := request.headers.get("last-event-id")) is not None:
            return await resume(request, "chat", body, last_event_id)
        messages = [{"role": "system" if m.role == "developer" else m.role, "content": m.text} for m in body.messages]
        try:
            prompt_ids = tokenizer.encode_chat(messages)
        except (ValueError, jinja2.TemplateError) as e:
            raise ApiError(400, f"messages cannot be rendered with the model's chat template: {e}", param="messages") from None
        spec = new_spec("chat", body, (body.top_logprobs or 0) if body.logprobs else None)
        bus_request = build_request(spec, body, prompt_ids, "messages", tracing.current_traceparent())
        return await run(request, spec, bus_request, bool(body.stream))

    return app


def parse_sse(body: str) -> list[dict | str]:
    """Test/debug helper: the `data:` payloads of an SSE body, JSON-decoded except `[DONE]`."""
    out: list[dict | str] = []
    for line in body.splitlines():
        if line.startswith("data: "):
            payload = line[len("data: "):]
            out.append(payload if payload == "[DONE]" else json.loads(payload))
    return out
