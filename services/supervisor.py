"""Keep `dspark up`'s services running: a child process that exits is started again, with backoff,
as Kubernetes restarts a pod's container (restartPolicy Always, CrashLoopBackOff).

    supervisor = Supervisor(lambda cmd: subprocess.Popen(cmd, start_new_session=True))
    supervisor.start("verifier", [sys.executable, "-m", "dspark.cli", "verifier", ...])
    while True:
        supervisor.poll()          # notices exits, restarts what is due
        time.sleep(0.5)

Backoff: a child that exits is started again after `initial_backoff_s`, doubling on each exit up
to `max_backoff_s`; a child that ran for `reset_after_s` before exiting starts over at the
initial backoff. Every exit is logged with its status and every restart reported by `on_restart`
(`dspark up` prints one JSON line per restart on stdout). The services tolerate each other's
restarts (dspark/engine/faults.py, dspark/bus/redis_bus.py), so nothing else is restarted with one.
"""

from __future__ import annotations

import logging
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["Child", "RestartPolicy", "Supervisor"]

log = logging.getLogger("dspark.up")


@dataclass(frozen=True)
class RestartPolicy:
    initial_backoff_s: float = 1.0  # wait before restarting a child that exited
    max_backoff_s: float = 60.0  # the wait doubles with each exit up to this
    reset_after_s: float = 120.0  # a child that ran this long before exiting starts over at the initial wait

    def __post_init__(self) -> None:
        if not 0 < self.initial_backoff_s <= self.max_backoff_s:
            raise ValueError(f"need 0 < initial_backoff_s <= max_backoff_s, got {self.initial_backoff_s}, {self.max_backoff_s}")


@dataclass
class Child:
    name: str
    command: list[str]
    process: subprocess.Popen
    started_at: float  # time.monotonic()
    backoff_s: float  # the wait before its next restart
    restarts: int = 0
    restart_at: float | None = None  # set while it is down and waiting to be started again


def describe_exit(status: int) -> str:
    if status < 0:
        try:
            return f"was killed by {signal.Signals(-status).name}"
        except ValueError:
            return f"was killed by signal {-status}"
    return f"exited with status {status}"


class Supervisor:
    def __init__(
        self,
        spawn: Callable[[list[str]], subprocess.Popen],
        *,
        policy: RestartPolicy = RestartPolicy(),  # frozen: one shared default is safe
        on_restart: Callable[[Child, int], None] | None = None,  # (child, exit status of the process it replaces)
    ):
        self._spawn = spawn
        self.policy = policy
        self.on_restart = on_restart
        self.children: list[Child] = []

    def start(self, name: str, command: list[str]) -> subprocess.Popen:
        process = self._spawn(command)
        self.children.append(Child(name=name, command=command, process=process, started_at=time.monotonic(),
                                   backoff_s=self.policy.initial_backoff_s))
        log.info("started %s (pid %d): %s", name, process.pid, " ".join(command[2:]))
        return process

    def processes(self) -> list[tuple[str, subprocess.Popen]]:
        """(name, process) of every child, in start order (a child waiting for its restart: the exited one)."""
        return [(c.name, c.process) for c in self.children]

    def poll(self) -> None:
        """Notice children that exited and start again those whose backoff is over."""
        now = time.monotonic()
        for child in self.children:
            if child.restart_at is None:
                status = child.process.poll()
                if status is None:
                    continue
                ran_s = now - child.started_at
                if ran_s >= self.policy.reset_after_s:
                    child.backoff_s = self.policy.initial_backoff_s
                child.restart_at = now + child.backoff_s
                log.warning("%s (pid %d) %s after %.1f s; restarting it in %.1f s", child.name, child.process.pid,
                            describe_exit(status), ran_s, child.backoff_s)
                child.backoff_s = min(2 * child.backoff_s, self.policy.max_backoff_s)
            elif now >= child.restart_at:
                status = child.process.returncode
                child.process = self._spawn(child.command)
                child.started_at, child.restart_at = now, None
                child.restarts += 1
                log.warning("restarted %s (pid %d, restart %d)", child.name, child.process.pid, child.restarts)
                if self.on_restart is not None:
                    self.on_restart(child, status)
