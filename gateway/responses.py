"""Bus output events -> OpenAI responses: the non-streamed body, or the chunks of an SSE stream.

Both paths push the events' tokens through one `TextStream` (and, when the request asked for
log-probabilities, one `TokenAligner`), so a non-streamed text and its logprobs are the
concatenation of the streamed chunks'. `ChunkWriter` is deterministic in the events it is fed:
replaying a request's output stream from its first event yields the same chunks again, which is
how a response is resumed from an SSE `Last-Event-ID` on any gateway replica (the gateway fields
it needs travel in the bus request's metadata as a `ResponseSpec`).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import asdict, dataclass
from typing import Literal

from dspark.bus.messages import OutputEvent, OutputStats
from gateway.errors import ApiError, error_json
from gateway.logprobs import Detokenizer, TokenAligner, TokenEntry, chat_logprobs, completion_logprobs
from gateway.openai_schema import (
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatDelta,
    CompletionChoice,
    CompletionResponse,
    SpeculativeStats,
    Usage,
)
from gateway.text_stream import TextStream

__all__ = ["ChunkWriter", "Collected", "ResponseSpec", "collect_text", "event_error", "speculative", "usage"]

ResponseKind = Literal["completion", "chat"]
ID_PREFIX: dict[str, str] = {"completion": "cmpl-", "chat": "chatcmpl-"}


@dataclass(frozen=True)
class ResponseSpec:
    """What the gateway needs besides the tokens to write a request's response."""

    kind: ResponseKind
    request_id: str
    model: str
    created: int
    stop: tuple[str, ...] = ()
    include_usage: bool = False
    logprobs: int | None = None  # alternatives per token when the response reports log-probabilities

    def to_metadata(self) -> dict:
        return {"response": {**asdict(self), "stop": list(self.stop)}}

    @classmethod
    def from_metadata(cls, metadata: dict) -> ResponseSpec:
        d = metadata.get("response")
        if not isinstance(d, dict):
            raise ValueError("the request carries no gateway response fields (not submitted by a gateway)")  # noqa: TRY004
        try:
            return cls(kind=d["kind"], request_id=d["request_id"], model=d["model"], created=int(d["created"]),
                       stop=tuple(d.get("stop") or ()), include_usage=bool(d.get("include_usage")),
                       logprobs=None if d.get("logprobs") is None else int(d["logprobs"]))
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"malformed gateway response fields: {e!r}") from None


def usage(stats: OutputStats | None) -> Usage:
    if stats is None:
        return Usage(prompt_tokens=0, completion_tokens=0, total_tokens=0)
    return Usage(prompt_tokens=stats.prompt_tokens, completion_tokens=stats.completion_tokens,
                 total_tokens=stats.prompt_tokens + stats.completion_tokens)


def speculative(stats: OutputStats | None) -> SpeculativeStats | None:
    if stats is None:
        return None
    return SpeculativeStats(rounds=stats.rounds, mean_accepted_length=stats.mean_accepted_length,
                            draft_tokens=stats.draft_tokens, accepted_tokens=stats.accepted_tokens)


def event_error(event: OutputEvent) -> ApiError:
    """The API error of a request that ended in error or was cancelled."""
    if event.finish_reason == "cancelled":
        return ApiError(503, "the request was cancelled before it finished", type="server_error", code="request_cancelled")
    if event.error is not None and event.error.kind == "invalid_request":
        return ApiError(400, event.error.message)
    return ApiError(500, event.error.message if event.error else "generation failed", type="server_error")


# ---- non-streamed ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Collected:
    text: str
    finish_reason: str  # "stop" | "length"
    stats: OutputStats | None
    reached_final_event: bool  # False when a stop string ended it first: the generation must be cancelled
    logprobs: list[TokenEntry] | None = None  # one per reported token, when the request asked for them


