"""The Bus contract, one suite for both implementations (in-memory and real Redis).

Specification: a request is delivered to one consumer of the group; its output events are
tailed in order, from the start or after any event id, and the tail ends after the final event;
acknowledging removes it from the queue; a request whose consumer stops keeping it alive is
re-claimed by another consumer, together with what was already published, and the old
consumer's publishes are refused from then on (fencing); an event must continue the stream's
offset; cancel signals reach subscribers and stay readable; finished streams expire after their
TTL; the queue and the streams have maximum lengths.
"""

from __future__ import annotations

import asyncio

import pytest

from dspark.bus.base import BusFull, DuplicateRequest, LostOwnership, UnknownRequest
from dspark.bus.messages import BusRequest, OutputEvent, OutputStats
from dspark.sampling.params import SamplingParams

pytestmark = pytest.mark.anyio


def request(rid: str = "cmpl-1", **kwargs) -> BusRequest:
    return BusRequest(rid, [5, 6, 7], kwargs.pop("max_new_tokens", 8), SamplingParams(temperature=0.0), **kwargs)


def stats(completion: int) -> OutputStats:
    return OutputStats(prompt_tokens=3, completion_tokens=completion, rounds=completion, mean_accepted_length=1.0,
                       draft_tokens=0, accepted_tokens=0)


async def collect(bus, rid: str, *, after: str | None = None, timeout: float = 10.0) -> list[OutputEvent]:
    async def run():
        return [e async for e in bus.tail(rid, after=after)]

    return await asyncio.wait_for(run(), timeout)


async def consume_one(bus, consumer: str, *, block_s: float = 2.0):
    (delivery,) = await bus.consume(consumer, max_count=10, block_s=block_s)
    return delivery


async def test_a_request_goes_to_one_consumer_and_its_events_are_tailed_in_order(make_bus):
    gateway, worker_a, worker_b = make_bus(), make_bus(), make_bus()
    await gateway.submit(request(metadata={"response": {"kind": "completion"}}))
    assert await gateway.queue_depth() == 1
    delivery = await consume_one(worker_a, "a")
    assert delivery.request == request(metadata={"response": {"kind": "completion"}})
    assert delivery.published.token_ids == [] and not delivery.published.finished
    assert await worker_b.consume("b", max_count=10, block_s=0.2) == [], "delivered twice"

    tail = asyncio.ensure_future(collect(gateway, "cmpl-1"))
    await worker_a.publish(delivery, OutputEvent(offset=0, token_ids=[], stats=stats(0)))
    await worker_a.publish(delivery, OutputEvent(offset=0, token_ids=[1, 2], stats=stats(2)))
    await worker_a.publish(delivery, OutputEvent(offset=2, token_ids=[3], finish_reason="length", stats=stats(3)))
    events = await tail
    assert [e.token_ids for e in events] == [[], [1, 2], [3]]
    assert [e.offset for e in events] == [0, 0, 2] and events[-1].finish_reason == "length"
    assert len({e.event_id for e in events}) == 3 and all(e.event_id for e in events)
    await worker_a.ack(delivery)
    assert await gateway.queue_depth() == 0
    assert (await gateway.lookup("cmpl-1")).metadata == {"response": {"kind": "completion"}}


async def test_tail_resumes_after_an_event_id(make_bus):
    bus = make_bus()
    await bus.submit(request())
    delivery = await consume_one(bus, "a")
    for offset in range(4):
        await bus.publish(delivery, OutputEvent(offset=offset, token_ids=[offset + 10], finish_reason="length" if offset == 3 else None))
    everything = await collect(bus, "cmpl-1")
    after_second = await collect(bus, "cmpl-1", after=everything[1].event_id)
    assert [e.token_ids for e in after_second] == [[12], [13]]
    assert [e.event_id for e in after_second] == [e.event_id for e in everything[2:]]
    assert await collect(bus, "cmpl-1", after=everything[-1].event_id, timeout=1.0) == []  # ends: nothing after the last


async def test_unknown_requests_and_malformed_event_ids_are_errors(make_bus):
    bus = make_bus()
    with pytest.raises(UnknownRequest):
        await collect(bus, "cmpl-never")
    assert await bus.lookup("cmpl-never") is None
    await bus.submit(request())
    with pytest.raises(ValueError, match="event id"):
        await collect(bus, "cmpl-1", after="../etc")


