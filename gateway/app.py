"""The OpenAI-compatible REST surface over an AsyncEngine: FastAPI app factory.

    app = create_app(async_engine, tokenizer, model_name="smollm2-135m-instruct", max_tokens_limit=2048)
    uvicorn.run(app)                                   # gateway/server.py does this for `dspark serve`

Endpoints: POST /v1/completions, POST /v1/chat/completions (both with `stream: true` as
server-sent events ending in `data: [DONE]`), GET /v1/models, GET /health.

Text is produced by one `TextStream` per request for the streamed and the non-streamed path
alike, so a non-streamed response is by construction the concatenation of the chunks the
streamed one would send. Every 4xx/5xx body is OpenAI's `{"error": {message, type, param, code}}`;
bad input never reaches the engine as a 500.
"""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from dataclasses import dataclass
from typing import AsyncIterator, Callable

import jinja2
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from dspark.engine.async_engine import AsyncEngine, EngineError, GenerationStats, RequestStream
from dspark.engine.speculative import GenerationRequest
from dspark.model.tokenizer import Tokenizer
from dspark.sampling.params import SamplingParams
from gateway.openai_schema import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatDelta,
    ChatMessageOut,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    ErrorDetail,
    ErrorResponse,
    ModelCard,
    ModelList,
    SpeculativeStats,
    Usage,
    _GenerationParams,
)

__all__ = ["ApiError", "TextStream", "create_app"]

log = logging.getLogger(__name__)

DEFAULT_MAX_TOKENS = 256


# ---- incremental detokenisation with stop strings ------------------------------------------


class TextStream:
    """Token ids in, stable text out, cut at the first stop string.

    Each push decodes the whole output so far and hands out only the new suffix that can no
    longer change: a trailing U+FFFD (an incomplete UTF-8 sequence split across tokens) is held
    back, and so is a suffix that could be the start of a stop string. `finish()` releases what
    was held. Everything handed out is a prefix of the final text.
    """

    def __init__(self, decode: Callable[[list[int]], str], stop: list[str] = ()):
        self._decode = decode
        self._stop = [s for s in stop if s]
        self._max_stop = max((len(s) for s in self._stop), default=0)
        self.token_ids: list[int] = []
        self.text = ""  # handed out so far
        self.stopped = False  # a stop string was found; nothing more will be handed out

    def push(self, token_ids: list[int]) -> str:
        if self.stopped:
            return ""
        self.token_ids.extend(token_ids)
        return self._advance(self._decode(self.token_ids).rstrip("\ufffd"), final=False)

    def finish(self) -> str:
        if self.stopped:
            return ""
        return self._advance(self._decode(self.token_ids), final=True)

    def _advance(self, full: str, *, final: bool) -> str:
        start = len(self.text)  # a stop string cannot start in text already handed out (it was held back)
        hits = [i for i in (full.find(s, start) for s in self._stop) if i >= 0]
        if hits:
            self.stopped = True
            return self._release(full[: min(hits)])
        hold = 0
        if not final:
            for k in range(min(self._max_stop - 1, len(full) - start), 0, -1):
                tail = full[-k:]
                if any(s.startswith(tail) for s in self._stop):
                    hold = k
                    break
        return self._release(full[: len(full) - hold])

    def _release(self, upto: str) -> str:
        # Decoding a longer sequence only ever appends to a byte-level BPE's text; if a tokenizer
        # ever rewrote earlier text we cannot take back what was sent, so send only what is new.
        new = upto[len(self.text):] if len(upto) > len(self.text) else ""
        self.text += new
        return new


@dataclass
class _Piece:
    text: str
    finish_reason: str | None  # set on the last piece only
    stats: GenerationStats


async def _pieces(stream: RequestStream, detok: TextStream) -> AsyncIterator[_Piece]:
    """Text pieces of one request as rounds finish; the engine request is aborted when the
    caller stops early (a stop string, a disconnected client)."""
    try:
        async for delta in stream:
            text = detok.push(delta.new_token_ids)
            if not detok.stopped and delta.finish_reason is not None:
                text += detok.finish()
            if detok.stopped:
                yield _Piece(text, "stop", delta.stats)
                return
            if delta.finish_reason is not None:
                yield _Piece(text, delta.finish_reason, delta.stats)
                return
            if text:
                yield _Piece(text, None, delta.stats)
    finally:
        stream.abort()  # no-op once the engine finished it


# ---- errors --------------------------------------------------------------------------------


class ApiError(Exception):
    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 type: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type


def _error_response(status: int, message: str, *, type: str, param: str | None = None, code: str | None = None) -> JSONResponse:
    body = ErrorResponse(error=ErrorDetail(message=message, type=type, param=param, code=code))
    return JSONResponse(body.model_dump(), status_code=status)


