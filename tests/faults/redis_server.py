"""A private redis-server process that a test stops and starts again (the shared Redis at
127.0.0.1:6379 is never restarted by a test)."""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

__all__ = ["RedisServer", "free_port", "redis_server_binary"]


def redis_server_binary() -> str | None:
    return shutil.which("redis-server")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    """redis-server on a free localhost port with its files in `directory`. `persistent`: an
    append-only file fsynced on every write (a restart keeps every acknowledged write), else no
    persistence at all (a restart loses everything)."""

    def __init__(self, directory: Path, *, persistent: bool = True):
        self.directory = directory
        self.persistent = persistent
        self.port = free_port()
        self.process: subprocess.Popen | None = None
        directory.mkdir(parents=True, exist_ok=True)

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 20.0) -> RedisServer:
        persistence = ["--appendonly", "yes", "--appendfsync", "always"] if self.persistent else ["--appendonly", "no"]
        self.process = subprocess.Popen(
            [redis_server_binary() or "redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.directory),
             "--save", "", *persistence, "--logfile", str(self.directory / "redis.log")],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout
        while not self._answers_ping():
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"redis-server on port {self.port} did not start (see {self.directory / 'redis.log'})")
            time.sleep(0.05)
        return self

    def stop(self, sig: signal.Signals = signal.SIGTERM, timeout: float = 20.0) -> None:
        """SIGTERM: Redis flushes its append-only file and exits; SIGKILL: a crash."""
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(sig)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()

    def _answers_ping(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as s:
                s.sendall(b"PING\r\n")
                return s.recv(64).startswith(b"+PONG")
        except OSError:
            return False
