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
from dspark.protos.dspark.v1 import common_pb2, drafter_pb2, drafter_pb2_grpc
from dspark.serving_config import ServingConfig
from services.drafter.client import RemoteDrafter
from services.grpc_auth import generate_token, warn_if_exposed
from services.grpc_common import ServiceError, check_health, make_channel
from services.verifier.client import RemoteVerifier
from tests.services.conftest import SERVICE_NAMES, calls_to_each_service, closing_all, rpc_error, tiny_services

TOKEN = generate_token()


@pytest.fixture
def guarded(tiny_runtime_factory):
    """(verifier, drafter, scheduler) addresses, each requiring TOKEN."""
    with tiny_services(tiny_runtime_factory(kv_budget_tokens=100), NgramDrafter(), auth_token=TOKEN) as addresses:
        yield addresses


@pytest.mark.parametrize("token, message", [(None, "requires the internal token"), ("not-the-token-" * 2, "is not this deployment")])
def test_every_service_refuses_calls_without_the_token_or_with_another(guarded, token, message):
    with closing_all([make_channel(address, auth_token=token or "") for address in guarded]) as channels:
        for call in calls_to_each_service(channels, request_id="auth").values():
            code, details = rpc_error(call)
            assert code == grpc.StatusCode.UNAUTHENTICATED and message in details


def test_calls_with_the_token_are_served(guarded):
    with closing_all([make_channel(address, auth_token=TOKEN) for address in guarded]) as channels:
        calls = calls_to_each_service(channels, request_id="auth").values()
        verifier_info, drafter_info, draft, stats, outputs = (call() for call in calls)
        assert verifier_info.vocab_size == 256 and drafter_info.name == "ngram"
        assert draft == [] and stats.num_finished >= 0
        assert outputs[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH and sum(len(o.new_token_ids) for o in outputs) == 2


def test_the_remote_clients_send_the_token_and_fail_clearly_without_it(guarded):
    verifier_address, drafter_address, _ = guarded
    assert RemoteVerifier(verifier_address, auth_token=TOKEN).vocab_size == 256
    assert RemoteDrafter(drafter_address, auth_token=TOKEN).spec.name == "ngram"
    with pytest.raises(ServiceError, match="UNAUTHENTICATED.*requires the internal token"):
        RemoteVerifier(verifier_address, connect_timeout_s=5)


def test_health_stays_open_and_reflection_needs_the_token(guarded):
    for address, service in zip(guarded, SERVICE_NAMES):
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
