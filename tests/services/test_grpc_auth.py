"""Authentication of the internal gRPC calls (services/grpc_auth.py), on the real servers.

Specification: with rpc.auth_token set, every service (verifier, drafter: thread-pool servers;
scheduler: grpc.aio) answers a call without the token, or with another one, with UNAUTHENTICATED
and a message that says what to send, unary and streaming calls alike, and server reflection
too; grpc.health.v1 stays open (kubelet probes send no metadata); a channel made with the token
(make_channel, the Remote* clients) is served; a server without a token serves anyone; `dspark
up` gives its children a random token unless one is configured; a token too short to be a
secret is a configuration error; no token, right or wrong, appears in the logs or the traces.
"""

from __future__ import annotations

import logging

import grpc
import pytest
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from dspark.drafters.ngram import NgramDrafter
from dspark.engine.async_engine import AsyncEngine
from dspark.engine.speculative import SpeculativeEngine
from dspark.engine.verifier import LocalVerifier
from dspark.protos import DRAFTER_SERVICE, SCHEDULER_SERVICE, VERIFIER_SERVICE
from dspark.protos.dspark.v1 import (
    common_pb2,
    drafter_pb2,
    drafter_pb2_grpc,
    scheduler_pb2,
    scheduler_pb2_grpc,
    verifier_pb2,
    verifier_pb2_grpc,
)
from dspark.serving_config import ServingConfig
from services.drafter.client import RemoteDrafter
from services.grpc_auth import generate_token, warn_if_exposed
from services.grpc_common import ServiceError, check_health, make_channel
from services.verifier.client import RemoteVerifier

TOKEN = generate_token()


@pytest.fixture
def guarded(serve, tiny_runtime_factory):
    """(verifier, drafter, scheduler) addresses, each requiring TOKEN."""
    verifier = serve.verifier(LocalVerifier(tiny_runtime_factory(kv_budget_tokens=100)), auth_token=TOKEN)
    drafter = serve.drafter(NgramDrafter(), vocab_size=256, auth_token=TOKEN)
    engine = AsyncEngine(SpeculativeEngine(tiny_runtime_factory(), NgramDrafter())).start()
    try:
        yield verifier, drafter, serve.scheduler(engine, auth_token=TOKEN)
    finally:
        serve.stop_all()
        engine.shutdown()


def _one_call_of_each_service(channels):
    """A unary call on each service and a server-streaming one (Drafter.Draft, Scheduler.Submit)."""
    verifier, drafter, scheduler = channels
    request = scheduler_pb2.GenerationRequest(request_id="auth", prompt_ids=[1, 2, 3], max_new_tokens=2,
                                              params=common_pb2.SamplingParams(temperature=0.0, top_p=1.0))
    return [
        lambda: verifier_pb2_grpc.VerifierStub(verifier).GetInfo(verifier_pb2.GetVerifierInfoRequest(), timeout=10),
        lambda: drafter_pb2_grpc.DrafterStub(drafter).GetInfo(drafter_pb2.GetDrafterInfoRequest(), timeout=10),
        lambda: list(drafter_pb2_grpc.DrafterStub(drafter).Draft(drafter_pb2.DraftRoundRequest(round_id=1), timeout=10)),
        lambda: scheduler_pb2_grpc.SchedulerStub(scheduler).Stats(scheduler_pb2.StatsRequest(), timeout=10),
        lambda: list(scheduler_pb2_grpc.SchedulerStub(scheduler).Submit(request, timeout=30)),
    ]


def _refusal(call) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as info:
        call()
    return info.value.code(), info.value.details()


@pytest.mark.parametrize("token, message", [(None, "requires the internal token"), ("not-the-token-" * 2, "is not this deployment")])
def test_every_service_refuses_calls_without_the_token_or_with_another(guarded, token, message):
    channels = [make_channel(address, auth_token=token or "") for address in guarded]
    try:
        for call in _one_call_of_each_service(channels):
            code, details = _refusal(call)
            assert code == grpc.StatusCode.UNAUTHENTICATED and message in details
    finally:
        for channel in channels:
            channel.close()


