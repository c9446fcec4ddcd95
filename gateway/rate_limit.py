"""Per-client limits of the gateway: requests per minute and requests in flight.

    limits = RateLimits(requests_per_minute=600, burst=20, max_concurrent=8)
    limiter = MemoryRateLimiter(limits)                       # embedded mode (`dspark serve`)
    limiter = RedisRateLimiter.from_url(url, prefix="dspark", limits=limits)   # shared by replicas
    lease = await limiter.acquire("key-2c26b46b68ff")         # RateLimited(retry_after_s) if over
    ...                                                       # serve the request (a stream too)
    await lease.release()

A client is an API key's id (gateway/api_keys.py) or, without keys, `ip:<address>` of the
connection. The rate is a token bucket: `burst` requests at once (default: one minute's worth),
refilled at `requests_per_minute / 60` per second. The concurrency limit counts leases: taken
before the request is served, released when its response (a stream included) has ended or the
client has gone. A request over either limit takes nothing from the other.

In Redis one Lua script checks and takes both atomically, on Redis's clock, so that every
gateway replica shares the same buckets. A lease there is a member of a sorted set scored by its
expiry; the holder renews it every `lease_ttl_s / 3` while the request runs, so a gateway that
crashes mid-request frees its slots after `lease_ttl_s`, not never.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
import uuid
from dataclasses import dataclass
from typing import Protocol

__all__ = ["Lease", "LimiterUnavailable", "MemoryRateLimiter", "RateLimited", "RateLimiter", "RateLimits", "RedisRateLimiter",
           "take_token"]

log = logging.getLogger(__name__)

CONCURRENCY_RETRY_S = 1.0  # what Retry-After says when the in-flight limit is full (the end of a request is not known)


@dataclass(frozen=True)
class RateLimits:
    requests_per_minute: int = 0  # 0 = no rate limit
    burst: int = 0  # bucket size; 0 = requests_per_minute
    max_concurrent: int = 0  # requests in flight per client; 0 = no limit

    def __post_init__(self) -> None:
        for name in ("requests_per_minute", "burst", "max_concurrent"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0 (0 = no limit), got {getattr(self, name)}")

    @property
    def enabled(self) -> bool:
        return self.requests_per_minute > 0 or self.max_concurrent > 0

    @property
    def capacity(self) -> int:
        """Bucket size (0 when there is no rate limit)."""
        return (self.burst or self.requests_per_minute) if self.requests_per_minute > 0 else 0

    @property
    def refill_per_s(self) -> float:
        return self.requests_per_minute / 60.0

    def describe(self) -> str:
        """For the start-up log line."""
        rate = f"{self.requests_per_minute} requests/min (burst {self.capacity})" if self.capacity else "no rate limit"
        return f"{rate}, {self.max_concurrent or 'unlimited'} in flight per client"


class RateLimited(Exception):
    """The client is over a limit; retry after `retry_after_s` seconds."""

    def __init__(self, message: str, retry_after_s: float):
        super().__init__(message)
        self.message = message
        self.retry_after_s = retry_after_s

    @property
    def retry_after_header(self) -> str:
        """Whole seconds, at least 1 (HTTP Retry-After)."""
        return str(max(1, math.ceil(self.retry_after_s)))


class LimiterUnavailable(Exception):
    """The limits could not be checked (Redis unreachable)."""


class Lease(Protocol):
    async def release(self) -> None: ...


class RateLimiter(Protocol):
    limits: RateLimits

    async def acquire(self, client: str) -> Lease: ...
    async def close(self) -> None: ...


def take_token(tokens: float, updated_s: float, now_s: float, *, capacity: float, refill_per_s: float) -> tuple[float, float]:
    """One step of the token bucket: refill for the time elapsed, then take a token if there is
    one. Returns (tokens left, seconds to wait); a wait of 0 means the token was taken. The
    Redis script (_ACQUIRE_LUA) does the same arithmetic in milliseconds."""
    tokens = min(capacity, tokens + max(0.0, now_s - updated_s) * refill_per_s)
    if tokens >= 1.0:
        return tokens - 1.0, 0.0
    return tokens, (1.0 - tokens) / refill_per_s


def _rate_message(limits: RateLimits) -> str:
    return f"Rate limit reached: at most {limits.requests_per_minute} requests per minute (bursts of {limits.capacity})."


def _concurrency_message(limits: RateLimits) -> str:
    return f"Too many requests in flight: at most {limits.max_concurrent} at once for this client."


# ---- one process ---------------------------------------------------------------------------------


class _MemoryLease:
    def __init__(self, limiter: MemoryRateLimiter, client: str):
        self._limiter, self._client, self._released = limiter, client, False

    async def release(self) -> None:
        if not self._released:
            self._released = True
            self._limiter._release(self._client)


class MemoryRateLimiter:
    """The limits in this process (one event loop; no lock needed: nothing awaits in between)."""

    MAX_IDLE_CLIENTS = 10_000  # beyond this many buckets, the full ones (clients gone quiet) are dropped

    def __init__(self, limits: RateLimits, *, clock=time.monotonic):
        self.limits = limits
        self._clock = clock
        self._buckets: dict[str, tuple[float, float]] = {}  # client -> (tokens, updated_s)
        self._in_flight: dict[str, int] = {}

    async def acquire(self, client: str) -> Lease:
        limits = self.limits
        if limits.max_concurrent and self._in_flight.get(client, 0) >= limits.max_concurrent:
            raise RateLimited(_concurrency_message(limits), CONCURRENCY_RETRY_S)
        if limits.capacity:
            now = self._clock()
            tokens, updated = self._buckets.get(client, (float(limits.capacity), now))
            tokens, wait_s = take_token(tokens, updated, now, capacity=limits.capacity, refill_per_s=limits.refill_per_s)
            self._buckets[client] = (tokens, now)
            if wait_s > 0:
                raise RateLimited(_rate_message(limits), wait_s)
            if len(self._buckets) > self.MAX_IDLE_CLIENTS:
                self._forget_full_buckets(now)
        if limits.max_concurrent:
            self._in_flight[client] = self._in_flight.get(client, 0) + 1
        return _MemoryLease(self, client)

    def _release(self, client: str) -> None:
        if self.limits.max_concurrent:
            left = self._in_flight.get(client, 0) - 1
            if left > 0:
                self._in_flight[client] = left
            else:
                self._in_flight.pop(client, None)

    def _forget_full_buckets(self, now: float) -> None:
        limits = self.limits
        full = [c for c, (tokens, updated) in self._buckets.items()
                if tokens + (now - updated) * limits.refill_per_s >= limits.capacity]
        for client in full:
            del self._buckets[client]

    async def close(self) -> None:
        pass


# ---- Redis (every replica) -----------------------------------------------------------------------

# KEYS: bucket (hash: tokens, ts), in-flight leases (zset: lease id -> expiry ms)
# ARGV: capacity, refill per ms, max concurrent, lease id, lease ttl ms
# -> {1, 0} taken; {0, wait ms, reason} refused (reason: "rate" | "concurrency")
_ACQUIRE_LUA = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local capacity = tonumber(ARGV[1])
local refill = tonumber(ARGV[2])
local max_concurrent = tonumber(ARGV[3])
local ttl = tonumber(ARGV[5])
if max_concurrent > 0 then
  redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now)
  if redis.call('ZCARD', KEYS[2]) >= max_concurrent then
    return {0, 0, 'concurrency'}
  end
end
if capacity > 0 then
  local state = redis.call('HMGET', KEYS[1], 'tokens', 'ts')
  local tokens = tonumber(state[1]) or capacity
  local ts = tonumber(state[2]) or now
  tokens = math.min(capacity, tokens + math.max(0, now - ts) * refill)
  if tokens < 1 then
    return {0, math.ceil((1 - tokens) / refill), 'rate'}
  end
  redis.call('HSET', KEYS[1], 'tokens', string.format('%.6f', tokens - 1), 'ts', tostring(now))
  -- an untouched bucket refills completely within capacity / refill ms: then it need not exist
  redis.call('PEXPIRE', KEYS[1], math.ceil(capacity / refill) + 1000)
end
if max_concurrent > 0 then
  redis.call('ZADD', KEYS[2], now + ttl, ARGV[4])
  redis.call('PEXPIRE', KEYS[2], ttl)
end
return {1, 0}
"""

