"""`dspark serve` as a subprocess for one policy: a free port, wait for /health, stop it after.

    spec = ServerSpec(drafter="dspark", drafter_path="runs/dspark/final", gamma=7)
    with running_server(serve_command("dspark", spec, port=free_port()), url=..., log_path=...) as url:
        ...                                     # load it

Policy `none` is served as plain decoding (`--drafter none`): the baseline the others must not
fall below pays no drafting cost. Every other policy runs the same drafter (`--policy P`), so a
comparison differs in the scheduling only. The server's output goes to a log file; if it exits
or does not become healthy in time, the error carries the log's last lines.
"""

from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx

NONE_POLICY = "none"


@dataclass(frozen=True)
class ServerSpec:
    """What every server of a benchmark run shares (the target, the drafter, γ)."""

    drafter: str = "dspark"
    drafter_path: str | None = None  # None: the drafter's shipped checkpoint, if any
    gamma: int = 7
    model: str = "smollm2-135m-instruct"
    dtype: str = "auto"
    kv_budget_mb: int | None = None  # None: `dspark serve`'s default
    sps_max_batch: int | None = None  # None: `dspark serve`'s default
    max_tokens_limit: int | None = None
    host: str = "127.0.0.1"


def serve_command(policy: str, spec: ServerSpec, *, port: int) -> list[str]:
    """The `dspark serve` command line for `policy` (validated by the server itself)."""
    cmd = [sys.executable, "-m", "dspark.cli", "serve", "--host", spec.host, "--port", str(port),
           "--model", spec.model, "--dtype", spec.dtype]
    if policy.strip().lower() == NONE_POLICY:
        cmd += ["--drafter", "none", "--policy", NONE_POLICY]
    else:
        cmd += ["--drafter", spec.drafter, "--gamma", str(spec.gamma), "--policy", policy]
        if spec.drafter_path:
            cmd += ["--drafter-path", spec.drafter_path]
    for flag, value in (("--kv-budget-mb", spec.kv_budget_mb), ("--sps-max-batch", spec.sps_max_batch),
                        ("--max-tokens-limit", spec.max_tokens_limit)):
        if value is not None:
            cmd += [flag, str(value)]
    return cmd


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on right now (the OS's pick)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _log_tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def wait_for_health(url: str, process: subprocess.Popen, *, timeout_s: float, log_path: Path, poll_s: float = 0.5) -> float:
    """Poll GET {url}/health until it answers 200; returns the seconds waited. RuntimeError if the
    process exits first, TimeoutError after `timeout_s`; both quote the end of the server's log."""
    t0 = time.monotonic()
    with httpx.Client(timeout=5.0) as client:
        while True:
            code = process.poll()
            if code is not None:
                raise RuntimeError(f"the server exited with code {code} before it was healthy; "
                                   f"the end of {log_path}:\n{_log_tail(log_path)}")
            with contextlib.suppress(httpx.HTTPError):
                if client.get(f"{url}/health").status_code == 200:
                    return time.monotonic() - t0
            if time.monotonic() - t0 > timeout_s:
                raise TimeoutError(f"the server was not healthy after {timeout_s:.0f} s; the end of {log_path}:\n"
                                   f"{_log_tail(log_path)}")
            time.sleep(poll_s)


def stop_process(process: subprocess.Popen, *, grace_s: float = 30.0) -> int:
    """SIGTERM (uvicorn shuts down gracefully, the engine thread stops), SIGKILL after `grace_s`."""
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(grace_s)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
    return process.returncode


@contextlib.contextmanager
def running_server(command: Sequence[str], *, url: str, log_path: str | Path, start_timeout_s: float = 900.0) -> Iterator[str]:
    """Start `command`, wait until `url`/health answers, yield `url`; stop the process on exit."""
    log_path = Path(log_path)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("w") as log:
        process = subprocess.Popen(list(command), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        try:
            wait_for_health(url, process, timeout_s=start_timeout_s, log_path=log_path)
            yield url
        finally:
            stop_process(process)
