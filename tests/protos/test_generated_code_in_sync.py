"""The checked-in generated code is exactly what scripts/gen_protos.sh makes from protos/ (the CI
check: edit a .proto, run `bash scripts/gen_protos.sh`, commit both), and its descriptors are
served by gRPC server reflection next to grpc.health.v1."""

from __future__ import annotations

import filecmp
import os
import subprocess
import sys
from concurrent import futures
from pathlib import Path

import grpc
import pytest

ROOT = Path(__file__).resolve().parents[2]
CHECKED_IN = ROOT / "dspark" / "protos" / "dspark"


def _files(d: Path) -> list[str]:
    return sorted(str(p.relative_to(d)) for p in d.rglob("*") if p.is_file() and "__pycache__" not in p.parts)


@pytest.mark.processes
def test_generated_code_is_byte_identical_to_a_fresh_regeneration(tmp_path):
    proc = subprocess.run(
        ["bash", str(ROOT / "scripts" / "gen_protos.sh"), str(tmp_path)],
        capture_output=True, text=True, check=False, env={**os.environ, "PYTHON": sys.executable},
    )
    assert proc.returncode == 0, f"gen_protos.sh failed:\n{proc.stderr}"
    fresh = tmp_path / "dspark"
    assert _files(fresh) == _files(CHECKED_IN), "generated file set differs: run `bash scripts/gen_protos.sh`"
    _, mismatch, errors = filecmp.cmpfiles(fresh, CHECKED_IN, _files(fresh), shallow=False)
    assert not mismatch and not errors, f"stale generated code {mismatch + errors}: run `bash scripts/gen_protos.sh`"


def test_every_proto_has_generated_modules():
    protos = sorted(p.stem for p in (ROOT / "protos" / "dspark" / "v1").glob("*.proto"))
    assert protos == ["common", "drafter", "scheduler", "verifier"]
    for stem in protos:
        assert (CHECKED_IN / "v1" / f"{stem}_pb2.py").is_file()
        assert (CHECKED_IN / "v1" / f"{stem}_pb2_grpc.py").is_file()


def test_service_names_are_exported_under_the_versioned_package():
    from dspark.protos import SERVICE_NAMES

    assert SERVICE_NAMES == ("dspark.v1.Drafter", "dspark.v1.Verifier", "dspark.v1.Scheduler")


def test_reflection_serves_the_service_descriptors_and_health_answers():
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc
    from grpc_reflection.v1alpha import reflection
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
        ProtoReflectionDescriptorDatabase,
    )

    from dspark.protos import SERVICE_NAMES
    from dspark.protos.dspark.v1 import drafter_pb2_grpc  # noqa: F401  (registers nothing; import check)

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    names = SERVICE_NAMES + (health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME)
    reflection.enable_server_reflection(names, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        for name in SERVICE_NAMES:
            health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            db = ProtoReflectionDescriptorDatabase(channel)
            assert set(SERVICE_NAMES) <= set(db.get_services())
            verify = db.FindFileContainingSymbol("dspark.v1.Verifier")
            assert verify.name == "dspark/v1/verifier.proto" and verify.package == "dspark.v1"
            assert "dspark/v1/common.proto" in verify.dependency
            methods = {m.name for m in verify.service[0].method}
            assert methods == {"AddRequest", "RemoveRequest", "Verify", "GetSPSProfile", "GetInfo"}
            status = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service="dspark.v1.Drafter"), timeout=5
            )
            assert status.status == health_pb2.HealthCheckResponse.SERVING
    finally:
        server.stop(None)


@pytest.mark.parametrize(
    "service, streaming",
    [("Drafter", {"Draft"}), ("Verifier", set()), ("Scheduler", {"Submit"})],
)
def test_only_the_round_and_the_token_stream_are_server_streaming(service, streaming):
    from dspark.protos.dspark.v1 import drafter_pb2, scheduler_pb2, verifier_pb2

    module = {"Drafter": drafter_pb2, "Verifier": verifier_pb2, "Scheduler": scheduler_pb2}[service]
    methods = module.DESCRIPTOR.services_by_name[service].methods
    assert {m.name for m in methods if m.server_streaming} == streaming
    assert not any(m.client_streaming for m in methods)