# KEYS: in-flight leases; ARGV: lease id, lease ttl ms. Pushes the lease's expiry on (if it still exists).
_RENEW_LUA = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local renewed = redis.call('ZADD', KEYS[1], 'XX', 'CH', now + tonumber(ARGV[2]), ARGV[1])
redis.call('PEXPIRE', KEYS[1], tonumber(ARGV[2]))
return renewed
"""


class _RedisLease:
    """A slot in a client's in-flight set, renewed in the background until released."""

    def __init__(self, limiter: RedisRateLimiter, key: str, lease_id: str):
        self._limiter, self._key, self._id = limiter, key, lease_id
        self._renewer = asyncio.ensure_future(self._renew_forever()) if limiter.limits.max_concurrent else None
        self._released = False

    async def _renew_forever(self) -> None:
        ttl_ms = int(self._limiter.lease_ttl_s * 1000)
        while True:
            await asyncio.sleep(self._limiter.lease_ttl_s / 3)
            try:
                await self._limiter._renew(keys=[self._key], args=[self._id, ttl_ms])
            except Exception:  # Redis briefly away: the next renewal (or the TTL) settles it
                log.warning("renewing an in-flight lease failed", exc_info=True)

    async def release(self) -> None:
        if self._released:
            return
        self._released = True
        if self._renewer is None:
            return
        self._renewer.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._renewer
        try:
            await self._limiter.client.zrem(self._key, self._id)
        except Exception:  # the lease then expires after lease_ttl_s
            log.warning("releasing an in-flight lease failed; it expires by itself", exc_info=True)


