"""One compute thread per process (dspark/model/compute_thread.py).

Specification: a ComputeThread runs every call handed to it on its one thread, whichever thread
hands it over, and gives back the call's result or raises its exception in the caller (a call
made from inside a call runs in place); `release_openmp_workers` frees the calling thread's
OpenMP worker pool, so that a thread that loaded a model leaves no second pool behind (the
pool's workers are real threads: /proc/self/task counts them), and a later parallel region on
that thread builds a new one.
"""

from __future__ import annotations

import os
import threading

import pytest
import torch

from dspark.model.compute_thread import ComputeThread, openmp_library, release_openmp_workers

needs_openmp_pool = pytest.mark.skipif(
    openmp_library() is None or torch.get_num_threads() < 2 or not os.path.isdir("/proc/self/task"),
    reason="needs a loaded OpenMP runtime with 2+ threads and /proc (Linux)",
)


def os_threads() -> int:
    return len(os.listdir("/proc/self/task"))


def parallel_region() -> None:
    """A torch op large enough to be split over the OpenMP threads (at::parallel_for's grain is 32k)."""
    torch.rand(1 << 21).exp_()


def on_a_fresh_thread(fn):
    out: list = []
    thread = threading.Thread(target=lambda: out.append(fn()))
    thread.start()
    thread.join()
    return out[0]


def test_a_compute_thread_runs_every_call_on_its_one_thread_in_order():
    compute = ComputeThread("test-compute")
    try:
        seen: list[int] = []
        callers = [threading.Thread(target=lambda: seen.append(compute.run(threading.get_ident))) for _ in range(8)]
        for t in callers:
            t.start()
        for t in callers:
            t.join()
        assert seen == [compute.ident] * 8 and compute.ident != threading.get_ident()
        assert compute.run(lambda a, b=0: a + b, 2, b=3) == 5
        assert compute.run(lambda: compute.run(threading.get_ident)) == compute.ident  # nested: runs in place
    finally:
        compute.stop()


def test_a_calls_exception_is_raised_in_its_caller_and_the_thread_goes_on():
    compute = ComputeThread("test-compute")
    try:
        with pytest.raises(ZeroDivisionError):
            compute.run(lambda: 1 / 0)
        assert compute.run(lambda: "still here") == "still here"
    finally:
        compute.stop()
    with pytest.raises(RuntimeError, match="has stopped"):
        compute.run(lambda: None)


@needs_openmp_pool
def test_release_frees_the_calling_threads_openmp_workers_and_a_later_region_builds_them_again():
    workers = torch.get_num_threads() - 1  # the thread that starts a region is one of its threads

    def measure() -> tuple[int, int, int, bool]:
        parallel_region()
        with_pool = os_threads()
        released = release_openmp_workers()
        without_pool = os_threads()
        parallel_region()
        return with_pool, without_pool, os_threads(), released

    with_pool, without_pool, again, released = on_a_fresh_thread(measure)
    assert released
    assert without_pool == with_pool - workers
    assert again == with_pool
