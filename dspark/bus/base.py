"""The bus interface between gateway replicas and schedulers, shared by the in-memory and Redis buses.

Gateway side: `submit` a request, `tail` its output events from a position (resumable: an SSE
client's Last-Event-ID names one), `cancel` it, `lookup` a submitted request (to resume a
response on another replica).

Worker side (dspark/bus/worker.py): `consume` requests as one consumer of a group, `publish`
output events, `ack` a request when its last event is out, `keep_alive` the requests it is
working on; requests whose consumer stopped keeping them alive for `claim_idle_s` are handed to
another consumer by `consume` (re-claimed). Cancel signals arrive on `subscribe_cancellations`
and are also kept for `is_cancelled`.

Round view (gateway/round_view.py, docs/round-view.md): gateways `watch_rounds`, and while one does
`rounds_watched` is True (until `round_watch_ttl_s` after it stops), so the worker side
`publish_rounds` the engine's round events then and only then. The round channel keeps the last
`max_round_messages` messages: a reader further behind loses the oldest (it sees the round ids skip).

Exactly-once output rests on two rules every implementation enforces:
  1. Fencing: each delivery of a request bumps its ownership `epoch`; `publish` refuses (with
     LostOwnership) a delivery whose epoch is no longer the current one, so a consumer that was
     presumed dead and comes back cannot write to a stream that another consumer took over.
  2. Contiguity: `publish` refuses an event whose `offset` is not the number of tokens already
     on the stream; a delivery carries what was published (`Delivery.published`), from which the
     new owner continues.
"""

from __future__ import annotations

import abc
from collections.abc import AsyncIterator
from dataclasses import dataclass

from dspark.bus.messages import BusRequest, OutputEvent, OutputStats

__all__ = [
    "Bus", "BusFull", "BusUnavailable", "CancelSubscription", "Delivery", "DuplicateRequest", "LostOwnership", "Published",
    "UnknownRequest",
]


class BusFull(RuntimeError):
    """The request stream holds its maximum number of requests: retry later (HTTP 503)."""


class BusUnavailable(ConnectionError):
    """The bus cannot be reached now (its server restarts, the connection was lost): retry later.
    A subclass of the built-in ConnectionError, so callers that handle that (HTTP 503) handle this."""


class DuplicateRequest(ValueError):
    """A request with this id was already submitted (and has not expired)."""


class UnknownRequest(LookupError):
    """No such request on the bus: never submitted, or expired after its TTL."""


class LostOwnership(RuntimeError):
    """Another consumer took this request over (or it expired): stop working on it, do not ack it."""


@dataclass(frozen=True)
class Published:
    """What a request's output stream already holds when a consumer receives it."""

    token_ids: list[int]  # [num_published] completion tokens in order (all of them unless `trimmed`)
    stats: OutputStats | None  # of the last event, if any
    finished: bool  # its last event (finish_reason set) is on the stream
    trimmed: bool = False  # the stream's maximum length cut early events: token_ids is incomplete

    @classmethod
    def of(cls, events: list[OutputEvent]) -> Published:
        trimmed = bool(events) and events[0].offset != 0
        tokens = [t for e in events for t in e.token_ids]
        stats = next((e.stats for e in reversed(events) if e.stats is not None), None)
        return cls(token_ids=tokens, stats=stats, finished=any(e.final for e in events), trimmed=trimmed)


@dataclass(frozen=True)
class Delivery:
    """One request handed to one consumer."""

    request: BusRequest
    entry_id: str  # the request's id in the request stream (what `ack` and `keep_alive` name)
    consumer: str
    epoch: int  # ownership generation; publishes need the current one
    published: Published


class CancelSubscription(abc.ABC):
    """Request ids cancelled after the subscription started, as they arrive."""

    def __aiter__(self) -> CancelSubscription:
        return self

    @abc.abstractmethod
    async def __anext__(self) -> str: ...

    @abc.abstractmethod
    async def close(self) -> None: ...


class Bus(abc.ABC):
    """See the module docstring. Every method may raise ConnectionError-like errors of the transport."""

    claim_idle_s: float  # a pending request not kept alive for this long is re-claimed
    finished_ttl_s: float  # a finished request's output stream and record live this long
    round_watch_ttl_s: float  # rounds stay watched this long after the last watcher stopped
    max_round_messages: int  # the round channel's length

    # ---- gateway side ----

    @abc.abstractmethod
    async def submit(self, request: BusRequest) -> None:
        """Queue a request for the schedulers; raises BusFull, DuplicateRequest."""

    @abc.abstractmethod
    def tail(self, request_id: str, *, after: str | None = None) -> AsyncIterator[OutputEvent]:
        """The request's output events after event id `after` (None: from the first), waiting for
        new ones; ends after the final event (at once if `after` is the final event). Raises
        UnknownRequest, or ValueError for a malformed `after`, on the first iteration."""

    @abc.abstractmethod
    async def cancel(self, request_id: str) -> None:
        """Signal that nobody wants the request any more (unknown or finished ids are fine)."""

    @abc.abstractmethod
    async def lookup(self, request_id: str) -> BusRequest | None:
        """The submitted request, or None if unknown or expired."""

    @abc.abstractmethod
    async def queue_depth(self) -> int:
        """Requests submitted and not yet acknowledged (waiting or being worked on)."""

    # ---- worker side ----

    @abc.abstractmethod
    async def consume(self, consumer: str, *, max_count: int, block_s: float) -> list[Delivery]:
        """Up to `max_count` requests for `consumer`: re-claimed ones (idle > claim_idle_s) first,
        then new ones, waiting up to `block_s` seconds for some. Each delivery bumps the epoch."""

    @abc.abstractmethod
    async def publish(self, delivery: Delivery, event: OutputEvent) -> str:
        """Append an event to the request's output stream and return its event id; raises
        LostOwnership if the delivery is stale or the request expired, ValueError if
        `event.offset` does not continue the stream. The final event starts the TTL."""

    @abc.abstractmethod
    async def ack(self, delivery: Delivery) -> None:
        """The request is done (its final event is published): remove it from the request stream."""

    @abc.abstractmethod
    async def keep_alive(self, consumer: str, entry_ids: list[str]) -> None:
        """Reset the idle time of these requests if `consumer` still owns them."""

    @abc.abstractmethod
    async def is_cancelled(self, request_id: str) -> bool: ...

    @abc.abstractmethod
    async def subscribe_cancellations(self) -> CancelSubscription:
        """Start receiving cancel signals (returns once subscribed, so none sent later is missed)."""

    # ---- the round view ----

    @abc.abstractmethod
    def watch_rounds(self) -> AsyncIterator[list[str]]:
        """Batches of round messages (JSON, the wire form of dspark/observability/round_feed.py)
        published after the iteration began, in order, waiting for new ones; while it is being
        iterated the rounds are watched (a reader must keep asking for the next batch). A transport outage is waited out, not raised (the round view is
        best-effort: it never fails a caller)."""

    @abc.abstractmethod
    async def rounds_watched(self) -> bool:
        """Whether a gateway watches the rounds (worker side: publish them only then)."""

    @abc.abstractmethod
    async def publish_rounds(self, messages: list[str]) -> None:
        """Append round messages to the round channel (bounded: the oldest beyond max_round_messages go)."""

    async def close(self) -> None:
        """Release connections (no-op by default)."""