class _Output:
    """A response's text and, if asked for, its token entries: each event's tokens in, the text
    and the entries handed out for it (gateway/logprobs.py) out."""

    def __init__(self, spec: ResponseSpec, tokenizer: Detokenizer):
        self.detok = TextStream(tokenizer.decode, spec.stop)
        self.aligner = TokenAligner(tokenizer) if spec.logprobs is not None else None

    def push(self, event: OutputEvent) -> tuple[str, list[TokenEntry]]:
        text = self.detok.push(event.token_ids)
        if self.aligner is not None:
            self.aligner.push(event.token_ids, event.logprobs)
        if not self.detok.stopped and event.final:
            text += self.detok.finish()
        entries = []
        if self.aligner is not None:  # the end of a generation releases the rest, unless a stop string cut it
            entries = self.aligner.release(len(self.detok.text), end=event.final and not self.detok.stopped)
        return text, entries


async def collect_text(events: AsyncIterator[OutputEvent], spec: ResponseSpec, tokenizer: Detokenizer) -> Collected:
    """Run a request's events to the end (or its first stop string); raises ApiError on a failed request."""
    output = _Output(spec, tokenizer)
    entries: list[TokenEntry] | None = None if output.aligner is None else []
    async for event in events:
        if event.finish_reason in ("error", "cancelled"):
            raise event_error(event)
        _, new = output.push(event)
        if entries is not None:
            entries += new
        detok = output.detok
        if detok.stopped:
            return Collected(detok.text, "stop", event.stats, reached_final_event=event.final, logprobs=entries)
        if event.final:
            return Collected(detok.text, event.finish_reason, event.stats, True, logprobs=entries)
    raise ApiError(500, "the request's output stream ended without a final event", type="server_error")


# ---- streamed --------------------------------------------------------------------------------


class ChunkWriter:
    """One streamed response: each bus event in, the `data:` payloads (JSON) it produces out."""

    def __init__(self, spec: ResponseSpec, tokenizer: Detokenizer):
        self.spec = spec
        self.tokenizer = tokenizer
        self.output = _Output(spec, tokenizer)
        self.started = False
        self.done = False  # the response is complete (finish chunk or error sent)

    def chunks(self, event: OutputEvent) -> list[str]:
        if self.done:
            return []
        out = []
        if self.spec.kind == "chat" and not self.started:
            out.append(self._chat(choices=[ChatChunkChoice(delta=ChatDelta(role="assistant", content=""))]))
        self.started = True
        if event.finish_reason in ("error", "cancelled"):
            self.done = True  # text held back (a possible stop-string prefix) is not sent
            return [*out, error_json(event_error(event))]
        text, entries = self.output.push(event)
        finish = "stop" if self.output.detok.stopped else event.finish_reason
        if finish is None:
            if text or entries:
                out.append(self._text(text, entries))
            return out
        self.done = True
        stats = event.stats
        if self.spec.kind == "completion":
            choice = CompletionChoice(text=text, logprobs=self._completion_logprobs(entries), finish_reason=finish)
            out.append(self._completion(choices=[choice], speculative=speculative(stats)))
        else:
            if text or entries:
                out.append(self._text(text, entries))
            out.append(self._chat(choices=[ChatChunkChoice(delta=ChatDelta(), finish_reason=finish)], speculative=speculative(stats)))
        if self.spec.include_usage:
            make = self._completion if self.spec.kind == "completion" else self._chat
            out.append(make(choices=[], usage=usage(stats), speculative=speculative(stats)))
        return out

    def _text(self, text: str, entries: list[TokenEntry]) -> str:
        if self.spec.kind == "completion":
            return self._completion(choices=[CompletionChoice(text=text, logprobs=self._completion_logprobs(entries))])
        logprobs = None if self.spec.logprobs is None else chat_logprobs(entries, self.tokenizer)
        return self._chat(choices=[ChatChunkChoice(delta=ChatDelta(content=text), logprobs=logprobs)])

    def _completion_logprobs(self, entries: list[TokenEntry]):
        return None if self.spec.logprobs is None else completion_logprobs(entries, self.tokenizer)

    def _completion(self, **fields) -> str:
        s = self.spec
        return CompletionResponse(id=s.request_id, model=s.model, created=s.created, **fields).model_dump_json()

    def _chat(self, **fields) -> str:
        s = self.spec
        return ChatCompletionChunk(id=s.request_id, model=s.model, created=s.created, **fields).model_dump_json()