async def test_duplicate_ids_and_a_full_queue_are_refused(make_bus):
    bus = make_bus(max_queue=2)
    await bus.submit(request("r1"))
    with pytest.raises(DuplicateRequest):
        await bus.submit(request("r1"))
    await bus.submit(request("r2"))
    with pytest.raises(BusFull):
        await bus.submit(request("r3"))
    (d1, _d2) = await bus.consume("a", max_count=2, block_s=1.0)
    await bus.publish(d1, OutputEvent(offset=0, token_ids=[1], finish_reason="stop"))
    await bus.ack(d1)
    await bus.submit(request("r3"))  # room again


async def test_an_idle_request_is_reclaimed_with_what_was_published_and_the_old_owner_is_fenced(make_bus):
    bus_a, bus_b = make_bus(claim_idle_s=0.3), make_bus(claim_idle_s=0.3)
    await bus_a.submit(request())
    old = await consume_one(bus_a, "a")
    await bus_a.publish(old, OutputEvent(offset=0, token_ids=[], stats=stats(0)))
    await bus_a.publish(old, OutputEvent(offset=0, token_ids=[4, 5], stats=stats(2)))
    assert await bus_b.consume("b", max_count=1, block_s=0.05) == []  # not idle long enough yet
    await asyncio.sleep(0.4)  # consumer a stops keeping it alive: presumed dead
    new = await consume_one(bus_b, "b")
    assert new.entry_id == old.entry_id and new.epoch > old.epoch and new.consumer == "b"
    assert new.published.token_ids == [4, 5] and new.published.stats == stats(2) and not new.published.finished

    with pytest.raises(LostOwnership):  # a comes back: its writes are refused
        await bus_a.publish(old, OutputEvent(offset=2, token_ids=[6]))
    with pytest.raises(ValueError, match="offset"):
        await bus_b.publish(new, OutputEvent(offset=1, token_ids=[6]))
    await bus_b.publish(new, OutputEvent(offset=2, token_ids=[6], finish_reason="length", stats=stats(3)))
    with pytest.raises(LostOwnership):  # nothing after the final event
        await bus_b.publish(new, OutputEvent(offset=3, token_ids=[7]))
    await bus_b.ack(new)
    assert [t for e in await collect(bus_a, "cmpl-1") for t in e.token_ids] == [4, 5, 6]
    assert await bus_a.queue_depth() == 0


async def test_keep_alive_prevents_reclaiming_and_only_works_for_the_owner(make_bus):
    bus = make_bus(claim_idle_s=0.4)
    await bus.submit(request())
    delivery = await consume_one(bus, "a")
    for _ in range(4):
        await asyncio.sleep(0.15)
        await bus.keep_alive("a", [delivery.entry_id])
        await bus.keep_alive("intruder", [delivery.entry_id])  # not its entry: no effect
        assert await bus.consume("b", max_count=1, block_s=0.0) == []
    await asyncio.sleep(0.5)
    assert (await consume_one(bus, "b")).consumer == "b"


async def test_cancel_reaches_subscribers_and_stays_readable(make_bus):
    worker, gateway = make_bus(), make_bus()
    sub = await worker.subscribe_cancellations()
    try:
        assert not await worker.is_cancelled("cmpl-1")
        await gateway.cancel("cmpl-1")
        assert await asyncio.wait_for(anext(sub), 5.0) == "cmpl-1"
        assert await worker.is_cancelled("cmpl-1")
    finally:
        await sub.close()


async def test_finished_streams_expire_after_their_ttl_and_running_ones_do_not(make_bus):
    bus = make_bus(finished_ttl_s=0.3)
    await bus.submit(request("done"))
    await bus.submit(request("running"))
    deliveries = {d.request.request_id: d for d in await bus.consume("a", max_count=2, block_s=1.0)}
    await bus.publish(deliveries["done"], OutputEvent(offset=0, token_ids=[1], finish_reason="stop"))
    await bus.publish(deliveries["running"], OutputEvent(offset=0, token_ids=[1]))
    assert [e.token_ids for e in await collect(bus, "done")] == [[1]]
    await asyncio.sleep(0.5)
    with pytest.raises(UnknownRequest):
        await collect(bus, "done")
    assert await bus.lookup("done") is None
    assert await bus.lookup("running") is not None
    with pytest.raises(LostOwnership):  # an expired request cannot be written to either
        await bus.publish(deliveries["done"], OutputEvent(offset=1, token_ids=[2]))


