"""The bus of the distributed mode: Redis Streams between gateway replicas and schedulers.

    bus = RedisBus.from_url("redis://127.0.0.1:6379/0", prefix="dspark")

Keys (`{rid}` in braces is a hash tag: a request's keys share one cluster slot):

    {prefix}:requests            stream of submitted requests; consumer group `{group}`
    {prefix}:state:{rid}         hash: request (JSON), epoch, offset, finished
    {prefix}:out:{rid}           stream of the request's output events (field `event`, JSON)
    {prefix}:cancel:{rid}        cancel flag (with a TTL), plus a message on channel {prefix}:cancel
    {prefix}:rounds              stream of round messages (field `m`, JSON), MAXLEN ~max_round_messages
    {prefix}:rounds:watched      flag that a gateway watches the rounds, PX round_watch_ttl_s, refreshed while it does

Request stream: gateways XADD (a Lua script refuses a duplicate id and a full queue);
schedulers XREADGROUP new entries, XAUTOCLAIM entries pending longer than `claim_idle_s` (their
consumer died or stalled), refresh their own entries' idle time while working (XCLAIM to
themselves, only if still theirs), and XACK + XDEL an entry once the request's final event is
out. Every delivery bumps the state's epoch in the same script that reads the output stream
(so the new owner sees everything the old one managed to publish), and publishing is a script
that appends only if the epoch is still the caller's and the event's offset continues the
stream: a presumed-dead consumer that wakes up cannot duplicate or interleave tokens.

Output streams: gateways XREAD BLOCK from an event id (an SSE client's Last-Event-ID); each
publish sets the TTL (`pending_ttl_s` while running, `finished_ttl_s` after the final event) and
trims to about `max_stream_len` events. Standalone Redis: the submit script touches two slots.

Redis restarts. A call that cannot reach Redis raises BusUnavailable (a ConnectionError: the
gateway answers 503). A tail, a publish and an ack retry instead, for up to `reconnect_timeout_s`,
so that streams in flight go on once Redis is back: a tail resumes after the last event it
yielded, and a publish whose reply was lost with the connection is not appended twice (the retry
finds the stream already at the event's end). Whether requests survive a restart is Redis's
persistence (AOF or an RDB snapshot); a Redis that lost its data has lost the requests: a publish
then raises LostOwnership and a tail UnknownRequest, and the consumer group is created again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import TypeVar

import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from dspark.bus.base import (
    Bus,
    BusFull,
    BusUnavailable,
    CancelSubscription,
    Delivery,
    DuplicateRequest,
    LostOwnership,
    Published,
    UnknownRequest,
)
from dspark.bus.messages import BusRequest, OutputEvent

__all__ = ["RedisBus"]

log = logging.getLogger(__name__)

_STREAM_ID = re.compile(r"^\d+-\d+$")
T = TypeVar("T")


@contextlib.contextmanager
def _reaching(what: str) -> Iterator[None]:
    """Redis's connection errors (refused, lost, timed out, still loading its data) as BusUnavailable."""
    try:
        yield
    except (RedisConnectionError, RedisTimeoutError) as e:
        if _being_cancelled():  # redis-py drops the connection of a cancelled read: that error is the cancel
            raise asyncio.CancelledError() from e
        raise BusUnavailable(f"{what}: Redis is unreachable: {e}") from None


def _being_cancelled() -> bool:
    """Whether the running task has a cancel pending. A retry loop that took the connection error a
    cancel leaves as an outage would swallow the cancel and retry forever (a hung watcher)."""
    try:
        task = asyncio.current_task()
    except RuntimeError:  # no running event loop
        return False
    return task is not None and task.cancelling() > 0


_REPLY_GRACE_S = 2.0  # a blocking read's reply is overdue this long after its BLOCK timeout