def test_calls_with_the_token_are_served(guarded):
    channels = [make_channel(address, auth_token=TOKEN) for address in guarded]
    try:
        verifier_info, drafter_info, draft, stats, outputs = (call() for call in _one_call_of_each_service(channels))
        assert verifier_info.vocab_size == 256 and drafter_info.name == "ngram"
        assert draft == [] and stats.num_finished >= 0
        assert outputs[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH and sum(len(o.new_token_ids) for o in outputs) == 2
    finally:
        for channel in channels:
            channel.close()


def test_the_remote_clients_send_the_token_and_fail_clearly_without_it(guarded):
    verifier_address, drafter_address, _ = guarded
    assert RemoteVerifier(verifier_address, auth_token=TOKEN).vocab_size == 256
    assert RemoteDrafter(drafter_address, auth_token=TOKEN).name == "ngram"
    with pytest.raises(ServiceError, match="UNAUTHENTICATED.*requires the internal token"):
        RemoteVerifier(verifier_address, connect_timeout_s=5)


def test_health_stays_open_and_reflection_needs_the_token(guarded):
    for address, service in zip(guarded, (VERIFIER_SERVICE, DRAFTER_SERVICE, SCHEDULER_SERVICE)):
        with grpc.insecure_channel(address) as anonymous:
            assert check_health(anonymous) and check_health(anonymous, service)  # what a kubelet probe does
            with pytest.raises(grpc.RpcError) as info:
                ProtoReflectionDescriptorDatabase(anonymous).get_services()
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with make_channel(address, auth_token=TOKEN) as channel:
            assert service in ProtoReflectionDescriptorDatabase(channel).get_services()


def test_a_server_without_a_token_serves_anyone(serve):
    with grpc.insecure_channel(serve.drafter(NgramDrafter(), vocab_size=256)) as channel:
        assert drafter_pb2_grpc.DrafterStub(channel).GetInfo(drafter_pb2.GetDrafterInfoRequest(), timeout=10).name == "ngram"


def test_listening_beyond_this_machine_without_a_token_is_warned_about(caplog):
    with caplog.at_level(logging.WARNING, logger="services.grpc_auth"):
        warn_if_exposed("127.0.0.1:50053", "", "verifier")
        warn_if_exposed("0.0.0.0:50053", TOKEN, "verifier")
        assert not caplog.records
        warn_if_exposed("0.0.0.0:50053", "", "verifier")
    (record,) = caplog.records
    assert "without rpc.auth_token" in record.getMessage() and TOKEN not in caplog.text


def test_up_gives_its_children_a_random_token_unless_one_is_configured(tmp_path):
    from services.cli import _with_internal_token

    first, second = _with_internal_token(ServingConfig()), _with_internal_token(ServingConfig())
    assert len(first.rpc.auth_token) >= 32 and first.rpc.auth_token != second.rpc.auth_token
    path = tmp_path / "serving.json"  # what the children read
    path.write_text(first.to_json())
    assert ServingConfig.load(path, env={}).rpc.auth_token == first.rpc.auth_token
    configured = ServingConfig().updated({"rpc": {"auth_token": TOKEN}})
    assert _with_internal_token(configured).rpc.auth_token == TOKEN


def test_the_token_comes_from_the_environment_is_checked_and_never_printed():
    config = ServingConfig.load(env={"DSPARK_RPC_AUTH_TOKEN": TOKEN})
    assert config.rpc.auth_token == TOKEN and TOKEN not in repr(config)
    assert ("rpc", "auth_token") in ServingConfig.secret_keys()
    with pytest.raises(ValueError, match="rpc.auth_token must be at least 16"):
        ServingConfig.load(env={"DSPARK_RPC_AUTH_TOKEN": "short"})


def test_the_token_appears_in_no_log_and_no_trace(guarded, caplog):
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from dspark.observability import tracing
    from tests.observability.conftest import in_memory_provider

    exporter = InMemorySpanExporter()
    with caplog.at_level(logging.DEBUG), tracing.use_tracer_provider(in_memory_provider(exporter)), \
            tracing.tracer().start_as_current_span("a request"):
        assert RemoteVerifier(guarded[0], auth_token=TOKEN).vocab_size == 256
        with make_channel(guarded[1], auth_token="a-wrong-token-of-some-length") as channel, pytest.raises(grpc.RpcError):
            drafter_pb2_grpc.DrafterStub(channel).GetInfo(drafter_pb2.GetDrafterInfoRequest(), timeout=10)
    recorded = "\n".join(s.to_json() for s in exporter.get_finished_spans())
    assert "Verifier/GetInfo" in recorded  # the calls were traced
    for secret in (TOKEN, "a-wrong-token-of-some-length"):
        assert secret not in caplog.text and secret not in recorded
