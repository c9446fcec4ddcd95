"""The Redis bus across a restart of Redis (a private redis-server; dspark/bus/redis_bus.py).

Specification: with an append-only file, a tail blocked on a request's output stream and a
publish made while Redis is down both go on once it is back, and the tail sees every event once,
in order; the consumer group and the pending request survive. Without persistence the requests
are gone: a publish is refused (LostOwnership), a tail ends with UnknownRequest, and the
consumer group is created again so new requests are served. A submit while Redis is down is a
BusUnavailable, a ConnectionError (the gateway's 503). A publish retried after its reply was lost
is not appended twice.
"""

from __future__ import annotations

import asyncio
import uuid

import pytest

from dspark.bus.base import BusUnavailable, LostOwnership, UnknownRequest
from dspark.bus.messages import BusRequest, OutputEvent
from dspark.bus.redis_bus import RedisBus, _landed

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend():
    return "asyncio"


def new_bus(url: str, **kwargs) -> RedisBus:
    return RedisBus.from_url(url, prefix=f"faults-{uuid.uuid4().hex[:8]}", claim_idle_s=60, tail_block_s=0.5, **kwargs)


async def consume_one(bus: RedisBus):
    for _ in range(40):
        try:
            deliveries = await bus.consume("worker", max_count=1, block_s=0.1)
        except BusUnavailable:  # the group is created again on the next call
            deliveries = []
        if deliveries:
            return deliveries[0]
        await asyncio.sleep(0.05)
    raise AssertionError("nothing to consume")


@pytest.mark.processes
async def test_a_tail_and_a_publish_ride_out_a_redis_restart_with_persistence(redis_server):
    redis = redis_server(persistent=True)
    worker = new_bus(redis.url, reconnect_timeout_s=20)
    gateway = RedisBus.from_url(redis.url, prefix=worker.prefix, tail_block_s=0.5, reconnect_timeout_s=20)  # another client
    await gateway.submit(BusRequest("req-1", [1, 2, 3], 6))
    delivery = await consume_one(worker)
    await worker.publish(delivery, OutputEvent(offset=0, token_ids=[7, 8]))

    seen: list[OutputEvent] = []
    first_seen = asyncio.Event()

    async def tail() -> None:
        async for event in gateway.tail("req-1"):
            seen.append(event)
            first_seen.set()

    tailing = asyncio.create_task(tail())
    await asyncio.wait_for(first_seen.wait(), 10)
    await asyncio.to_thread(redis.stop)  # the tail is blocked in XREAD: its connection drops
    publishing = asyncio.create_task(worker.publish(delivery, OutputEvent(offset=2, token_ids=[9, 10])))
    await asyncio.sleep(0.5)
    assert not publishing.done()  # retrying while Redis is down
    await asyncio.to_thread(redis.start)
    await asyncio.wait_for(publishing, 20)
    await worker.publish(delivery, OutputEvent(offset=4, token_ids=[11, 12], finish_reason="length"))
    await worker.ack(delivery)
    await asyncio.wait_for(tailing, 20)

    assert [t for e in seen for t in e.token_ids] == [7, 8, 9, 10, 11, 12]  # each token once, in order
    assert seen[-1].finish_reason == "length"
    assert await worker.queue_depth() == 0
    await worker.close()
    await gateway.close()


@pytest.mark.processes
async def test_a_redis_that_lost_its_data_fails_requests_in_flight_cleanly_and_serves_new_ones(redis_server):
    redis = redis_server(persistent=False)
    worker = new_bus(redis.url, reconnect_timeout_s=20)
    await worker.submit(BusRequest("req-1", [1, 2, 3], 6))
    delivery = await consume_one(worker)
    await worker.publish(delivery, OutputEvent(offset=0, token_ids=[7]))

    await asyncio.to_thread(redis.stop)
    with pytest.raises(BusUnavailable) as down:
        await worker.submit(BusRequest("req-2", [1], 2))
    assert isinstance(down.value, ConnectionError)  # what the gateway answers with 503
    await asyncio.to_thread(redis.start)  # empty

    with pytest.raises(LostOwnership):
        await worker.publish(delivery, OutputEvent(offset=1, token_ids=[8]))
    with pytest.raises(UnknownRequest):
        async for _ in worker.tail("req-1"):
            pass
    await worker.submit(BusRequest("req-3", [4, 5], 2))
    assert (await consume_one(worker)).request.request_id == "req-3"  # the consumer group exists again
    await worker.close()


def test_a_retried_publish_recognises_its_own_event_already_on_the_stream():
    tokens = OutputEvent(offset=4, token_ids=[1, 2])
    final = OutputEvent(offset=6, token_ids=[], finish_reason="length")
    assert _landed("DSPARK_OFFSET 6", tokens)  # the stream ends where this event ends: it landed
    assert not _landed("DSPARK_OFFSET 5", tokens) and not _landed("DSPARK_OFFSET 4", OutputEvent(offset=4, token_ids=[]))
    assert _landed("DSPARK_FINISHED", final) and not _landed("DSPARK_FINISHED", tokens)
    assert not _landed("DSPARK_FENCED current epoch 3", tokens)
