"""The in-process bus of the embedded mode (`dspark serve`): the Bus interface on Python objects.

It has the Redis bus's semantics (consumer group with pending requests and re-claiming, epoch
fencing, offsets, TTLs, maximum lengths, cancel signals), so the worker and the gateway run the
same code in both modes and one behavioural test-suite covers both (tests/bus).

Threads and event loops: all state sits behind one threading.Lock, and a coroutine waiting for
something registers a future of its own event loop that is woken with `call_soon_threadsafe`.
So the gateway (uvicorn's loop) and the worker (its own thread and loop, see
`dspark.bus.worker.start_worker_thread`) share one MemoryBus. Expired entries are swept lazily,
on the next call.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace

from dspark.bus.base import (
    Bus,
    BusFull,
    CancelSubscription,
    Delivery,
    DuplicateRequest,
    LostOwnership,
    Published,
    UnknownRequest,
)
from dspark.bus.messages import BusRequest, OutputEvent

__all__ = ["MemoryBus"]


class _Waiters:
    """Futures of coroutines on any event loops, woken together from any thread."""

    def __init__(self) -> None:
        self._futures: list[tuple[asyncio.AbstractEventLoop, asyncio.Future]] = []

    def add(self) -> asyncio.Future:
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self._futures.append((loop, fut))
        return fut

    def wake_all(self) -> None:
        futures, self._futures = self._futures, []
        for loop, fut in futures:
            try:
                loop.call_soon_threadsafe(_resolve, fut)
            except RuntimeError:  # that loop is closed: nobody is waiting any more
                pass


def _resolve(fut: asyncio.Future) -> None:
    if not fut.done():
        fut.set_result(None)


async def _wait(fut: asyncio.Future, timeout: float | None) -> bool:
    """Wait for a waiter future; False on timeout. (Not asyncio.wait_for: in Python 3.11 it can
    swallow a cancellation that arrives as the future completes, and a cancelled worker must stop.)"""
    try:
        done, _ = await asyncio.wait({fut}, timeout=timeout)
    finally:
        if not fut.done():
            fut.cancel()
    return bool(done)


@dataclass(eq=False)
class _Entry:
    entry_id: str
    request: BusRequest
    consumer: str | None = None  # None until delivered
    delivered_at: float = 0.0  # monotonic time of the last delivery or keep-alive


@dataclass(eq=False)
class _Output:
    request: BusRequest
    events: deque  # [OutputEvent], at most max_stream_len
    expires_at: float
    epoch: int = 0
    offset: int = 0  # completion tokens published
    next_seq: int = 1
    finished: bool = False
    waiters: _Waiters = field(default_factory=_Waiters)


class _MemoryCancelSubscription(CancelSubscription):
    def __init__(self, bus: MemoryBus):
        self._bus = bus
        self._pending: deque[str] = deque()
        self._waiters = _Waiters()
        self.closed = False

    def _push(self, request_id: str) -> None:  # under the bus lock
        self._pending.append(request_id)
        self._waiters.wake_all()

    async def __anext__(self) -> str:
        while True:
            with self._bus._lock:
                if self.closed:
                    raise StopAsyncIteration
                if self._pending:
                    return self._pending.popleft()
                fut = self._waiters.add()
            await _wait(fut, None)

    async def close(self) -> None:
        with self._bus._lock:
            self.closed = True
            self._bus._subscriptions.discard(self)
            self._waiters.wake_all()


class MemoryBus(Bus):
    def __init__(
        self,
        *,
        claim_idle_s: float = 30.0,
        finished_ttl_s: float = 600.0,
        pending_ttl_s: float = 86400.0,  # an unfinished request's record, refreshed by every publish
        cancel_ttl_s: float = 600.0,
        max_queue: int = 10_000,  # requests submitted and not yet acknowledged
        max_stream_len: int = 100_000,  # events kept per output stream (the oldest are dropped)
        max_round_messages: int = 1000,  # round messages kept for slow watchers (the oldest are dropped)
        round_watch_ttl_s: float = 5.0,  # rounds stay watched this long after the last watcher left
    ):
        for name, value in (("claim_idle_s", claim_idle_s), ("finished_ttl_s", finished_ttl_s),
                            ("pending_ttl_s", pending_ttl_s), ("cancel_ttl_s", cancel_ttl_s)):
            if not value > 0:
                raise ValueError(f"{name} must be > 0, got {value}")
        if max_queue < 1 or max_stream_len < 1 or max_round_messages < 1:
            raise ValueError(f"max_queue, max_stream_len and max_round_messages must be >= 1, got {max_queue}, "
                             f"{max_stream_len}, {max_round_messages}")
        if not round_watch_ttl_s > 0:
            raise ValueError(f"round_watch_ttl_s must be > 0, got {round_watch_ttl_s}")
        self.claim_idle_s = claim_idle_s
        self.finished_ttl_s = finished_ttl_s
        self.pending_ttl_s = pending_ttl_s
        self.cancel_ttl_s = cancel_ttl_s
        self.max_queue = max_queue
        self.max_stream_len = max_stream_len
        self._lock = threading.Lock()
        self._entries: dict[str, _Entry] = {}  # submitted, not acknowledged; insertion order = stream order
        self._next_entry = 1
        self._new_entries = _Waiters()
        self._outputs: dict[str, _Output] = {}
        self._cancelled: dict[str, float] = {}  # request id -> expiry
        self._subscriptions: set[_MemoryCancelSubscription] = set()
        self._sweep_every_s = min(1.0, claim_idle_s, finished_ttl_s, cancel_ttl_s) / 4
        self._next_sweep = 0.0
        self.max_round_messages, self.round_watch_ttl_s = max_round_messages, round_watch_ttl_s
        self._rounds: deque[str] = deque(maxlen=max_round_messages)
        self._rounds_published = 0  # messages ever published: the sequence number of the newest
        self._round_waiters = _Waiters()
        self._round_watchers = 0
        self._rounds_watched_until = 0.0  # monotonic: the last watcher left at this time + round_watch_ttl_s

    # ---- gateway side ----------------------------------------------------------------------

    async def submit(self, request: BusRequest) -> None:
        with self._lock:
            now = self._sweep()
            if self._output(request.request_id, now) is not None:
                raise DuplicateRequest(f"request id {request.request_id!r} was already submitted")
            if len(self._entries) >= self.max_queue:
                raise BusFull(f"the request queue is full ({self.max_queue} requests)")
            entry_id = str(self._next_entry)
            self._next_entry += 1
            self._entries[entry_id] = _Entry(entry_id, request)
            self._outputs[request.request_id] = _Output(request, deque(maxlen=self.max_stream_len), now + self.pending_ttl_s)
            self._new_entries.wake_all()

    async def tail(self, request_id: str, *, after: str | None = None) -> AsyncIterator[OutputEvent]:
        position = _parse_event_id(after)
        with self._lock:
            out = self._output(request_id, self._sweep())
            if out is None:
                raise UnknownRequest(f"no request {request_id!r} on the bus (never submitted, or expired)")
        while True:
            with self._lock:
                new = [e for e in out.events if int(e.event_id) > position]
                if not new and out.finished:
                    return  # resumed after the last event
                fut = None if new else out.waiters.add()
            for event in new:
                position = int(event.event_id)
                yield event
                if event.final:
                    return
            if fut is not None:
                await _wait(fut, None)

    async def cancel(self, request_id: str) -> None:
        with self._lock:
            self._cancelled[request_id] = time.monotonic() + self.cancel_ttl_s
            for sub in self._subscriptions:
                sub._push(request_id)

    async def lookup(self, request_id: str) -> BusRequest | None:
        with self._lock:
            out = self._output(request_id, self._sweep())
            return None if out is None else out.request

    async def queue_depth(self) -> int:
        with self._lock:
            return len(self._entries)

    # ---- worker side -----------------------------------------------------------------------

    async def consume(self, consumer: str, *, max_count: int, block_s: float) -> list[Delivery]:
        if max_count < 1:
            raise ValueError(f"max_count must be >= 1, got {max_count}")
        deadline = time.monotonic() + max(block_s, 0.0)
        while True:
            with self._lock:
                now = self._sweep()
                # Re-claimed first (idle pending entries of any consumer), then never delivered ones.
                idle = [e for e in self._entries.values()
                        if e.consumer is not None and now - e.delivered_at >= self.claim_idle_s]
                fresh = [e for e in self._entries.values() if e.consumer is None]
                deliveries = []
                for entry in (idle + fresh)[:max_count]:
                    delivery = self._deliver(entry, consumer, now)
                    if delivery is not None:
                        deliveries.append(delivery)
                if deliveries:
                    return deliveries
                remaining = deadline - now
                if remaining <= 0:
                    return []
                fut = self._new_entries.add()
            # Also wake up when the block ends or an idle entry may have become claimable.
            await _wait(fut, min(remaining, self.claim_idle_s))

    def _deliver(self, entry: _Entry, consumer: str, now: float) -> Delivery | None:
        out = self._output(entry.request.request_id, now)
        if out is None:  # its record expired: nothing can be published for it any more
            del self._entries[entry.entry_id]
            return None
        entry.consumer, entry.delivered_at = consumer, now
        out.epoch += 1
        return Delivery(request=entry.request, entry_id=entry.entry_id, consumer=consumer, epoch=out.epoch,
                        published=Published.of(list(out.events)))

    async def publish(self, delivery: Delivery, event: OutputEvent) -> str:
        rid = delivery.request.request_id
        with self._lock:
            now = self._sweep()
            out = self._output(rid, now)
            if out is None:
                raise LostOwnership(f"request {rid!r} expired")
            if out.epoch != delivery.epoch or out.finished:
                raise LostOwnership(f"request {rid!r} was taken over (epoch {out.epoch}, ours {delivery.epoch})"
                                    if not out.finished else f"request {rid!r} already finished")
            if event.offset != out.offset:
                raise ValueError(f"event offset {event.offset} does not continue the output stream of {rid!r} "
                                 f"({out.offset} tokens published)")
            event_id = str(out.next_seq)
            out.next_seq += 1
            out.events.append(_with_id(event, event_id))
            out.offset = event.end
            out.finished = event.final
            out.expires_at = now + (self.finished_ttl_s if event.final else self.pending_ttl_s)
            out.waiters.wake_all()
            return event_id

    async def ack(self, delivery: Delivery) -> None:
        with self._lock:
            self._entries.pop(delivery.entry_id, None)

    async def keep_alive(self, consumer: str, entry_ids: list[str]) -> None:
        with self._lock:
            now = time.monotonic()
            for entry_id in entry_ids:
                entry = self._entries.get(entry_id)
                if entry is not None and entry.consumer == consumer:
                    entry.delivered_at = now

    async def is_cancelled(self, request_id: str) -> bool:
        with self._lock:
            now = self._sweep()
            return self._cancelled.get(request_id, 0.0) > now

    async def subscribe_cancellations(self) -> CancelSubscription:
        sub = _MemoryCancelSubscription(self)
        with self._lock:
            self._subscriptions.add(sub)
        return sub

    # ---- the round view --------------------------------------------------------------------

    async def watch_rounds(self) -> AsyncIterator[list[str]]:
        with self._lock:
            self._round_watchers += 1
            seen = self._rounds_published
        try:
            while True:
                with self._lock:
                    new = self._rounds_published - seen  # the oldest of them may have left the channel
                    batch = list(itertools.islice(self._rounds, max(0, len(self._rounds) - new), None))
                    seen = self._rounds_published
                    fut = None if batch else self._round_waiters.add()
                if batch:
                    yield batch
                else:
                    await _wait(fut, None)
        finally:
            with self._lock:
                self._round_watchers -= 1
                self._rounds_watched_until = time.monotonic() + self.round_watch_ttl_s

    async def rounds_watched(self) -> bool:
        with self._lock:
            return self._round_watchers > 0 or time.monotonic() < self._rounds_watched_until

    async def publish_rounds(self, messages: list[str]) -> None:
        with self._lock:
            self._rounds.extend(messages)
            self._rounds_published += len(messages)
            self._round_waiters.wake_all()

    # ---- expiry ----------------------------------------------------------------------------

    def _sweep(self) -> float:
        """Drop expired outputs and cancel flags (under the lock), at most every `_sweep_every_s`;
        returns now. Single lookups check expiry themselves (`_output`), so this only bounds memory."""
        now = time.monotonic()
        if now < self._next_sweep:
            return now
        self._next_sweep = now + self._sweep_every_s
        for rid in [rid for rid, out in self._outputs.items() if out.expires_at <= now]:
            del self._outputs[rid]
        for rid in [rid for rid, t in self._cancelled.items() if t <= now]:
            del self._cancelled[rid]
        return now

    def _output(self, request_id: str, now: float) -> _Output | None:
        out = self._outputs.get(request_id)
        if out is not None and out.expires_at <= now:
            del self._outputs[request_id]
            return None
        return out


def _with_id(event: OutputEvent, event_id: str) -> OutputEvent:
    return replace(event, event_id=event_id)  # every other field as published


def _parse_event_id(after: str | None) -> int:
    if after is None:
        return 0
    if not (isinstance(after, str) and after.isdigit()):
        raise ValueError(f"event id {after!r} is not an event id of this bus (a decimal number)")
    return int(after)
