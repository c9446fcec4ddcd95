"""RedisBus specifics, against the real Redis: key layout, TTLs on the keys, malformed entries.

Specification: a request's keys share a cluster hash tag; a running request's output stream and
record carry the long pending TTL and a finished one the finished TTL (PEXPIRE on each
publish); a request entry that cannot be parsed is dropped instead of being re-claimed forever.
"""

from __future__ import annotations

import pytest

from dspark.bus.messages import BusRequest, OutputEvent
from dspark.sampling.params import SamplingParams
from tests.bus.conftest import BusFactory, redis_reachable

pytestmark = pytest.mark.anyio


@pytest.fixture
async def redis_bus_factory():
    if not redis_reachable():
        pytest.skip("no Redis reachable")
    factory = BusFactory("redis")
    yield factory
    await factory.cleanup()


async def test_finished_streams_get_the_finished_ttl_and_running_ones_the_pending_ttl(redis_bus_factory):
    bus = redis_bus_factory(finished_ttl_s=30.0, pending_ttl_s=3600.0)
    for rid in ("cmpl-done", "cmpl-running"):
        await bus.submit(BusRequest(rid, [1, 2], 4, SamplingParams(temperature=0.0)))
    deliveries = {d.request.request_id: d for d in await bus.consume("a", max_count=2, block_s=1.0)}
    await bus.publish(deliveries["cmpl-running"], OutputEvent(offset=0, token_ids=[3]))
    await bus.publish(deliveries["cmpl-done"], OutputEvent(offset=0, token_ids=[3]))
    await bus.publish(deliveries["cmpl-done"], OutputEvent(offset=1, token_ids=[4], finish_reason="stop"))
    r = bus.redis
    for key in (bus.output_key("cmpl-done"), bus.state_key("cmpl-done")):
        assert 0 < await r.pttl(key) <= 30_000, key
    for key in (bus.output_key("cmpl-running"), bus.state_key("cmpl-running")):
        assert 30_000 < await r.pttl(key) <= 3_600_000, key
    assert bus.output_key("cmpl-done").endswith("{cmpl-done}") and bus.state_key("cmpl-done").endswith("{cmpl-done}")


async def test_a_malformed_request_entry_is_dropped(redis_bus_factory):
    bus = redis_bus_factory(claim_idle_s=0.1)
    await bus.submit(BusRequest("cmpl-ok", [1], 2, SamplingParams(temperature=0.0)))
    await bus.redis.xadd(bus.requests_key, {"request": "{not json"})
    deliveries = await bus.consume("a", max_count=5, block_s=1.0)
    assert [d.request.request_id for d in deliveries] == ["cmpl-ok"]
    assert await bus.queue_depth() == 1  # only the good one is left (pending)


async def test_the_connection_error_of_a_cancelled_read_is_the_cancel_and_others_are_outages():
    """redis-py drops the connection of a read it is cancelled in, and the read may end with a
    ConnectionError: taken for an outage, a retry loop (the round view's watcher) would swallow the
    cancel and retry forever. A connection error with no cancel pending stays BusUnavailable."""
    import asyncio

    from redis.exceptions import ConnectionError as RedisConnectionError

    from dspark.bus.base import BusUnavailable
    from dspark.bus.redis_bus import _reaching

    async def read_ended_by_a_connection_error() -> None:
        with _reaching("round view"):
            try:
                await asyncio.sleep(30)
            except asyncio.CancelledError:
                raise RedisConnectionError("Connection closed by server.") from None

    task = asyncio.ensure_future(read_ended_by_a_connection_error())
    await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(task, 5)

    with pytest.raises(BusUnavailable):
        with _reaching("round view"):
            raise RedisConnectionError("Connection refused")
