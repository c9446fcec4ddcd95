"""What travels on the bus: a request (gateway -> scheduler) and its output events (scheduler -> gateway).

Both are small frozen dataclasses with a JSON wire form (`to_json` / `from_json`), validated when
built, so that a malformed message fails with a ValueError naming the field instead of deep in a
worker. They mirror `dspark.engine.speculative.GenerationRequest` and
`dspark.engine.async_engine.GenerationDelta` / `GenerationStats` field for field, without
importing the engine (the bus sits below it).

Positions. An output event carries `offset`, the number of completion tokens published before
it, so the token sequence of a request is the concatenation of its events and a re-claimed
request can continue from exactly where the output stream ends (see dspark/bus/worker.py).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from dspark.sampling.logprobs import MAX_LOGPROBS, TokenLogprobs
from dspark.sampling.params import SamplingParams

__all__ = [
    "FINISH_REASONS",
    "MAX_REQUEST_ID_LEN",
    "BusRequest",
    "EventError",
    "OutputEvent",
    "OutputStats",
    "is_valid_traceparent",
]

MAX_REQUEST_ID_LEN = 256
# "stop" / "length" as the engine reports them; "cancelled" after a cancel signal; "error" with `error` set.
FINISH_REASONS = ("stop", "length", "cancelled", "error")
ERROR_KINDS = ("invalid_request", "server")

_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:#-]+$")  # no "/" (the gateway's SSE ids use it) and nothing to escape in a key
# W3C trace context, version 00: version-traceid-parentid-flags, lowercase hex, ids not all zero.
_TRACEPARENT = re.compile(r"^[0-9a-f]{2}-(?!0{32})[0-9a-f]{32}-(?!0{16})[0-9a-f]{16}-[0-9a-f]{2}$")


def is_valid_traceparent(value: str) -> bool:
    """True for a well-formed W3C `traceparent` header value (version ff is invalid by the spec)."""
    return bool(_TRACEPARENT.match(value)) and not value.startswith("ff")


def check_request_id(request_id: object) -> str:
    if not isinstance(request_id, str) or not request_id:
        raise ValueError(f"request_id must be a non-empty string, got {request_id!r}")
    if len(request_id) > MAX_REQUEST_ID_LEN or not _REQUEST_ID.match(request_id):
        raise ValueError(
            f"request_id must be at most {MAX_REQUEST_ID_LEN} characters of [A-Za-z0-9._:#-], got {request_id[:80]!r}"
        )
    return request_id


def _token_list(name: str, value: object, *, allow_empty: bool) -> list[int]:
    if not isinstance(value, (list, tuple, frozenset, set)):
        raise ValueError(f"{name} must be a list of token ids, got {type(value).__name__}")  # noqa: TRY004 - a malformed message is a ValueError at this boundary
    ids = list(value)
    if not allow_empty and not ids:
        raise ValueError(f"{name} is empty; at least one token is needed")
    bad = [t for t in ids if not isinstance(t, int) or isinstance(t, bool) or t < 0]
    if bad:
        raise ValueError(f"{name} must be non-negative integers, got {bad[:5]}")
    return ids


@dataclass(frozen=True)
class BusRequest:
    """A generation the gateway hands to the schedulers (one entry of the request stream)."""

    request_id: str
    prompt_ids: list[int]  # [num_prompt_tokens]
    max_new_tokens: int
    params: SamplingParams = field(default_factory=SamplingParams)
    stop_token_ids: frozenset[int] = frozenset()
    traceparent: str | None = None  # W3C trace context of the gateway's span, for observability to continue
    # The gateway's own fields (response kind, stop strings, ...): opaque to the bus and the worker,
    # kept so that any gateway replica can resume the response (Last-Event-ID). JSON values only.
    metadata: dict[str, Any] = field(default_factory=dict)
    logprobs: int | None = None  # alternatives per token of the emitted tokens' logprobs (GenerationRequest's); None: none

    def __post_init__(self) -> None:
        check_request_id(self.request_id)
        object.__setattr__(self, "prompt_ids", _token_list("prompt_ids", self.prompt_ids, allow_empty=False))
        object.__setattr__(self, "stop_token_ids", frozenset(_token_list("stop_token_ids", self.stop_token_ids, allow_empty=True)))
        if not isinstance(self.max_new_tokens, int) or isinstance(self.max_new_tokens, bool) or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an integer >= 1, got {self.max_new_tokens!r}")
        if not isinstance(self.params, SamplingParams):
            raise ValueError(f"params must be SamplingParams, got {type(self.params).__name__}")  # noqa: TRY004 - a malformed message is a ValueError at this boundary
        if self.traceparent is not None and not (isinstance(self.traceparent, str) and is_valid_traceparent(self.traceparent)):
            raise ValueError(f"traceparent must be a W3C traceparent header value, got {self.traceparent!r}")
        if not isinstance(self.metadata, dict):
            raise ValueError(f"metadata must be a dict, got {type(self.metadata).__name__}")  # noqa: TRY004 - a malformed message is a ValueError at this boundary
        if self.logprobs is not None and not (isinstance(self.logprobs, int) and not isinstance(self.logprobs, bool)
                                              and 0 <= self.logprobs <= MAX_LOGPROBS):
            raise ValueError(f"logprobs must be None or an integer in [0, {MAX_LOGPROBS}], got {self.logprobs!r}")

    def to_json(self) -> str:
        p = self.params
        return json.dumps({
            "v": 1,
            "request_id": self.request_id,
            "prompt_ids": self.prompt_ids,
            "max_new_tokens": self.max_new_tokens,
            "params": {"temperature": p.temperature, "top_p": p.top_p, "top_k": p.top_k, "seed": p.seed},
            "stop_token_ids": sorted(self.stop_token_ids),
            "traceparent": self.traceparent,
            "metadata": self.metadata,
            "logprobs": self.logprobs,
        }, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str | bytes) -> BusRequest:
        d = _load_object(text, "request")
        try:
            params = d.get("params") or {}
            if not isinstance(params, dict):
                raise ValueError(f"params must be an object, got {type(params).__name__}")  # noqa: TRY004 - a malformed message is a ValueError at this boundary
            return cls(
                request_id=d["request_id"],
                prompt_ids=d["prompt_ids"],
                max_new_tokens=d["max_new_tokens"],
                params=SamplingParams(
                    temperature=float(params.get("temperature", 1.0)),
                    top_p=float(params.get("top_p", 1.0)),
                    top_k=params.get("top_k", 0),  # validated by SamplingParams: an integer, not truncated
                    seed=params.get("seed"),
                ),
                stop_token_ids=d.get("stop_token_ids", []),
                traceparent=d.get("traceparent"),
                metadata=d.get("metadata") or {},
                logprobs=d.get("logprobs"),
            )
        except KeyError as e:
            raise ValueError(f"bus request is missing the field {e.args[0]!r}") from None
        except TypeError as e:
            raise ValueError(f"bus request has a field of the wrong type: {e}") from None


@dataclass(frozen=True)
class OutputStats:
    """Cumulative per-request statistics as of an event (GenerationStats' fields, any producer)."""

    prompt_tokens: int
    completion_tokens: int
    rounds: int  # decode rounds (the prefill that samples the first token is not one)
    mean_accepted_length: float  # tokens emitted per decode round
    draft_tokens: int
    accepted_tokens: int

    @classmethod
    def of(cls, stats: Any) -> OutputStats:
        """From any object with these attributes (GenerationStats)."""
        return cls(**{f: getattr(stats, f) for f in cls.__dataclass_fields__})

    def continued_by(self, later: OutputStats, *, prompt_tokens: int, completion_offset: int) -> OutputStats:
        """These stats (a first run that published `completion_offset` tokens) followed by those of
        a continuation whose prompt was the original prompt plus those tokens."""
        rounds = self.rounds + later.rounds
        emitted = self.mean_accepted_length * self.rounds + later.mean_accepted_length * later.rounds
        return OutputStats(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_offset + later.completion_tokens,
            rounds=rounds,
            mean_accepted_length=emitted / rounds if rounds else 0.0,
            draft_tokens=self.draft_tokens + later.draft_tokens,
            accepted_tokens=self.accepted_tokens + later.accepted_tokens,
        )


@dataclass(frozen=True)
class EventError:
    """Why a request failed: `invalid_request` (the request cannot be served: a 4xx) or `server`."""

    kind: str
    message: str

    def __post_init__(self) -> None:
        if self.kind not in ERROR_KINDS:
            raise ValueError(f"error kind must be one of {ERROR_KINDS}, got {self.kind!r}")


@dataclass(frozen=True)
class OutputEvent:
    """Tokens a request emitted (one engine round), or the request's end.

    The last event of a request has `finish_reason` set; nothing is published after it."""

    offset: int  # completion tokens published before this event's tokens
    token_ids: list[int]  # [num_new_tokens], may be empty (the first event says the request was accepted)
    finish_reason: str | None = None  # one of FINISH_REASONS on the last event, None before
    stats: OutputStats | None = None
    error: EventError | None = None  # set iff finish_reason == "error"
    event_id: str = ""  # position in the request's output stream, assigned by the bus on publishing
    logprobs: TokenLogprobs | None = None  # one entry per token of token_ids, iff the request asked for logprobs

    def __post_init__(self) -> None:
        if not isinstance(self.offset, int) or self.offset < 0:
            raise ValueError(f"offset must be an integer >= 0, got {self.offset!r}")
        object.__setattr__(self, "token_ids", _token_list("token_ids", self.token_ids, allow_empty=True))
        if self.finish_reason is not None and self.finish_reason not in FINISH_REASONS:
            raise ValueError(f"finish_reason must be one of {FINISH_REASONS} or None, got {self.finish_reason!r}")
        if (self.finish_reason == "error") != (self.error is not None):
            raise ValueError("an event carries an error exactly when its finish_reason is 'error'")
        if self.logprobs is not None:
            if not isinstance(self.logprobs, TokenLogprobs):
                raise ValueError(f"logprobs must be TokenLogprobs, got {type(self.logprobs).__name__}")  # noqa: TRY004 - a malformed message is a ValueError at this boundary
            if len(self.logprobs) != len(self.token_ids):
                raise ValueError(f"logprobs must have one entry per token: {len(self.logprobs)} for {len(self.token_ids)} tokens")

    @property
    def final(self) -> bool:
        return self.finish_reason is not None

    @property
    def end(self) -> int:
        """Completion tokens published up to and including this event."""
        return self.offset + len(self.token_ids)

    def to_json(self) -> str:
        return json.dumps({
            "offset": self.offset,
            "token_ids": self.token_ids,
            "finish_reason": self.finish_reason,
            "stats": None if self.stats is None else self.stats.__dict__,
            "error": None if self.error is None else self.error.__dict__,
            "logprobs": None if self.logprobs is None else self.logprobs.__dict__,
        }, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str | bytes, *, event_id: str = "") -> OutputEvent:
        d = _load_object(text, "output event")
        try:
            stats, error, logprobs = d.get("stats"), d.get("error"), d.get("logprobs")
            return cls(
                offset=d["offset"],
                token_ids=d["token_ids"],
                finish_reason=d.get("finish_reason"),
                stats=None if stats is None else OutputStats(**stats),
                error=None if error is None else EventError(**error),
                event_id=event_id,
                logprobs=None if logprobs is None else TokenLogprobs(**logprobs),
            )
        except KeyError as e:
            raise ValueError(f"output event is missing the field {e.args[0]!r}") from None
        except TypeError as e:
            raise ValueError(f"output event has a field of the wrong type: {e}") from None


def _load_object(text: str | bytes, what: str) -> dict:
    try:
        d = json.loads(text)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{what} is not valid JSON: {e}") from None
    if not isinstance(d, dict):
        raise ValueError(f"{what} must be a JSON object, got {type(d).__name__}")  # noqa: TRY004 - a malformed message is a ValueError at this boundary
    return d