class _NoLease:
    async def release(self) -> None:
        pass


class RedisRateLimiter:
    """The limits in Redis, shared by every gateway replica with the same `prefix`."""

    def __init__(self, client, *, prefix: str, limits: RateLimits, lease_ttl_s: float = 30.0):
        if lease_ttl_s <= 0:
            raise ValueError(f"lease_ttl_s must be > 0, got {lease_ttl_s}")
        self.client = client  # redis.asyncio.Redis
        self.prefix = prefix
        self.limits = limits
        self.lease_ttl_s = lease_ttl_s
        self._acquire = client.register_script(_ACQUIRE_LUA)
        self._renew = client.register_script(_RENEW_LUA)

    @classmethod
    def from_url(cls, url: str, *, prefix: str, limits: RateLimits, lease_ttl_s: float = 30.0) -> RedisRateLimiter:
        import redis.asyncio as aioredis

        return cls(aioredis.Redis.from_url(url), prefix=prefix, limits=limits, lease_ttl_s=lease_ttl_s)

    def keys(self, client: str) -> tuple[str, str]:
        """(bucket, in-flight set) of a client; one hash slot (`{client}`) for the script in Redis Cluster."""
        base = f"{self.prefix}:limits:{{{client}}}"
        return f"{base}:bucket", f"{base}:inflight"

    async def acquire(self, client: str) -> Lease:
        limits = self.limits
        bucket, in_flight = self.keys(client)
        lease_id = uuid.uuid4().hex
        try:
            reply = await self._acquire(keys=[bucket, in_flight], args=[
                limits.capacity, repr(limits.refill_per_s / 1000.0), limits.max_concurrent, lease_id, int(self.lease_ttl_s * 1000)])
        except Exception as e:  # noqa: BLE001 - ConnectionError, TimeoutError, a Redis error reply: all mean "cannot check"
            raise LimiterUnavailable(f"the rate limiter's Redis is unavailable: {type(e).__name__}: {e}") from None
        if int(reply[0]) == 1:
            return _RedisLease(self, in_flight, lease_id) if limits.max_concurrent else _NoLease()
        reason = reply[2].decode() if isinstance(reply[2], bytes) else str(reply[2])
        if reason == "concurrency":
            raise RateLimited(_concurrency_message(limits), CONCURRENCY_RETRY_S)
        raise RateLimited(_rate_message(limits), int(reply[1]) / 1000.0)

    async def close(self) -> None:
        await self.client.aclose()