async def test_output_streams_are_trimmed_to_their_maximum_length(make_bus):
    # Redis trims whole radix-tree nodes (`MAXLEN ~`, 100 entries each): publish enough to cut some.
    bus = make_bus(max_stream_len=10, claim_idle_s=0.2)
    await bus.submit(request(max_new_tokens=1000))
    delivery = await consume_one(bus, "a")
    for offset in range(400):
        await bus.publish(delivery, OutputEvent(offset=offset, token_ids=[offset % 200]))
    kept = await asyncio.wait_for(_read_available(bus, "cmpl-1"), 10)
    assert 10 <= len(kept) < 400 and kept[0].offset > 0 and kept[-1].offset == 399
    await asyncio.sleep(0.3)
    again = await consume_one(bus, "b")
    assert again.published.trimmed  # a new owner knows it cannot continue from an incomplete stream


async def _read_available(bus, rid: str) -> list[OutputEvent]:
    """Events published so far (the stream is not finished, so the tail would wait for more)."""
    out: list[OutputEvent] = []

    async def read():
        async for e in bus.tail(rid):
            out.append(e)
            if e.offset == 399:
                return

    await read()
    return out


# ---- the round view's channel ------------------------------------------------------------------


async def next_batch(watch, timeout: float = 5.0) -> list[str]:
    return await asyncio.wait_for(anext(watch), timeout)


async def test_rounds_are_watched_while_a_gateway_watches_and_a_ttl_after(make_bus):
    gateway, worker = make_bus(round_watch_ttl_s=0.6), make_bus(round_watch_ttl_s=0.6)
    assert not await worker.rounds_watched()
    got: list[str] = []

    async def read() -> None:  # as the gateway's relay does: always waiting for the next batch
        async for batch in gateway.watch_rounds():
            got.extend(batch)

    reader = asyncio.ensure_future(read())
    await asyncio.sleep(0.2)
    assert await worker.rounds_watched()
    await worker.publish_rounds(['{"n": 1}', '{"n": 2}'])
    await asyncio.sleep(0.8)  # past the TTL: the watcher keeps the flag alive
    assert got == ['{"n": 1}', '{"n": 2}'] and await worker.rounds_watched()
    reader.cancel()
    await asyncio.gather(reader, return_exceptions=True)
    deadline = asyncio.get_running_loop().time() + 3
    while await worker.rounds_watched():
        assert asyncio.get_running_loop().time() < deadline, "rounds still watched long after the last watcher left"
        await asyncio.sleep(0.1)


async def test_a_watcher_gets_only_messages_published_after_it_started_in_order(make_bus):
    gateway, worker = make_bus(), make_bus()
    await worker.publish_rounds(["old"])
    watch = gateway.watch_rounds()
    reading = asyncio.ensure_future(next_batch(watch))
    await asyncio.sleep(0.2)
    await worker.publish_rounds([f"m{i}" for i in range(5)])
    got = await reading
    while len(got) < 5:
        got += await next_batch(watch)
    assert got == [f"m{i}" for i in range(5)]
    await watch.aclose()


async def test_the_round_channel_keeps_only_its_last_messages_for_a_slow_watcher(make_bus):
    gateway, worker = make_bus(max_round_messages=10), make_bus(max_round_messages=10)
    watch = gateway.watch_rounds()
    reading = asyncio.ensure_future(next_batch(watch))
    await asyncio.sleep(0.2)
    await worker.publish_rounds(["first"])
    assert await reading == ["first"]
    for i in range(20):  # the watcher reads none of these meanwhile
        await worker.publish_rounds([f"m{i}"])
    got = await next_batch(watch)
    assert got[-1] == "m19" and len(got) <= 20 and got == [f"m{i}" for i in range(20 - len(got), 20)]
    assert len(got) < 20 or worker.__class__.__name__ == "RedisBus"  # memory: exactly the last 10; Redis trims about
    await watch.aclose()