def _error_event(e: ApiError) -> str:
    body = ErrorResponse(error=ErrorDetail(message=e.message, type=e.type, param=e.param, code=e.code))
    return f"data: {body.model_dump_json()}\n\n"


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


# ---- the app -------------------------------------------------------------------------------


def create_app(
    engine: AsyncEngine,
    tokenizer: Tokenizer,
    *,
    model_name: str,
    max_tokens_limit: int = 2048,
    default_max_tokens: int = DEFAULT_MAX_TOKENS,
) -> FastAPI:
    """An app serving one model; the caller starts and shuts down `engine`."""
    if max_tokens_limit < 1:
        raise ValueError(f"max_tokens_limit must be >= 1, got {max_tokens_limit}")
    app = FastAPI(title="dspark", summary="OpenAI-compatible API over DSpark speculative decoding")
    app.state.engine = engine
    default_max_tokens = min(default_max_tokens, max_tokens_limit)

    @app.exception_handler(RequestValidationError)
    async def _on_validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(exc)
        return _error_response(400, message, type="invalid_request_error", param=param)

    @app.exception_handler(StarletteHTTPException)
    async def _on_http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
        code = "not_found" if exc.status_code == 404 else None
        return _error_response(exc.status_code, str(exc.detail), type=kind, code=code)

    @app.exception_handler(ApiError)
    async def _on_api_error(request: Request, exc: ApiError) -> JSONResponse:
        return _error_response(exc.status, exc.message, type=exc.type, param=exc.param, code=exc.code)

    @app.exception_handler(Exception)
    async def _on_unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error")
        return _error_response(500, f"internal error: {exc!r}", type="server_error")

    # ---- helpers closing over the served model ----

    def check_model(name: str) -> None:
        if name != model_name:
            raise ApiError(404, f"The model `{name}` does not exist; this server serves `{model_name}`.",
                           param="model", code="model_not_found")

    def build_request(request_id: str, body: _GenerationParams, prompt_ids: list[int], prompt_param: str) -> GenerationRequest:
        if not prompt_ids:
            raise ApiError(400, f"{prompt_param} is empty; at least one token is needed", param=prompt_param)
        context = engine.max_model_len
        if len(prompt_ids) >= context:
            raise ApiError(400, f"This model's maximum context length is {context} tokens; the {prompt_param} has "
                                f"{len(prompt_ids)} tokens, leaving no room for a completion.",
                           param=prompt_param, code="context_length_exceeded")
        if body.max_tokens is None:
            max_tokens = min(default_max_tokens, context - len(prompt_ids))
        else:
            max_tokens = body.max_tokens
            if max_tokens > max_tokens_limit:
                raise ApiError(400, f"max_tokens is {max_tokens}, this server allows at most {max_tokens_limit}",
                               param="max_tokens")
            if len(prompt_ids) + max_tokens > context:
                raise ApiError(400, f"This model's maximum context length is {context} tokens. However, you "
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
        return GenerationRequest(request_id, prompt_ids, max_tokens, params, stop_token_ids=tokenizer.eos_token_ids)

    async def submit(gen: GenerationRequest) -> RequestStream:
        try:
            return await engine.submit(gen)
        except ValueError as e:
            raise ApiError(400, str(e)) from None
        except EngineError as e:
            raise ApiError(503, str(e), type="server_error") from None

    async def collect(request: Request, pieces: AsyncIterator[_Piece]) -> tuple[str, str, GenerationStats]:
        """Run a non-streamed request to the end, aborting it if the client goes away."""

        async def run() -> tuple[str, str, GenerationStats]:
            texts, last = [], None
            async for piece in pieces:
                texts.append(piece.text)
                last = piece
            return "".join(texts), last.finish_reason, last.stats

        async def disconnected() -> None:
            while (await request.receive())["type"] != "http.disconnect":
                pass

        work, watch = asyncio.ensure_future(run()), asyncio.ensure_future(disconnected())
        try:
            await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watch.cancel()
            if not work.done():
                work.cancel()  # the client left (or we were cancelled): _pieces aborts the request
                await asyncio.gather(work, return_exceptions=True)
                await pieces.aclose()
        if work.cancelled():
            raise ApiError(499, "client disconnected")
        try:
            return work.result()
        except ValueError as e:  # the engine could not admit it after all
            raise ApiError(400, str(e)) from None
        except EngineError as e:
            raise ApiError(500, str(e), type="server_error") from None

    async def sse(events: AsyncIterator[str]) -> AsyncIterator[str]:
        try:
            async for e in events:
                yield e
        except ValueError as e:  # the engine could not admit it after all
            yield _error_event(ApiError(400, str(e)))
        except Exception as e:  # headers are out: report in-band, as OpenAI does
            if not isinstance(e, EngineError):
                log.exception("streaming failed")
            yield _error_event(ApiError(500, str(e), type="server_error"))
        yield "data: [DONE]\n\n"

    def usage(stats: GenerationStats) -> Usage:
        return Usage(prompt_tokens=stats.prompt_tokens, completion_tokens=stats.completion_tokens,
                     total_tokens=stats.prompt_tokens + stats.completion_tokens)

    def speculative(stats: GenerationStats) -> SpeculativeStats:
        return SpeculativeStats(rounds=stats.rounds, mean_accepted_length=stats.mean_accepted_length,
                                draft_tokens=stats.draft_tokens, accepted_tokens=stats.accepted_tokens)

    # ---- endpoints ----

    @app.get("/health")
    async def health() -> JSONResponse:
        ok = engine.is_running
        body = {"status": "ok" if ok else "unavailable", "num_running": engine.num_running, "num_waiting": engine.num_waiting}
        return JSONResponse(body, status_code=200 if ok else 503)

    @app.get("/v1/models")
    async def models() -> dict:
        return ModelList(data=[ModelCard(id=model_name)]).model_dump()

    @app.get("/v1/models/{name:path}")
    async def model(name: str) -> dict:
        check_model(name)
        return ModelCard(id=model_name).model_dump()

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        check_model(body.model)
        if isinstance(body.prompt, str):
            prompt_ids = tokenizer.encode(body.prompt)
        else:
            prompt_ids = list(body.prompt)
        rid = f"cmpl-{uuid.uuid4().hex}"
        stream = await submit(build_request(rid, body, prompt_ids, "prompt"))
        pieces = _pieces(stream, TextStream(tokenizer.decode, body.stop_strings))

        if not body.stream:
            text, finish, stats = await collect(request, pieces)
            return CompletionResponse(
                id=rid, model=model_name,
                choices=[CompletionChoice(text=text, finish_reason=finish)],
                usage=usage(stats), speculative=speculative(stats),
            ).model_dump()

        async def events() -> AsyncIterator[str]:
            created = CompletionResponse(id=rid, model=model_name, choices=[]).created
            chunk = lambda **kw: CompletionResponse(id=rid, model=model_name, created=created, **kw).model_dump_json()  # noqa: E731
            async for p in pieces:
                final = p.finish_reason is not None
                yield "data: " + chunk(
                    choices=[CompletionChoice(text=p.text, finish_reason=p.finish_reason)],
                    speculative=speculative(p.stats) if final else None,
                ) + "\n\n"
                if final and body.include_usage:
                    yield "data: " + chunk(choices=[], usage=usage(p.stats), speculative=speculative(p.stats)) + "\n\n"

        return StreamingResponse(sse(events()), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        check_model(body.model)
        messages = [{"role": "system" if m.role == "developer" else m.role, "content": m.text} for m in body.messages]
        try:
            prompt_ids = tokenizer.encode_chat(messages)
        except (ValueError, jinja2.TemplateError) as e:
            raise ApiError(400, f"messages cannot be rendered with the model's chat template: {e}", param="messages") from None
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        stream = await submit(build_request(rid, body, prompt_ids, "messages"))
        pieces = _pieces(stream, TextStream(tokenizer.decode, body.stop_strings))

        if not body.stream:
            text, finish, stats = await collect(request, pieces)
            return ChatCompletionResponse(
                id=rid, model=model_name,
                choices=[ChatChoice(message=ChatMessageOut(content=text), finish_reason=finish)],
                usage=usage(stats), speculative=speculative(stats),
            ).model_dump()

        async def events() -> AsyncIterator[str]:
            created = ChatCompletionChunk(id=rid, model=model_name, choices=[]).created
            chunk = lambda **kw: ChatCompletionChunk(id=rid, model=model_name, created=created, **kw).model_dump_json()  # noqa: E731
            yield "data: " + chunk(choices=[ChatChunkChoice(delta=ChatDelta(role="assistant", content=""))]) + "\n\n"
            async for p in pieces:
                if p.text:
                    yield "data: " + chunk(choices=[ChatChunkChoice(delta=ChatDelta(content=p.text))]) + "\n\n"
                if p.finish_reason is not None:
                    yield "data: " + chunk(
                        choices=[ChatChunkChoice(delta=ChatDelta(), finish_reason=p.finish_reason)],
                        speculative=speculative(p.stats),
                    ) + "\n\n"
                    if body.include_usage:
                        yield "data: " + chunk(choices=[], usage=usage(p.stats), speculative=speculative(p.stats)) + "\n\n"

        return StreamingResponse(sse(events()), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    return app


def parse_sse(body: str) -> list[dict | str]:
    """Test/debug helper: the `data:` payloads of an SSE body, JSON-decoded except `[DONE]`."""
    out: list[dict | str] = []
    for line in body.splitlines():
        if line.startswith("data: "):
            payload = line[len("data: "):]
            out.append(payload if payload == "[DONE]" else json.loads(payload))
    return out
