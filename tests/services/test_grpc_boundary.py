"""What every service shows at its gRPC boundary, called with raw stubs as any client would.

Specification: each server answers grpc.health.v1 with SERVING (overall and for its service) and
lists its service, health and reflection through server reflection; an invalid message is
INVALID_ARGUMENT with "field: message"; a request the verifier cannot fit now is
RESOURCE_EXHAUSTED; a call about a request the service does not hold is FAILED_PRECONDITION;
an SPS profile that was never measured is FAILED_PRECONDITION (and None in the client).
"""

from __future__ import annotations

import grpc
import pytest
from grpc_health.v1 import health_pb2
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from dspark.protos.dspark.v1 import (
    common_pb2,
    drafter_pb2,
    drafter_pb2_grpc,
    scheduler_pb2,
    scheduler_pb2_grpc,
    verifier_pb2,
    verifier_pb2_grpc,
)
from services.verifier.client import RemoteVerifier
from tests.drafters.test_dspark_serving import make_serving_drafter
from tests.services.conftest import SERVICE_NAMES, health_reply, rpc_error, tiny_services

PARAMS = common_pb2.SamplingParams(temperature=0.0, top_p=1.0)


@pytest.fixture
def three_servers(tiny_runtime_factory):
    """(verifier, drafter, scheduler) addresses: the tiny model, the tiny DSpark drafter, an
    in-process engine behind the scheduler API."""
    runtime = tiny_runtime_factory(capture_layers=(1, 3), kv_budget_tokens=100)
    with tiny_services(runtime, make_serving_drafter(runtime), hidden_size=runtime.config.hidden_size) as addresses:
        yield addresses


def _code(method, request) -> tuple[grpc.StatusCode, str]:
    """The status code and details a call ends with (a server stream is read to its end)."""
    return rpc_error(method, request, timeout=10)


def test_every_service_reports_serving_and_lists_itself_through_reflection(three_servers):
    for address, service in zip(three_servers, SERVICE_NAMES):
        with grpc.insecure_channel(address) as channel:
            for name in ("", service):
                assert health_reply(channel, name).status == health_pb2.HealthCheckResponse.SERVING
            listed = set(ProtoReflectionDescriptorDatabase(channel).get_services())
            assert {service, "grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection"} <= listed


def test_the_verifier_answers_invalid_messages_with_invalid_argument_and_a_message(three_servers):
    with grpc.insecure_channel(three_servers[0]) as channel:
        stub = verifier_pb2_grpc.VerifierStub(channel)
        code, details = _code(stub.AddRequest, verifier_pb2.VerifierAddRequest(
            request_id="r", prompt_ids=[1, 256], params=PARAMS, num_kv_tokens=8))
        assert code == grpc.StatusCode.INVALID_ARGUMENT and details == "prompt_ids[1]: token id 256 out of range [0, 256)"
        code, details = _code(stub.AddRequest, verifier_pb2.VerifierAddRequest(request_id="r", prompt_ids=[1], num_kv_tokens=8))
        assert code == grpc.StatusCode.INVALID_ARGUMENT and details == "params: missing: sampling params are required"
        code, details = _code(stub.Verify, verifier_pb2.VerifyBatch(request_ids=["a"], anchor_token_ids=[3], num_draft_tokens=[1],
                                                                     draft_token_ids=[4]))
        assert code == grpc.StatusCode.INVALID_ARGUMENT and details.startswith("draft_probs: missing")
        code, details = _code(stub.Verify, verifier_pb2.VerifyBatch(request_ids=["ghost"], anchor_token_ids=[-1], num_draft_tokens=[0]))
        # a request it does not hold is no malformed message: a restarted verifier lost it (the scheduler rebuilds it)
        assert code == grpc.StatusCode.FAILED_PRECONDITION and "not registered with this verifier" in details


