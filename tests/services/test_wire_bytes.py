"""The byte counter of the gRPC clients (services/wire_bytes.py), on the real servers.

Specification: a unary call adds exactly the serialized size of its request and of its reply to
its method; a streaming call (Drafter.Draft) adds its request and every message of the stream;
a failed call counts what it sent and nothing received; totals sum a service's methods;
reset starts over; a client without a counter works as before.
"""

from __future__ import annotations

import pytest
import torch

from dspark.drafters.base import DraftRequest
from dspark.drafters.ngram import NgramDrafter
from dspark.engine.verifier import LocalVerifier
from dspark.protos import convert
from dspark.protos.dspark.v1 import drafter_pb2, verifier_pb2
from dspark.sampling.params import SamplingParams
from services.drafter.client import RemoteDrafter
from services.verifier.client import RemoteVerifier
from services.wire_bytes import RpcBytes, WireBytes

GREEDY = SamplingParams(temperature=0.0)
ADD = "/dspark.v1.Verifier/AddRequest"


@pytest.fixture
def verifier_address(serve, tiny_runtime):
    return serve.verifier(LocalVerifier(tiny_runtime))


def test_a_unary_call_counts_the_serialized_request_and_reply(verifier_address):
    wire = WireBytes()
    client = RemoteVerifier(verifier_address, wire_bytes=wire)
    assert wire.by_method()["/dspark.v1.Verifier/GetInfo"].calls == 1  # construction reads GetInfo
    wire.reset()
    client.add_request("a", [1, 2, 3, 4], GREEDY, 16)
    sent = verifier_pb2.VerifierAddRequest(request_id="a", prompt_ids=[1, 2, 3, 4],
                                           params=convert.sampling_params_to_proto(GREEDY), num_kv_tokens=16).ByteSize()
    received = verifier_pb2.VerifierAddResponse(free_kv_tokens=client.free_kv_tokens).ByteSize()
    assert sent > 0 and received > 0
    assert wire.by_method() == {ADD: RpcBytes(calls=1, sent=sent, received=received)}


def test_a_failed_call_counts_what_it_sent_and_nothing_received(verifier_address):
    wire = WireBytes()
    client = RemoteVerifier(verifier_address, wire_bytes=wire)
    wire.reset()
    with pytest.raises(ValueError, match="prompt_ids"):  # INVALID_ARGUMENT: a token id past the vocabulary
        client.add_request("a", [1, 2, 999], GREEDY, 16)
    got = wire.by_method()[ADD]
    assert (got.calls, got.received) == (1, 0) and got.sent > 0


def test_a_stream_counts_every_message_and_totals_sum_a_service(serve, verifier_address):
    wire = WireBytes()
    drafter = RemoteDrafter(serve.drafter(NgramDrafter(), vocab_size=256), wire_bytes=wire)
    verifier = RemoteVerifier(verifier_address, wire_bytes=wire)
    wire.reset()
    prompts = {"x": [1, 2, 3, 1, 2, 3, 1, 2], "y": [7, 8, 9, 7, 8, 9, 7, 8]}  # repeats: the n-gram drafter proposes
    for rid, ids in prompts.items():
        drafter.add_request(rid, ids, GREEDY)
    verifier.add_request("z", [1, 2], GREEDY, 8)
    requests = [DraftRequest(request_id=rid, token_ids=ids, num_prompt_tokens=len(ids), params=GREEDY, max_draft_tokens=3,
                             generator=torch.Generator()) for rid, ids in prompts.items()]
    before = wire.by_method()["/dspark.v1.Drafter/AddRequest"]
    proposals = drafter.propose(requests)
    assert all(len(p) > 0 for p in proposals)
    draft = wire.by_method()["/dspark.v1.Drafter/Draft"]
    blocks = sum(convert.draft_block_to_proto(1, rid, p).ByteSize() for rid, p in zip(prompts, proposals))
    assert draft.calls == 1 and draft.received == blocks
    sent = drafter_pb2.DraftRoundRequest(  # the client sends only the tokens the service lacks: here the anchor
        round_id=1, requests=[convert.draft_request_to_proto(r, token_offset=len(r.token_ids) - 1) for r in requests])
    assert draft.sent == sent.ByteSize()
    drafter_total = wire.totals("dspark.v1.Drafter")
    assert drafter_total == RpcBytes(calls=3, sent=before.sent + draft.sent, received=before.received + draft.received)
    assert wire.totals() == RpcBytes(calls=4, sent=drafter_total.sent + wire.by_method()[ADD].sent,
                                     received=drafter_total.received + wire.by_method()[ADD].received)


def test_a_client_without_a_counter_is_unchanged(verifier_address):
    client = RemoteVerifier(verifier_address)
    client.add_request("a", [1, 2, 3], GREEDY, 16)
    assert client.remove_request(["a"]) == 1
