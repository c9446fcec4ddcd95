"""One request, one trace, across processes: spans exported over OTLP to a receiver in the test.

Specification: the verifier and the drafter run as `dspark verifier` / `dspark drafter`
processes (the tiny random model, the n-gram drafter), the gateway, bus worker and engine in the
test process; all three export their spans over OTLP to a receiver (tests/observability/
otlp_receiver.py): the verifier configured through DSPARK_OBSERVABILITY_* (OTLP/gRPC), the
drafter through the OpenTelemetry SDK's own variables as deploy/k8s sets them (OTLP/HTTP), the
test process through make_tracer_provider (OTLP/HTTP). One HTTP request with a client's
traceparent yields spans of that one trace from all three processes, and each remote SERVER
span is the child of the CLIENT span the test process exported for that very call.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from dspark.engine.async_engine import AsyncEngine
from dspark.engine.speculative import SpeculativeEngine
from dspark.observability import tracing
from dspark.protos import DRAFTER_SERVICE, VERIFIER_SERVICE
from gateway.server import embedded_gateway
from services.drafter.client import RemoteDrafter
from services.grpc_common import wait_until_serving
from services.verifier.client import RemoteVerifier
from tests.gateway.conftest import ByteTokenizer, live_server
from tests.observability.conftest import CLIENT_TRACE_ID, CLIENT_TRACEPARENT
from tests.observability.otlp_receiver import OtlpReceiver
from tests.polling import wait_until

pytestmark = pytest.mark.processes  # gateway, scheduler, drafter and verifier processes

ROOT = Path(__file__).resolve().parents[2]
MODEL = "tiny-random"
SERVER, CLIENT = 2, 3  # OTLP span kinds


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(name: str, argv: list[str], env: dict[str, str], log_dir: Path) -> subprocess.Popen:
    base = {k: v for k, v in os.environ.items() if not k.startswith(("DSPARK_", "OTEL_")) or k == "DSPARK_CACHE_DIR"}
    log = (log_dir / f"{name}.log").open("w")
    return subprocess.Popen([sys.executable, "-m", "dspark.cli", name, *argv], cwd=ROOT, env=base | env, stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True)


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def test_one_request_is_one_trace_across_the_gateway_drafter_and_verifier_processes(tiny_model_dir, tmp_path):
    model = ["--model", str(tiny_model_dir), "--dtype", "bfloat16", "--drafter", "ngram", "--host", "127.0.0.1"]
    verifier_port, drafter_port = _free_port(), _free_port()
    fast_export = {"OTEL_BSP_SCHEDULE_DELAY": "100"}  # the SDK's batch delay, ms: spans leave within a tenth of a second
    with OtlpReceiver() as receiver:
        processes = [
            _start("verifier", [*model, "--port", str(verifier_port), "--sps-max-batch", "0"], fast_export | {
                "DSPARK_OBSERVABILITY_OTLP_ENDPOINT": receiver.grpc_endpoint, "DSPARK_OBSERVABILITY_OTLP_PROTOCOL": "grpc"},
                tmp_path),
            _start("drafter", [*model, "--port", str(drafter_port)], fast_export | {
                "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.http_endpoint, "OTEL_SERVICE_NAME": "dspark-drafter-under-test"},
                tmp_path),
        ]
        provider = tracing.make_tracer_provider(tracing.TracingSettings(
            endpoint=receiver.http_endpoint, protocol="http/protobuf", service_name="dspark-gateway-under-test",
            sample_ratio=1.0))
        try:
            for proc, port, service in zip(processes, (verifier_port, drafter_port), (VERIFIER_SERVICE, DRAFTER_SERVICE)):
                try:
                    wait_until_serving(f"127.0.0.1:{port}", service, timeout=300, alive=lambda p=proc: p.poll() is None)
                except (RuntimeError, TimeoutError) as e:
                    pytest.fail(f"{e}:\n" + "\n".join(p.read_text() for p in tmp_path.glob("*.log")))
            verifier, drafter = RemoteVerifier(f"127.0.0.1:{verifier_port}"), RemoteDrafter(f"127.0.0.1:{drafter_port}")
            spec = SpeculativeEngine.from_parts(verifier=verifier, drafter=drafter, num_speculative_tokens=3)
            engine = AsyncEngine(spec).start()
            gateway = embedded_gateway(engine, ByteTokenizer(), model_name=MODEL)
            try:
                with tracing.use_tracer_provider(provider), live_server(gateway.app) as url:
                    reply = httpx.post(f"{url}/v1/completions", timeout=120, headers={"traceparent": CLIENT_TRACEPARENT},
                                       json={"model": MODEL, "prompt": "abcdabcdabcd", "max_tokens": 12, "temperature": 0})
                    assert reply.status_code == 200, reply.text
                    names = {"scheduler.request", "dspark.v1.Verifier/Verify", "dspark.v1.Drafter/Draft"}

                    def all_arrived() -> bool:
                        provider.force_flush()
                        got = {(s.service_name, s.name) for s in receiver.spans()}
                        return {("dspark-gateway-under-test", n) for n in names} | {
                            ("dspark-verifier", "dspark.v1.Verifier/Verify"),
                            ("dspark-drafter-under-test", "dspark.v1.Drafter/Draft")} <= got

                    assert wait_until(all_arrived, 60), sorted({(s.service_name, s.name) for s in receiver.spans()})
            finally:
                gateway.close()
                engine.shutdown()
                verifier.close()
                drafter.close()
        finally:
            for proc in processes:
                _stop(proc)
            provider.shutdown()
        received = receiver.spans()

    assert {s.trace_id for s in received} == {CLIENT_TRACE_ID}  # one trace, whatever the process
    by_service = {}
    for s in received:
        by_service.setdefault(s.service_name, []).append(s)
    assert set(by_service) == {"dspark-gateway-under-test", "dspark-verifier", "dspark-drafter-under-test"}
    assert {s.transport for s in by_service["dspark-verifier"]} == {"grpc"}
    assert {s.transport for s in by_service["dspark-drafter-under-test"]} == {"http"}
    local_clients = {s.span_id: s.name for s in by_service["dspark-gateway-under-test"] if s.kind == CLIENT}
    for service in ("dspark-verifier", "dspark-drafter-under-test"):
        servers = [s for s in by_service[service] if s.kind == SERVER]
        assert servers
        for s in servers:  # the context crossed the process boundary in the call's metadata
            assert local_clients.get(s.parent_span_id) == s.name