async def _read_within(read: Awaitable[T], due_s: float) -> T:
    """`await read` (a blocking XREAD whose reply is due within `due_s`) in a task of its own.

    A cancel of the caller lands on our wait, not inside redis-py: under anyio, redis-py 8 can lose
    a cancel that lands in a read and then wait forever on its connection (a round watcher that
    never ended hung CI). A reply overdue by _REPLY_GRACE_S is a RedisTimeoutError (an outage:
    the callers retry), and the abandoned read is cancelled and left to end on its own."""
    task = asyncio.ensure_future(read)
    try:
        done, _ = await asyncio.wait({task}, timeout=due_s + _REPLY_GRACE_S)
    finally:
        if not task.done():
            task.cancel()
        task.add_done_callback(_retrieve)  # an abandoned read's error is nobody's: no "never retrieved" warning
    if not done:
        raise RedisTimeoutError(f"no reply {due_s + _REPLY_GRACE_S:.1f} s after a blocking read")
    return task.result()


def _retrieve(task: asyncio.Future) -> None:
    if not task.cancelled():
        task.exception()

# KEYS: requests stream, state hash. ARGV: request JSON, max queue, pending TTL (ms).
_SUBMIT = """
if redis.call('EXISTS', KEYS[2]) == 1 then return redis.error_reply('DSPARK_DUPLICATE') end
if redis.call('XLEN', KEYS[1]) >= tonumber(ARGV[2]) then return redis.error_reply('DSPARK_FULL') end
redis.call('HSET', KEYS[2], 'request', ARGV[1], 'epoch', '0', 'offset', '0', 'finished', '0')
redis.call('PEXPIRE', KEYS[2], ARGV[3])
return redis.call('XADD', KEYS[1], '*', 'request', ARGV[1])
"""

# KEYS: state hash, output stream. Returns {new epoch, all events} or false if the record expired.
_CLAIM = """
if redis.call('EXISTS', KEYS[1]) == 0 then return false end
local epoch = redis.call('HINCRBY', KEYS[1], 'epoch', 1)
return {epoch, redis.call('XRANGE', KEYS[2], '-', '+')}
"""

# KEYS: state hash, output stream. ARGV: epoch, offset, end, final (0/1), event JSON, max len, TTL (ms).
_PUBLISH = """
local st = redis.call('HMGET', KEYS[1], 'epoch', 'offset', 'finished')
if not st[1] then return redis.error_reply('DSPARK_EXPIRED') end
if st[1] ~= ARGV[1] then return redis.error_reply('DSPARK_FENCED current epoch ' .. st[1]) end
if st[3] == '1' then return redis.error_reply('DSPARK_FINISHED') end
if st[2] ~= ARGV[2] then return redis.error_reply('DSPARK_OFFSET ' .. st[2]) end
local id = redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[6], '*', 'event', ARGV[5])
redis.call('HSET', KEYS[1], 'offset', ARGV[3], 'finished', ARGV[4])
redis.call('PEXPIRE', KEYS[1], ARGV[7])
redis.call('PEXPIRE', KEYS[2], ARGV[7])
return id
"""

# KEYS: requests stream. ARGV: group, consumer, entry ids... Refreshes only entries still ours.
_KEEP_ALIVE = """
local n = 0
for i = 3, #ARGV do
  local p = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[i], ARGV[i], 1, ARGV[2])
  if #p > 0 then
    redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[2], 0, ARGV[i], 'JUSTID')
    n = n + 1
  end
end
return n
"""


class _RedisCancelSubscription(CancelSubscription):
    def __init__(self, pubsub):
        self._pubsub = pubsub
        self._closed = False

    async def __anext__(self) -> str:
        while not self._closed:
            with _reaching("cancel subscription"):  # the next read connects and subscribes again
                msg = await self._pubsub.get_message(ignore_subscribe_messages=True, timeout=1.0)
            if msg is not None and msg.get("type") == "message":
                return msg["data"]
        raise StopAsyncIteration

    async def close(self) -> None:
        self._closed = True
        await self._pubsub.aclose()


