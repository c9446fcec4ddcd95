"""Per-client limits (gateway/rate_limit.py): the same specification in memory and in real Redis.

Specification: a client gets `burst` requests at once, then one per `60 / requests_per_minute`
seconds, and a refusal says how long to wait (then the request passes); clients do not share a
bucket; at most `max_concurrent` leases per client are out at once, a released lease frees its
slot, and a request refused for concurrency costs no rate token. In Redis the buckets and slots
are shared by every limiter on the same prefix (gateway replicas), the keys expire by themselves,
a lease outlives its TTL while its holder renews it, and the slot of a holder that dies without
releasing (SIGKILL) frees itself after the TTL. An unreachable Redis is LimiterUnavailable.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
import time
import uuid
from pathlib import Path

import pytest

from gateway.rate_limit import LimiterUnavailable, MemoryRateLimiter, RateLimited, RateLimits, RedisRateLimiter, take_token
from tests.bus.conftest import REDIS_URL, redis_reachable

pytestmark = pytest.mark.anyio

ROOT = Path(__file__).resolve().parents[2]


class FakeClock:
    """Monotonic seconds that the test advances (the memory limiter's clock)."""

    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Limiters:
    """Limiters of one kind on one namespace; Redis keys are deleted at the end."""

    def __init__(self, kind: str):
        self.kind = kind
        self.prefix = f"dspark-test-{uuid.uuid4().hex[:12]}"
        self.clock = FakeClock()
        self.made: list = []
        self._memory: dict[RateLimits, MemoryRateLimiter] = {}

    def __call__(self, limits: RateLimits, **kwargs):
        """A limiter; for Redis a new client each call (as another replica has), for memory the
        same limiter for the same limits (one process has one)."""
        if self.kind == "memory":
            return self._memory.setdefault(limits, MemoryRateLimiter(limits, clock=self.clock))
        limiter = RedisRateLimiter.from_url(REDIS_URL, prefix=self.prefix, limits=limits, **kwargs)
        self.made.append(limiter)
        return limiter

    async def wait(self, seconds: float) -> None:
        """Let `seconds` pass: the fake clock in memory, real time in Redis (its clock)."""
        if self.kind == "memory":
            self.clock.now += seconds
        else:
            await asyncio.sleep(seconds)

    async def cleanup(self) -> None:
        import redis.asyncio as aioredis

        for limiter in self.made:
            with contextlib.suppress(Exception):
                await limiter.close()
        if self.kind == "redis":
            client = aioredis.Redis.from_url(REDIS_URL)
            try:
                keys = [k async for k in client.scan_iter(match=f"{self.prefix}:*", count=500)]
                if keys:
                    await client.delete(*keys)
            finally:
                await client.aclose()


@pytest.fixture(params=["memory", "redis"])
async def limiters(request):
    if request.param == "redis" and not redis_reachable():
        pytest.skip(f"no Redis at {REDIS_URL}")
    made = Limiters(request.param)
    yield made
    await made.cleanup()


async def refused(limiter, client: str) -> RateLimited:
    with pytest.raises(RateLimited) as info:
        await limiter.acquire(client)
    return info.value


# ---- the token bucket -----------------------------------------------------------------------------


def test_the_token_bucket_refills_at_its_rate_up_to_its_capacity():
    assert take_token(3.0, 0.0, 0.0, capacity=3, refill_per_s=1.0) == (2.0, 0.0)
    tokens, wait = take_token(0.25, 0.0, 0.0, capacity=3, refill_per_s=0.5)
    assert tokens == 0.25 and wait == pytest.approx(1.5)  # 0.75 of a token at 0.5 per second
    assert take_token(0.25, 0.0, 1.5, capacity=3, refill_per_s=0.5) == (0.0, 0.0)
    assert take_token(1.0, 0.0, 1e6, capacity=3, refill_per_s=0.5) == (2.0, 0.0)  # never above capacity


# ---- both kinds ----------------------------------------------------------------------------------


async def test_a_burst_then_one_request_per_interval_and_the_refusal_says_when(limiters):
    limiter = limiters(RateLimits(requests_per_minute=240, burst=3))  # a token every 0.25 s
    for _ in range(3):
        await (await limiter.acquire("key-a")).release()
    refusal = await refused(limiter, "key-a")
    assert 0 < refusal.retry_after_s <= 0.25 and refusal.retry_after_header == "1"
    assert "240 requests per minute" in refusal.message
    await limiters.wait(refusal.retry_after_s + 0.05)
    await limiter.acquire("key-a")  # recovered
    await refused(limiter, "key-a")  # ... for exactly one request
    await limiter.acquire("key-b")  # another client has its own bucket


async def test_requests_in_flight_are_capped_and_a_release_frees_a_slot(limiters):
    limits = RateLimits(requests_per_minute=60, burst=3, max_concurrent=2)
    limiter = limiters(limits)
    first, second = await limiter.acquire("key-a"), await limiter.acquire("key-a")
    refusal = await refused(limiter, "key-a")
    assert "in flight" in refusal.message and refusal.retry_after_header == "1"
    await limiter.acquire("key-b")  # per client
    await first.release()
    await first.release()  # a second release frees nothing more
    third = await limiter.acquire("key-a")  # the third token: the concurrency refusal took none
    await second.release()
    await third.release()
    assert "per minute" in (await refused(limiter, "key-a")).message  # now the bucket is empty


async def test_no_limits_configured_admits_everything(limiters):
    limiter = limiters(RateLimits())
    assert not limiter.limits.enabled
    leases = [await limiter.acquire("key-a") for _ in range(50)]
    for lease in leases:
        await lease.release()


# ---- Redis only ----------------------------------------------------------------------------------


@pytest.fixture
async def redis_limiters():
    if not redis_reachable():
        pytest.skip(f"no Redis at {REDIS_URL}")
    made = Limiters("redis")
    yield made
    await made.cleanup()


async def test_limiters_on_one_prefix_share_buckets_and_slots(redis_limiters):
    limits = RateLimits(requests_per_minute=60, burst=2, max_concurrent=1)
    replica_a, replica_b = redis_limiters(limits), redis_limiters(limits)
    lease = await replica_a.acquire("key-a")
    assert "in flight" in (await refused(replica_b, "key-a")).message
    await lease.release()
    await (await replica_b.acquire("key-a")).release()
    assert "per minute" in (await refused(replica_a, "key-a")).message  # two tokens taken, one on each replica


async def test_the_redis_keys_expire_by_themselves(redis_limiters):
    limiter = redis_limiters(RateLimits(requests_per_minute=60, burst=2, max_concurrent=1), lease_ttl_s=5)
    lease = await limiter.acquire("key-a")
    bucket, in_flight = limiter.keys("key-a")
    assert 0 < await limiter.client.pttl(bucket) <= 2 * 1000 + 1000  # a full refill (2 tokens at 1 / s) and a second
    assert 0 < await limiter.client.pttl(in_flight) <= 5000
    await lease.release()


async def test_a_lease_outlives_its_ttl_while_its_holder_renews_it(redis_limiters):
    limiter = redis_limiters(RateLimits(max_concurrent=1), lease_ttl_s=0.6)  # renewed every 0.2 s
    lease = await limiter.acquire("key-a")
    await asyncio.sleep(1.5)
    await refused(limiter, "key-a")
    await lease.release()
    await (await limiter.acquire("key-a")).release()


@pytest.mark.processes
async def test_the_slot_of_a_gateway_killed_mid_request_frees_itself_after_the_ttl(redis_limiters):
    limiter = redis_limiters(RateLimits(max_concurrent=1))
    holder = (  # another process takes the slot, then dies without releasing it
        "import asyncio\nfrom gateway.rate_limit import RateLimits, RedisRateLimiter\n"
        "async def main():\n"
        f"    limiter = RedisRateLimiter.from_url({REDIS_URL!r}, prefix={redis_limiters.prefix!r}, "
        "limits=RateLimits(max_concurrent=1), lease_ttl_s=1.0)\n"
        "    await limiter.acquire('key-a')\n    print('held', flush=True)\n    await asyncio.sleep(60)\n"
        "asyncio.run(main())\n"
    )
    proc = await asyncio.create_subprocess_exec(sys.executable, "-c", holder, cwd=ROOT, stdout=asyncio.subprocess.PIPE,
                                                env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        assert await asyncio.wait_for(proc.stdout.readline(), 60) == b"held\n"
        await asyncio.sleep(0.8)  # renewed at least once meanwhile
        await refused(limiter, "key-a")
        os.kill(proc.pid, signal.SIGKILL)
        await asyncio.wait_for(proc.wait(), 10)
        killed_at = time.monotonic()
        while True:
            try:
                await (await limiter.acquire("key-a")).release()
                break
            except RateLimited:
                assert time.monotonic() - killed_at < 3.0, "the dead holder's slot was not freed"
                await asyncio.sleep(0.1)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


async def test_an_unreachable_redis_is_limiter_unavailable():
    limiter = RedisRateLimiter.from_url("redis://127.0.0.1:1/0", prefix="dspark-test", limits=RateLimits(requests_per_minute=1))
    try:
        with pytest.raises(LimiterUnavailable, match="Redis is unavailable"):
            await limiter.acquire("key-a")
    finally:
        await limiter.close()


def test_limits_must_not_be_negative():
    with pytest.raises(ValueError, match="max_concurrent must be >= 0"):
        RateLimits(max_concurrent=-1)
