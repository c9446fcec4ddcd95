"""services/supervisor.py: `dspark up` keeps its services running.

Specification: a child that exits (or is killed) is started again with the same command after
its backoff, and the restart is reported with the exit status; the backoff doubles with each exit
up to its maximum and starts over for a child that ran long enough; a running child is left alone.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import pytest

from services.supervisor import RestartPolicy, Supervisor, describe_exit
from tests.polling import wait_until

EXITS_AT_ONCE = [sys.executable, "-c", "import sys; sys.exit(3)"]
RUNS = [sys.executable, "-c", "import time; time.sleep(60)"]


@pytest.fixture
def supervisor():
    reports = []
    made = Supervisor(lambda cmd: subprocess.Popen(cmd), on_restart=lambda child, status: reports.append((child.name, status)),
                      policy=RestartPolicy(initial_backoff_s=0.2, max_backoff_s=0.4, reset_after_s=30.0))
    made.reports = reports
    yield made
    for _, process in made.processes():
        if process.poll() is None:
            process.kill()
            process.wait()


@pytest.mark.processes
def test_a_killed_child_is_started_again_with_its_command_and_reported(supervisor):
    first = supervisor.start("verifier", RUNS)
    supervisor.start("drafter", RUNS)
    first.send_signal(signal.SIGKILL)
    first.wait()
    assert wait_until(lambda: supervisor.poll() or supervisor.reports, 10)
    (child, drafter) = supervisor.children
    assert supervisor.reports == [("verifier", -signal.SIGKILL)]
    assert child.restarts == 1 and child.process.pid != first.pid and child.process.poll() is None
    assert child.process.args == RUNS
    assert drafter.restarts == 0  # the others are left alone


@pytest.mark.processes
def test_the_backoff_doubles_up_to_its_maximum_for_a_child_that_keeps_exiting(supervisor):
    supervisor.start("scheduler", EXITS_AT_ONCE)
    (child,) = supervisor.children
    waits = []
    while child.restarts < 3:
        before = time.monotonic()
        supervisor.poll()
        if child.restart_at is not None and len(waits) == child.restarts:
            waits.append(child.restart_at - before)  # the backoff, plus the poll's own (tiny) time
        time.sleep(0.01)
    assert [b <= w < b + 0.15 for w, b in zip(waits, (0.2, 0.4, 0.4), strict=True)] == [True] * 3
    assert [status for _, status in supervisor.reports] == [3, 3, 3]


@pytest.mark.processes
def test_a_child_that_ran_long_enough_starts_over_at_the_initial_backoff():
    policy = RestartPolicy(initial_backoff_s=0.1, max_backoff_s=10.0, reset_after_s=0.3)
    sup = Supervisor(lambda cmd: subprocess.Popen(cmd), policy=policy)
    sup.start("gateway", [sys.executable, "-c", "import time; time.sleep(0.5)"])
    (child,) = sup.children
    child.backoff_s = 8.0  # as after several quick exits
    assert wait_until(lambda: sup.poll() or child.restart_at is not None, 10)
    assert child.restart_at - time.monotonic() <= 0.1
    child.process.wait()


def test_exits_are_described_by_status_or_signal():
    assert describe_exit(3) == "exited with status 3"
    assert describe_exit(-signal.SIGKILL) == "was killed by SIGKILL"
