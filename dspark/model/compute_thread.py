"""One thread per process runs the model's torch work, and the thread that loaded it lets go.

Why (measured, docs/results/serving.md "The serving path at one request"): torch's CPU kernels
run in OpenMP parallel regions, and OpenMP (libgomp, which the torch wheels ship) keeps one pool
of worker threads per thread that has ever started a region. libgomp lets idle workers spin
between regions only while the process has no more OpenMP threads than CPUs; past that it
"throttles" them to sleep at once, and every one of the forward's thousands of small regions then
pays a futex wake-up. On a 2-core machine a second pool is enough: the model loaded and warmed up
on the main thread and then served from an engine thread decoded 55 tok/s where the same
forward on one thread decoded 82 (a 1.5x slower serving path, all of it here, none in HTTP).

So a process that serves keeps its torch work on one thread: the embedded server and the
scheduler on AsyncEngine's engine thread (dspark/engine/async_engine.py), the gRPC verifier and
drafter on a ComputeThread that every handler hands its call to, and the thread that loaded and
warmed up the model calls `release_openmp_workers()` before handing over.
"""

from __future__ import annotations

import ctypes
import functools
import queue
import re
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import TypeVar

__all__ = ["ComputeThread", "openmp_library", "release_openmp_workers"]

T = TypeVar("T")

OMP_PAUSE_SOFT = 1  # omp_pause_resource_t: free the threads, keep the library usable (OpenMP 5.0 §3.2.43)
_OPENMP_NAME = re.compile(r"/lib(gomp|iomp5|omp)[-.\w]*\.so[.\d]*$")


@functools.cache
def openmp_library() -> ctypes.CDLL | None:
    """The OpenMP runtime this process has loaded (libgomp of the torch wheel, or libomp /
    libiomp5), found in /proc/self/maps so that it is the very copy torch calls; None where there
    is none or no /proc (then nothing here is needed or possible)."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if _OPENMP_NAME.search(line.strip())}
    except OSError:
        return None
    for path in sorted(paths):
        try:
            lib = ctypes.CDLL(path)  # the loaded copy: dlopen of a loaded file returns its handle
            lib.omp_pause_resource_all.argtypes = [ctypes.c_int]
            return lib
        except (OSError, AttributeError):  # not loadable, or an OpenMP older than 5.0
            continue
    return None


def release_openmp_workers() -> bool:
    """Free the calling thread's OpenMP worker pool (omp_pause_resource_all, soft): after a
    thread has loaded or warmed up the model and another thread will run it. A later parallel
    region on this thread builds a new pool, so call it when this thread is done with torch.
    True if the runtime released it."""
    lib = openmp_library()
    return lib is not None and lib.omp_pause_resource_all(OMP_PAUSE_SOFT) == 0


class ComputeThread:
    """A single thread that runs every call handed to it, in order: the one compute thread of a
    service whose requests arrive on a pool of gRPC threads. `run` blocks its caller until the
    call returns and returns its result or raises its exception, so it serialises the calls as a
    lock would, and the model's OpenMP pool stays one pool."""

    def __init__(self, name: str):
        self._calls: queue.SimpleQueue[tuple[Callable[[], object], Future] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)
        self._thread.start()

    @property
    def ident(self) -> int | None:
        return self._thread.ident

    def run(self, fn: Callable[..., T], *args, **kwargs) -> T:
        if threading.get_ident() == self._thread.ident:  # a call from inside a call: run it here
            return fn(*args, **kwargs)
        if not self._thread.is_alive():
            raise RuntimeError(f"compute thread {self._thread.name!r} has stopped")
        done: Future = Future()
        self._calls.put((functools.partial(fn, *args, **kwargs), done))
        return done.result()

    def stop(self, timeout: float | None = 10.0) -> None:
        """Finish the queued calls, then end the thread."""
        self._calls.put(None)
        self._thread.join(timeout)

    def _main(self) -> None:
        while (item := self._calls.get()) is not None:
            call, done = item
            try:
                done.set_result(call())
            except BaseException as exc:  # handed back to the caller, who raises it
                done.set_exception(exc)