class RedisBus(Bus):
    def __init__(
        self,
        client: aioredis.Redis,
        *,
        prefix: str = "dspark",
        group: str = "schedulers",
        claim_idle_s: float = 30.0,
        finished_ttl_s: float = 600.0,
        pending_ttl_s: float = 86400.0,
        cancel_ttl_s: float = 600.0,
        max_queue: int = 10_000,
        max_stream_len: int = 100_000,
        # one XREAD BLOCK, under redis-py's 5 s socket timeout (a longer one times out and reconnects);
        # between two, the tail checks that the request still exists
        tail_block_s: float = 2.0,
        reconnect_timeout_s: float = 30.0,  # how long a tail, publish or ack retries while Redis is unreachable
        max_round_messages: int = 1000,  # the round stream's length (about: trimmed with MAXLEN ~)
        round_watch_ttl_s: float = 5.0,  # the watched flag's TTL; a watcher refreshes it every third of that
    ):
        for name, value in (("claim_idle_s", claim_idle_s), ("finished_ttl_s", finished_ttl_s),
                            ("pending_ttl_s", pending_ttl_s), ("cancel_ttl_s", cancel_ttl_s), ("tail_block_s", tail_block_s),
                            ("reconnect_timeout_s", reconnect_timeout_s), ("round_watch_ttl_s", round_watch_ttl_s)):
            if not value > 0:
                raise ValueError(f"{name} must be > 0, got {value}")
        if max_queue < 1 or max_stream_len < 1 or max_round_messages < 1:
            raise ValueError(f"max_queue, max_stream_len and max_round_messages must be >= 1, got {max_queue}, "
                             f"{max_stream_len}, {max_round_messages}")
        if not prefix or any(c in prefix for c in "{} "):
            raise ValueError(f"prefix must be non-empty without braces or spaces, got {prefix!r}")
        self.redis = client
        self.prefix, self.group = prefix, group
        self.claim_idle_s, self.finished_ttl_s = claim_idle_s, finished_ttl_s
        self.pending_ttl_s, self.cancel_ttl_s = pending_ttl_s, cancel_ttl_s
        self.max_queue, self.max_stream_len = max_queue, max_stream_len
        self.tail_block_s = tail_block_s
        self.reconnect_timeout_s = reconnect_timeout_s
        self.requests_key = f"{prefix}:requests"
        self.cancel_channel = f"{prefix}:cancel"
        self.max_round_messages, self.round_watch_ttl_s = max_round_messages, round_watch_ttl_s
        self.rounds_key, self.rounds_watched_key = f"{prefix}:rounds", f"{prefix}:rounds:watched"
        self._submit = client.register_script(_SUBMIT)
        self._claim = client.register_script(_CLAIM)
        self._publish = client.register_script(_PUBLISH)
        self._keep_alive = client.register_script(_KEEP_ALIVE)
        self._group_ready = False
        self._resumed_consumers: set[str] = set()  # consumers whose own pending entries were re-read
        self._autoclaim_cursor = "0-0"
        self._next_autoclaim = 0.0

    @classmethod
    def from_url(cls, url: str, **kwargs) -> RedisBus:
        """A bus on a new client (connections are opened lazily, on the event loop that uses them).

        RESP2 on purpose: with redis-py 8's RESP3 parser, cancelling a task blocked in XREADGROUP
        sometimes leaves it reading a connection forever with the cancellation lost (measured:
        ~10 of 60 cancellations; none of 150 with RESP2), and a worker must stop when cancelled."""
        return cls(aioredis.Redis.from_url(url, decode_responses=True, protocol=2), **kwargs)

    def state_key(self, request_id: str) -> str:
        return f"{self.prefix}:state:{{{request_id}}}"

    def output_key(self, request_id: str) -> str:
        return f"{self.prefix}:out:{{{request_id}}}"

    def cancel_key(self, request_id: str) -> str:
        return f"{self.prefix}:cancel:{{{request_id}}}"

    async def close(self) -> None:
        await self.redis.aclose()

    async def _reconnecting(self, what: str, call: Callable[[], Awaitable[T]]) -> T:
        """`await call()`, again every 0.25 s while Redis is unreachable, for up to reconnect_timeout_s."""
        deadline = None
        while True:
            try:
                with _reaching(what):
                    return await call()
            except BusUnavailable as e:
                now = time.monotonic()
                if deadline is None:
                    deadline = now + self.reconnect_timeout_s
                    log.warning("%s; retrying for up to %.0f s", e, self.reconnect_timeout_s)
                elif now >= deadline:
                    raise
            await asyncio.sleep(0.25)

    async def _ensure_group(self) -> None:
        if self._group_ready:
            return
        try:  # from id 0: requests submitted before any scheduler existed are consumed too
            await self.redis.xgroup_create(self.requests_key, self.group, id="0", mkstream=True)
        except ResponseError as e:
            if "BUSYGROUP" not in str(e):
                raise
        self._group_ready = True

    # ---- gateway side ----------------------------------------------------------------------

    async def submit(self, request: BusRequest) -> None:
        try:
            with _reaching("submit"):
                await self._ensure_group()
                await self._submit(keys=[self.requests_key, self.state_key(request.request_id)],
                                   args=[request.to_json(), self.max_queue, _ms(self.pending_ttl_s)])
        except ResponseError as e:
            if "DSPARK_DUPLICATE" in str(e):
                raise DuplicateRequest(f"request id {request.request_id!r} was already submitted") from None
            if "DSPARK_FULL" in str(e):
                raise BusFull(f"the request queue is full ({self.max_queue} requests)") from None
            raise

    async def tail(self, request_id: str, *, after: str | None = None) -> AsyncIterator[OutputEvent]:
        if after is not None and not (isinstance(after, str) and _STREAM_ID.match(after)):
            raise ValueError(f"event id {after!r} is not a Redis stream id (<ms>-<seq>)")
        out_key, state_key = self.output_key(request_id), self.state_key(request_id)
        where = f"tail of {request_id!r}"
        if not await self._reconnecting(where, lambda: self.redis.exists(state_key, out_key)):
            raise UnknownRequest(f"no request {request_id!r} on the bus (never submitted, or expired)")
        last = after or "0-0"
        # A finished request: read what is left without blocking (possibly nothing, after its last event).
        finished = await self._reconnecting(where, lambda: self.redis.hget(state_key, "finished")) == "1"
        while True:
            block = None if finished else _ms(self.tail_block_s)
            response = await self._reconnecting(
                where, lambda last=last, block=block: _read_within(
                    self.redis.xread({out_key: last}, count=512, block=block), (block or 0) / 1000))
            if not response:
                if finished:
                    return
                if not await self._reconnecting(where, lambda: self.redis.exists(state_key, out_key)):
                    raise UnknownRequest(f"request {request_id!r} expired while being tailed")
                finished = await self._reconnecting(where, lambda: self.redis.hget(state_key, "finished")) == "1"
                continue
            for event_id, fields in response[0][1]:
                last = event_id
                event = OutputEvent.from_json(fields["event"], event_id=event_id)
                yield event
                if event.final:
                    return

    async def cancel(self, request_id: str) -> None:
        with _reaching("cancel"):
            async with self.redis.pipeline(transaction=True) as pipe:
                pipe.set(self.cancel_key(request_id), "1", px=_ms(self.cancel_ttl_s))
                pipe.publish(self.cancel_channel, request_id)
                await pipe.execute()

    async def lookup(self, request_id: str) -> BusRequest | None:
        with _reaching("lookup"):
            text = await self.redis.hget(self.state_key(request_id), "request")
        return None if text is None else BusRequest.from_json(text)

    async def queue_depth(self) -> int:
        with _reaching("queue depth"):
            return int(await self.redis.xlen(self.requests_key))

    # ---- worker side -----------------------------------------------------------------------

    async def consume(self, consumer: str, *, max_count: int, block_s: float) -> list[Delivery]:
        if max_count < 1:
            raise ValueError(f"max_count must be >= 1, got {max_count}")
        try:
            with _reaching("consume"):
                return await self._consume(consumer, max_count=max_count, block_s=block_s)
        except ResponseError as e:
            if "NOGROUP" not in str(e):
                raise
            self._group_ready = False  # Redis restarted without its data: the next call creates the group again
            raise BusUnavailable(f"consume: the consumer group is gone ({e})") from None

    async def _consume(self, consumer: str, *, max_count: int, block_s: float) -> list[Delivery]:
        await self._ensure_group()
        entries: list[tuple[str, dict | None]] = []
        if consumer not in self._resumed_consumers:  # restarted under the same name: our own pending entries
            self._resumed_consumers.add(consumer)
            entries += _entries(await self.redis.xreadgroup(self.group, consumer, {self.requests_key: "0"}, count=max_count))
        now = time.monotonic()
        if len(entries) < max_count and now >= self._next_autoclaim:
            self._next_autoclaim = now + self.claim_idle_s / 4
            cursor, claimed, *_ = await self.redis.xautoclaim(
                self.requests_key, self.group, consumer, min_idle_time=_ms(self.claim_idle_s),
                start_id=self._autoclaim_cursor, count=max_count - len(entries))
            self._autoclaim_cursor = cursor
            entries += [(eid, fields) for eid, fields in claimed]
        if len(entries) < max_count:
            block = _ms(block_s) if not entries and block_s > 0 else None
            entries += _entries(await self.redis.xreadgroup(self.group, consumer, {self.requests_key: ">"},
                                                            count=max_count - len(entries), block=block))
        deliveries = []
        for entry_id, fields in entries:
            delivery = await self._deliver(entry_id, fields, consumer)
            if delivery is not None:
                deliveries.append(delivery)
        return deliveries

    async def _deliver(self, entry_id: str, fields: dict | None, consumer: str) -> Delivery | None:
        if not fields or "request" not in fields:  # deleted from the stream meanwhile
            await self._drop_entry(entry_id)
            return None
        try:
            request = BusRequest.from_json(fields["request"])
        except ValueError:  # never deliverable: drop it rather than re-claim it forever
            log.exception("dropping malformed request entry %s", entry_id)
            await self._drop_entry(entry_id)
            return None
        rid = request.request_id
        claimed = await self._claim(keys=[self.state_key(rid), self.output_key(rid)])
        if claimed is None:  # its record expired: nothing can be published for it any more
            await self._drop_entry(entry_id)
            return None
        epoch, raw_events = claimed
        events = [OutputEvent.from_json(dict(zip(f[::2], f[1::2]))["event"], event_id=eid) for eid, f in raw_events]
        return Delivery(request=request, entry_id=entry_id, consumer=consumer, epoch=int(epoch), published=Published.of(events))

    async def publish(self, delivery: Delivery, event: OutputEvent) -> str:
        rid = delivery.request.request_id
        ttl = self.finished_ttl_s if event.final else self.pending_ttl_s
        attempts = 0

        async def attempt() -> str:
            nonlocal attempts
            attempts += 1
            return await self._publish(
                keys=[self.state_key(rid), self.output_key(rid)],
                args=[delivery.epoch, event.offset, event.end, int(event.final), event.to_json(), self.max_stream_len, _ms(ttl)],
            )

        try:
            return await self._reconnecting(f"publish to {rid!r}", attempt)
        except ResponseError as e:
            message = str(e)
            if attempts > 1 and _landed(message, event):  # an earlier attempt landed; its reply was lost
                log.info("publish to %r: the event at offset %d was already appended", rid, event.offset)
                return ""
            if "DSPARK_OFFSET" in message:
                raise ValueError(f"event offset {event.offset} does not continue the output stream of {rid!r} "
                                 f"({message.split()[-1]} tokens published)") from None
            if "DSPARK_" in message:
                raise LostOwnership(f"request {rid!r}: {message}") from None
            raise

    async def ack(self, delivery: Delivery) -> None:
        await self._reconnecting(f"ack of {delivery.request.request_id!r}", lambda: self._drop_entry(delivery.entry_id))

    async def _drop_entry(self, entry_id: str) -> None:
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.xack(self.requests_key, self.group, entry_id)
            pipe.xdel(self.requests_key, entry_id)
            await pipe.execute()

    async def keep_alive(self, consumer: str, entry_ids: list[str]) -> None:
        if entry_ids:
            with _reaching("keep-alive"):
                await self._keep_alive(keys=[self.requests_key], args=[self.group, consumer, *entry_ids])

    async def is_cancelled(self, request_id: str) -> bool:
        with _reaching("is_cancelled"):
            return bool(await self.redis.exists(self.cancel_key(request_id)))

    async def subscribe_cancellations(self) -> CancelSubscription:
        pubsub = self.redis.pubsub()
        with _reaching("subscribe"):
            await pubsub.subscribe(self.cancel_channel)
        return _RedisCancelSubscription(pubsub)

    # ---- the round view --------------------------------------------------------------------

    async def watch_rounds(self) -> AsyncIterator[list[str]]:
        last, marked_at = None, -float("inf")
        while True:
            try:
                with _reaching("round view"):
                    now = time.monotonic()
                    if now - marked_at >= self.round_watch_ttl_s / 3:
                        await self.redis.set(self.rounds_watched_key, "1", px=_ms(self.round_watch_ttl_s))
                        marked_at = now
                    if last is None:  # from now on: after the newest message there is
                        newest = await self.redis.xrevrange(self.rounds_key, count=1)
                        last = newest[0][0] if newest else "0-0"
                    block = _ms(min(self.tail_block_s, self.round_watch_ttl_s / 3))
                    response = await _read_within(
                        self.redis.xread({self.rounds_key: last}, count=512, block=block), block / 1000)
            except BusUnavailable as e:
                log.warning("round view: %s; retrying", e)
                await asyncio.sleep(1.0)
                continue
            batch = []
            for _, entries in response or ():
                for entry_id, fields in entries:
                    last = entry_id
                    batch.append(fields["m"])
            if batch:
                yield batch

    async def rounds_watched(self) -> bool:
        with _reaching("round view"):
            return bool(await self.redis.exists(self.rounds_watched_key))

    async def publish_rounds(self, messages: list[str]) -> None:
        if not messages:
            return
        with _reaching("round view"):
            async with self.redis.pipeline(transaction=False) as pipe:
                for m in messages:
                    pipe.xadd(self.rounds_key, {"m": m}, maxlen=self.max_round_messages, approximate=True)
                pipe.pexpire(self.rounds_key, _ms(max(self.finished_ttl_s, 60.0)))  # gone once nobody publishes
                await pipe.execute()


def _landed(error: str, event: OutputEvent) -> bool:
    """Whether a publish script's refusal says that this very event is already on the stream: its
    offset moved to the event's end (tokens), or, for a final event, the request is finished under
    the caller's epoch (the script checks the epoch first)."""
    if "DSPARK_OFFSET" in error:
        return event.end > event.offset and error.split()[-1] == str(event.end)
    return event.final and "DSPARK_FINISHED" in error


def _entries(response) -> list[tuple[str, dict | None]]:
    """XREADGROUP's reply -> [(entry id, fields or None if deleted)]."""
    if not response:
        return []
    if isinstance(response, dict):  # RESP3
        return [(eid, fields) for stream in response.values() for eid, fields in stream[0]]
    return [(eid, fields) for _, stream in response for eid, fields in stream]


def _ms(seconds: float) -> int:
    return max(1, round(seconds * 1000))
