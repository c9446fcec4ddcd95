"""The scheduler side of the round view: an engine's round feed onto the bus, only while a gateway watches.

    await relay_rounds(bus, engine.round_feed, source="scheduler-0", stop=stop)   # run_worker starts it

Every `poll_s` the relay asks the bus whether a gateway watches (`Bus.rounds_watched`: a flag with
a TTL that watching gateways refresh). While none does it holds no subscription, so the engine's
rounds build nothing (dspark/observability/round_feed.py). While one does, it subscribes to the
feed and publishes what arrives, in batches, as JSON with `source` added (the consumer name: the
page tells schedulers apart by it). It announces itself at once and every `profile_every_s`
(`{"type": "source", "source": ...}`: the page then knows the rounds will reach it), with the last
SPS profile, so that a gateway that starts watching later gets that too. A relay that falls behind the feed is
dropped by it and subscribes again (the page sees the round ids skip); a bus that cannot be
reached loses round messages, never anything else.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time

from dspark.bus.base import Bus, BusUnavailable
from dspark.observability.round_feed import Dropped, RoundFeed, RoundSubscription, SpsProfile

__all__ = ["relay_rounds"]

log = logging.getLogger(__name__)


async def relay_rounds(bus: Bus, feed: RoundFeed, *, source: str, stop: asyncio.Event, poll_s: float = 1.0,
                       profile_every_s: float = 5.0) -> None:
    """Publish `feed`'s messages on `bus` while rounds are watched, until `stop` is set."""
    sub: RoundSubscription | None = None
    profile: str | None = None  # the last SPS profile message, as published
    profile_sent = 0.0
    checked, watched = -float("inf"), False
    try:
        while not stop.is_set():
            now = time.monotonic()
            if now - checked >= poll_s:
                checked = now
                try:
                    watched = await bus.rounds_watched()
                except (BusUnavailable, OSError) as e:
                    log.debug("round relay: %s", e)
                    watched = False
            if not watched:
                if sub is not None:
                    sub.close()
                    sub = None
                await _sleep_unless(stop, poll_s)
                continue
            if sub is None:
                sub = feed.subscribe()
                profile_sent = -float("inf")  # announce now
            try:
                messages = sub.get_nowait()  # the profile a new subscription starts with, if any
                if not messages and time.monotonic() - profile_sent < profile_every_s:
                    first = await sub.get(timeout=poll_s)
                    messages = [] if first is None else [first, *sub.get_nowait()]  # at most the subscription's maxsize
            except Dropped:
                log.warning("round relay %s fell behind the engine; subscribing again", source)
                sub = None
                continue
            wire = []
            for m in messages:
                text = json.dumps({**m.to_wire(), "source": source})
                if isinstance(m, SpsProfile):
                    profile = text
                wire.append(text)
            if time.monotonic() - profile_sent >= profile_every_s:
                announce = [json.dumps({"type": "source", "source": source, "time": time.time()})]
                if profile is not None and profile not in wire:
                    announce.append(profile)
                wire[:0] = announce
                profile_sent = time.monotonic()
            if wire:
                try:
                    await bus.publish_rounds(wire)
                except (BusUnavailable, OSError) as e:
                    log.debug("round relay: %d messages lost: %s", len(wire), e)
    finally:
        if sub is not None:
            sub.close()


async def _sleep_unless(stop: asyncio.Event, seconds: float) -> None:
    """Sleep `seconds` or until `stop` is set (asyncio.wait, not wait_for: see dspark/bus/memory_bus.py `_wait`)."""
    waiter = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait({waiter}, timeout=seconds)
    finally:
        waiter.cancel()
