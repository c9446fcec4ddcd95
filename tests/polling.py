"""Polling helper for tests that wait on another thread (engine loop, server)."""

from __future__ import annotations

import time


def wait_until(cond, timeout: float = 15.0) -> bool:
    """Poll `cond()` every 20 ms until it is true (True) or `timeout` seconds pass (False)."""
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True