def test_a_request_beyond_the_free_kv_is_resource_exhausted(three_servers):
    with grpc.insecure_channel(three_servers[0]) as channel:
        stub = verifier_pb2_grpc.VerifierStub(channel)
        reply = stub.AddRequest(verifier_pb2.VerifierAddRequest(request_id="a", prompt_ids=[1, 2], params=PARAMS, num_kv_tokens=60),
                                timeout=10)
        assert reply.free_kv_tokens == 40
        code, details = _code(stub.AddRequest, verifier_pb2.VerifierAddRequest(
            request_id="b", prompt_ids=[1, 2], params=PARAMS, num_kv_tokens=60))
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "needs 60 KV tokens, 40 of 100 are free" in details
        removed = stub.RemoveRequest(verifier_pb2.VerifierRemoveRequest(request_ids=["a", "b"]), timeout=10)
        assert removed.num_removed == 1 and removed.free_kv_tokens == 100


def test_a_verifier_without_an_sps_profile_says_so(three_servers):
    with grpc.insecure_channel(three_servers[0]) as channel:
        code, details = _code(verifier_pb2_grpc.VerifierStub(channel).GetSPSProfile, verifier_pb2.GetSPSProfileRequest())
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "sps_max_batch" in details
    assert RemoteVerifier(three_servers[0]).sps_profile is None


def test_the_drafter_checks_features_and_requests_it_holds(three_servers):
    with grpc.insecure_channel(three_servers[1]) as channel:
        stub = drafter_pb2_grpc.DrafterStub(channel)
        info = stub.GetInfo(drafter_pb2.GetDrafterInfoRequest(), timeout=10)
        assert info.name == "dspark" and info.needs_hidden_states and list(info.capture_layers) == [1, 3] and info.provides_confidences
        draft = drafter_pb2.DraftRequest(request_id="r", token_ids=[1, 2, 3], num_prompt_tokens=2, params=PARAMS, max_draft_tokens=2)
        code, details = _code(stub.Draft, drafter_pb2.DraftRoundRequest(round_id=1, requests=[draft]))
        assert code == grpc.StatusCode.FAILED_PRECONDITION and "'r' is not registered" in details
        stub.AddRequest(drafter_pb2.DrafterAddRequest(request_id="r", prompt_ids=[1, 2], params=PARAMS), timeout=10)
        code, details = _code(stub.AddRequest, drafter_pb2.DrafterAddRequest(request_id="r", prompt_ids=[1, 2], params=PARAMS))
        assert code == grpc.StatusCode.ALREADY_EXISTS
        code, details = _code(stub.Draft, drafter_pb2.DraftRoundRequest(round_id=1, requests=[draft]))
        assert code == grpc.StatusCode.FAILED_PRECONDITION and "holds features of 0 positions, the anchor sits at position 2" in details
        wrong = common_pb2.Tensor(dtype=common_pb2.DTYPE_FLOAT32, shape=[2, 2, 8], data=bytes(2 * 2 * 8 * 4))
        code, details = _code(stub.AppendFeatures, drafter_pb2.AppendFeaturesRequest(
            requests=[drafter_pb2.RequestFeatures(request_id="r", features=wrong)]))
        assert code == grpc.StatusCode.INVALID_ARGUMENT and details.startswith("requests[0].features.shape: must have hidden size 64")
        code, details = _code(stub.Draft, drafter_pb2.DraftRoundRequest(requests=[draft, draft]))
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "appears more than once" in details
        assert stub.RemoveRequest(drafter_pb2.DrafterRemoveRequest(request_ids=["r", "zz"]), timeout=10).num_removed == 1


def test_the_scheduler_answers_invalid_generations_with_invalid_argument(three_servers):
    with grpc.insecure_channel(three_servers[2]) as channel:
        stub = scheduler_pb2_grpc.SchedulerStub(channel)
        bad = scheduler_pb2.GenerationRequest(request_id="g", prompt_ids=[1, 2], max_new_tokens=0, params=PARAMS)
        code, details = _code(stub.Submit, bad)
        assert code == grpc.StatusCode.INVALID_ARGUMENT and details == "max_new_tokens: must be >= 1, got 0"
        too_long = scheduler_pb2.GenerationRequest(request_id="g", prompt_ids=[1] * 500, max_new_tokens=100, params=PARAMS)
        code, details = _code(stub.Submit, too_long)
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "exceeds the context window of 512" in details
        code, details = _code(stub.Cancel, scheduler_pb2.CancelRequest(request_id=""))
        assert code == grpc.StatusCode.INVALID_ARGUMENT and details == "request_id: must be a non-empty string"
