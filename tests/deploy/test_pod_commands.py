"""The command a pod of deploy/k8s runs, run here as a process: what the kubelet would start.

The gateway pod's args, expanded from the environment the manifests give it (the serving
ConfigMap, the API-key Secret), start `dspark gateway`; its probe endpoint /health must answer
200 once Redis is reachable, and the model it serves must be the configured one. Only the
addresses that point into the cluster are replaced: Redis by the test Redis
(DSPARK_TEST_REDIS_URL, default 127.0.0.1:6379, as in tests/bus) and the listening address by a
free loopback port. Slow: the gateway loads the default model's tokenizer and config.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from urllib.parse import urlsplit

import pytest

from dspark.serving_config import ServingConfig
from tests.deploy.manifests import REPO, container_env, container_ports, expand_args, render, the_container

REDIS_URL = os.environ.get("DSPARK_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")


def _reachable(url: str) -> bool:
    parts = urlsplit(url)
    try:
        with socket.create_connection((parts.hostname or "127.0.0.1", parts.port or 6379), timeout=0.5):
            return True
    except OSError:
        return False


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


@pytest.mark.slow
@pytest.mark.processes
def test_gateway_pod_command_serves_its_health_probe_and_the_configured_model(tmp_path):
    if not _reachable(REDIS_URL):
        pytest.skip(f"no Redis at {REDIS_URL}")
    objects = render("base")
    container = the_container(objects, "gateway")
    port = _free_port()
    env = container_env(container, objects) | {
        "DSPARK_REDIS_URL": REDIS_URL, "DSPARK_GATEWAY_HOST": "127.0.0.1", "DSPARK_GATEWAY_PORT": str(port),
    }
    config = ServingConfig.load(None, env=env)
    argv = expand_args(container["args"], env)
    assert argv[argv.index("--port") + 1] == str(port) and argv[argv.index("--redis") + 1] == REDIS_URL
    process_env = {k: v for k, v in os.environ.items() if not k.startswith("DSPARK_") or k == "DSPARK_CACHE_DIR"} | env
    log = tmp_path / "gateway.log"
    with log.open("w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "dspark.cli", *argv], cwd=REPO, env=process_env,
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 300  # imports torch + transformers: minutes on a loaded 2-core machine
        status, health = None, {}
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                status, health = _get(base + "/health")
            except OSError:
                status = None  # not listening yet
            if status == 200:
                break
            time.sleep(0.5)
        assert proc.poll() is None, f"the gateway exited:\n{log.read_text()}"
        assert status == 200 and health["status"] == "ok", f"/health answered {status}: {health}\n{log.read_text()}"
        # the probe's path and port are these (the manifests' port, here replaced by a free one)
        assert container["readinessProbe"]["httpGet"]["path"] == "/health"
        assert container_ports(container)["http"] == ServingConfig.load(None, env=container_env(container, objects)).gateway.port
        status, models = _get(base + "/v1/models")  # no API key: the committed Secret holds none
        assert status == 200 and [m["id"] for m in models["data"]] == [config.model.name]
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
