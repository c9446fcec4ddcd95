"""Fixtures for the bus tests: the same tests run against the in-memory bus and real Redis.

`make_bus(**kwargs)` returns a handle on the test's bus. For Redis every call is a new client
on the same keys (as another process would have: a gateway replica, a second scheduler); the
in-memory bus is one shared object (kwargs apply to the first call). Redis runs at
127.0.0.1:6379 (override with DSPARK_TEST_REDIS_URL); each test gets its own key prefix, and its
keys are deleted afterwards. Tests are skipped, not failed, where no Redis is reachable.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import uuid
from urllib.parse import urlparse

import pytest

from dspark.bus.base import Bus
from dspark.bus.memory_bus import MemoryBus

REDIS_URL = os.environ.get("DSPARK_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")
BUS_KINDS = ["memory", "redis"]


def redis_reachable(url: str = REDIS_URL) -> bool:
    u = urlparse(url)
    try:
        with socket.create_connection((u.hostname or "127.0.0.1", u.port or 6379), timeout=0.5):
            return True
    except OSError:
        return False


class BusFactory:
    def __init__(self, kind: str):
        self.kind = kind
        self.prefix = f"dspark-test-{uuid.uuid4().hex[:12]}"
        self.made: list[Bus] = []
        self._memory: MemoryBus | None = None

    def __call__(self, **kwargs) -> Bus:
        if self.kind == "memory":
            if self._memory is None:
                self._memory = MemoryBus(**kwargs)
            return self._memory
        from dspark.bus.redis_bus import RedisBus

        bus = RedisBus.from_url(REDIS_URL, prefix=self.prefix, **kwargs)
        self.made.append(bus)
        return bus

    async def cleanup(self) -> None:
        if self.kind != "redis":
            return
        import redis.asyncio as aioredis

        for bus in self.made:
            with contextlib.suppress(Exception):  # made on another (now closed) event loop, e.g. a worker thread's
                await asyncio.wait_for(bus.close(), 5)
        client = aioredis.Redis.from_url(REDIS_URL, decode_responses=True)
        try:
            keys = [k async for k in client.scan_iter(match=f"{self.prefix}:*", count=500)]
            if keys:
                await client.delete(*keys)
        finally:
            await client.aclose()


@pytest.fixture(params=BUS_KINDS)
async def make_bus(request):
    """Handles on one bus of the parametrised kind (see the module docstring)."""
    if request.param == "redis" and not redis_reachable():
        pytest.skip(f"no Redis at {REDIS_URL}")
    factory = BusFactory(request.param)
    yield factory
    await factory.cleanup()


@pytest.fixture
def anyio_backend():
    return "asyncio"
