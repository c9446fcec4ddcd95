"""Every RPC of every servicer, fuzzed with hypothesis over a real in-process gRPC channel.

Specification: whatever a client sends (any message the protobuf runtime can build: every field
at any value, nonsense included, alone or in sequences of calls on the same server), each call
ends OK or with a client-error status that carries a message (INVALID_ARGUMENT, NOT_FOUND,
ALREADY_EXISTS, FAILED_PRECONDITION, RESOURCE_EXHAUSTED), never INTERNAL, UNKNOWN or a timeout,
and the server still answers health checks and a valid call afterwards.

Messages come from two kinds of strategies: `message_of(descriptor)` builds any message field by
field (ids from a small alphabet, so that calls meet the same requests; numbers biased towards
the interesting small and extreme values; any float bit pattern, NaN and infinities included),
and per service a coherent scenario (register, prefill, a round with drafts and rows) filled with
random values, so that the calls reach the model, the drafter and the sampler, not only the
first check. Servers: the tiny random model (vocab 256, context 512), the tiny DSpark drafter.

    pytest tests/services/test_grpc_fuzz.py -q        # 300 call sequences per service: ~10 s idle
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import grpc
import numpy as np
import pytest
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message_factory import GetMessageClass
from grpc_health.v1 import health_pb2
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dspark.protos.dspark.v1 import (
    common_pb2,
    drafter_pb2,
    drafter_pb2_grpc,
    scheduler_pb2,
    scheduler_pb2_grpc,
    verifier_pb2,
    verifier_pb2_grpc,
)
from tests.conftest import make_tiny_runtime
from tests.drafters.test_dspark_serving import make_serving_drafter
from tests.services.conftest import health_reply, tiny_services

VOCAB, HIDDEN, CAPTURE_LAYERS, CONTEXT = 256, 64, (1, 3), 512
REQUEST_IDS = ("a", "b", "c")  # a small alphabet: random calls meet each other's requests
CLIENT_ERRORS = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND, grpc.StatusCode.ALREADY_EXISTS,
                 grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.RESOURCE_EXHAUSTED}
CALL_TIMEOUT_S = 30.0
FUZZ = settings(max_examples=300, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.large_base_example])


# ---- any message, field by field -----------------------------------------------------------------

INT32 = (-(2**31), 2**31 - 1)
INT64 = (-(2**63), 2**63 - 1)


def _integers(lo: int, hi: int) -> st.SearchStrategy[int]:
    edges = [v for v in (0, 1, -1, 2, VOCAB - 1, VOCAB, CONTEXT, lo, hi, lo + 1, hi - 1) if lo <= v <= hi]
    return st.one_of(st.integers(max(lo, -3), min(hi, 300)), st.sampled_from(edges), st.integers(lo, hi))


def _floats(width: int) -> st.SearchStrategy[float]:
    specials = [0.0, -0.0, 1.0, 0.5, 1e-45, 1e-300, 5e-324, 3.4e38, 1e308, math.inf, -math.inf, math.nan, -1.0]
    return st.one_of(st.floats(0.0, 1.0, width=width), st.sampled_from([f for f in specials if width == 64 or abs(f) < 3.5e38
                                                                        or math.isinf(f) or math.isnan(f)]),
                     st.floats(width=width))


def _texts() -> st.SearchStrategy[str]:
    return st.one_of(st.sampled_from([*REQUEST_IDS, ""]), st.text(max_size=12), st.just("r" * 257))


_SCALARS: dict[int, Callable[[], st.SearchStrategy]] = {
    FieldDescriptor.TYPE_INT32: lambda: _integers(*INT32),
    FieldDescriptor.TYPE_SINT32: lambda: _integers(*INT32),
    FieldDescriptor.TYPE_SFIXED32: lambda: _integers(*INT32),
    FieldDescriptor.TYPE_INT64: lambda: _integers(*INT64),
    FieldDescriptor.TYPE_SINT64: lambda: _integers(*INT64),
    FieldDescriptor.TYPE_SFIXED64: lambda: _integers(*INT64),
    FieldDescriptor.TYPE_UINT32: lambda: _integers(0, 2**32 - 1),
    FieldDescriptor.TYPE_FIXED32: lambda: _integers(0, 2**32 - 1),
    FieldDescriptor.TYPE_UINT64: lambda: _integers(0, 2**64 - 1),
    FieldDescriptor.TYPE_FIXED64: lambda: _integers(0, 2**64 - 1),
    FieldDescriptor.TYPE_FLOAT: lambda: _floats(32),
    FieldDescriptor.TYPE_DOUBLE: lambda: _floats(64),
    FieldDescriptor.TYPE_BOOL: st.booleans,
    FieldDescriptor.TYPE_STRING: _texts,
    FieldDescriptor.TYPE_BYTES: lambda: st.binary(max_size=64),
}


def _value(field: FieldDescriptor, depth: int) -> st.SearchStrategy:
    if field.type == FieldDescriptor.TYPE_MESSAGE:
        return message_of(field.message_type, depth + 1)
    if field.type == FieldDescriptor.TYPE_ENUM:  # proto3 enums are open: unknown numbers parse too
        return st.one_of(st.sampled_from([v.number for v in field.enum_type.values]), st.integers(-3, 9))
    return _SCALARS[field.type]()


def message_of(descriptor: Descriptor, depth: int = 0) -> st.SearchStrategy:
    """Any message of `descriptor`'s type: each field absent or at any value, one member (or none) of each oneof."""
    cls = GetMessageClass(descriptor)
    if depth > 3:
        return st.just(cls())
    plain = {f.name: f for f in descriptor.fields if f.containing_oneof is None or f.containing_oneof.name.startswith("_")}
    fields = {name: (st.lists(_value(f, depth), max_size=6) if f.is_repeated else _value(f, depth))
              for name, f in plain.items()}
    oneofs = [o for o in descriptor.oneofs if not o.name.startswith("_")]  # "_seed": proto3 optional, a plain field here

    @st.composite
    def build(draw):
        msg = cls()
        for name, strategy in fields.items():
            if draw(st.booleans()):
                _set(msg, plain[name], draw(strategy))
        for oneof in oneofs:
            member = draw(st.sampled_from([None, *oneof.fields]))
            if member is not None:
                _set(msg, member, draw(_value(member, depth)))
        return msg

    return build()


def _set(msg, field: FieldDescriptor, value) -> None:
    if field.is_repeated:
        target = getattr(msg, field.name)
        if field.type == FieldDescriptor.TYPE_MESSAGE:
            for item in value:
                target.add().CopyFrom(item)
        else:
            target.extend(value)
    elif field.type == FieldDescriptor.TYPE_MESSAGE:
        getattr(msg, field.name).CopyFrom(value)
    else:
        setattr(msg, field.name, value)


# ---- coherent scenarios with random contents -------------------------------------------------------

request_ids = st.sampled_from(REQUEST_IDS)
token_ids = st.integers(0, VOCAB - 1)


@st.composite
def sampling_params(draw) -> common_pb2.SamplingParams:
    msg = common_pb2.SamplingParams(
        temperature=draw(st.one_of(st.sampled_from([0.0, 1.0, 1e-30, 1e-300, 5e-324, 1e300]), st.floats(0.0, 100.0))),
        top_p=draw(st.one_of(st.sampled_from([1.0, 1e-30, 5e-324]), st.floats(0.0, 1.0, exclude_min=True))),
        top_k=draw(st.sampled_from([0, 1, 2, VOCAB, 2**31 - 1])),
    )
    if draw(st.booleans()):
        msg.seed = draw(_integers(*INT64))
    return msg


@st.composite
def draft_rows(draw, drafts: list[int], parent) -> None:
    """Sparse or dense rows for `drafts` into `parent` (each draft with p > 0 under its row, mostly)."""
    n = len(drafts)
    if draw(st.booleans()):
        k = draw(st.integers(1, 4))
        ids, probs = [], []
        for x in drafts:
            others = draw(st.lists(st.one_of(token_ids, st.just(-1)), min_size=k - 1, max_size=k - 1, unique=True)
                          .filter(lambda row, x=x: x not in row))
            weights = draw(st.lists(st.floats(0.0, 1.0, width=32), min_size=k, max_size=k))
            weights = [w if i != -1 else 0.0 for w, i in zip(weights, [x, *others])]
            weights[0] = max(weights[0], 1e-3)
            total = sum(weights)
            ids += [x, *others]
            probs += [w / total for w in weights]
        parent.sparse.CopyFrom(common_pb2.SparseRows(k=k, ids=ids, probs=probs))
    else:  # [n, vocab]: random rows from a drawn seed (drawing n * 256 floats one by one is slow)
        rows = np.random.default_rng(draw(st.integers(0, 2**32 - 1))).exponential(size=(n, VOCAB)) ** draw(st.sampled_from([1, 8]))
        rows[np.arange(n), drafts] += 1e-3
        rows /= rows.sum(axis=1, keepdims=True)
        parent.dense.CopyFrom(common_pb2.DenseRows(vocab_size=VOCAB, probs=rows.reshape(-1).tolist()))


@st.composite
def features(draw, num_positions: int) -> common_pb2.Tensor:
    """[num_positions, layers, hidden] of any dtype: finite values, or any bit pattern (NaN, inf)."""
    dtype = draw(st.sampled_from([common_pb2.DTYPE_FLOAT32, common_pb2.DTYPE_FLOAT16, common_pb2.DTYPE_BFLOAT16]))
    size = 4 if dtype == common_pb2.DTYPE_FLOAT32 else 2
    count = num_positions * len(CAPTURE_LAYERS) * HIDDEN
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    if draw(st.booleans()):
        data = rng.bytes(count * size)
    else:
        values = (rng.standard_normal(count) * draw(st.sampled_from([1.0, 100.0]))).astype(np.float32)
        data = values.astype(np.float16).tobytes() if dtype == common_pb2.DTYPE_FLOAT16 else (
            values.tobytes() if size == 4 else (values.view(np.uint32) >> 16).astype(np.uint16).tobytes())
    return common_pb2.Tensor(dtype=dtype, shape=[num_positions, len(CAPTURE_LAYERS), HIDDEN], data=data)


@st.composite
def verifier_scenario(draw) -> list[tuple[str, object]]:
    """Register a request, prefill it, then a round with drafts and rows: (rpc name, request) calls."""
    rid = draw(request_ids)
    prompt = draw(st.lists(token_ids, min_size=1, max_size=12))
    reserve = len(prompt) + draw(st.integers(1, 48))  # two such requests may not fit the KV budget
    calls = [("AddRequest", verifier_pb2.VerifierAddRequest(request_id=rid, prompt_ids=prompt, params=draw(sampling_params()),
                                                            num_kv_tokens=reserve))]
    capture = draw(st.booleans())
    calls.append(("Verify", verifier_pb2.VerifyBatch(round_id=1, request_ids=[rid], anchor_token_ids=[-1], num_draft_tokens=[0],
                                                     capture_hidden_states=capture)))
    for round_id in range(2, 2 + draw(st.integers(1, 3))):
        drafts = draw(st.lists(token_ids, max_size=8))
        batch = verifier_pb2.VerifyBatch(round_id=round_id, request_ids=[rid], anchor_token_ids=[draw(token_ids)],
                                         num_draft_tokens=[len(drafts)], draft_token_ids=drafts, capture_hidden_states=capture)
        if drafts:
            draw(draft_rows(drafts, batch))
        calls.append(("Verify", batch))
    return calls


@st.composite
def drafter_scenario(draw) -> list[tuple[str, object]]:
    """Register a request, hand over its prompt's features, draft a round: (rpc name, request) calls."""
    rid = draw(request_ids)
    prompt = draw(st.lists(token_ids, min_size=1, max_size=8))
    params = draw(sampling_params())
    append = drafter_pb2.AppendFeaturesRequest(requests=[drafter_pb2.RequestFeatures(request_id=rid,
                                                                                      features=draw(features(len(prompt))))])
    draft = drafter_pb2.DraftRequest(request_id=rid, token_ids=[*prompt, draw(token_ids)], num_prompt_tokens=len(prompt),
                                     params=params, max_draft_tokens=draw(st.integers(0, 8)))
    return [("AddRequest", drafter_pb2.DrafterAddRequest(request_id=rid, prompt_ids=prompt, params=params)),
            ("AppendFeatures", append), ("Draft", drafter_pb2.DraftRoundRequest(round_id=draw(_integers(0, 2**64 - 1)),
                                                                                requests=[draft]))]


@st.composite
def scheduler_scenario(draw) -> list[tuple[str, object]]:
    prompt = draw(st.lists(token_ids, min_size=1, max_size=16))
    return [("Submit", scheduler_pb2.GenerationRequest(
        request_id=draw(st.one_of(request_ids, st.text(min_size=1, max_size=8))), prompt_ids=prompt,
        max_new_tokens=draw(st.integers(1, 12)), params=draw(sampling_params()), stop_token_ids=draw(st.lists(token_ids, max_size=3))))]


def any_calls(service) -> st.SearchStrategy[list[tuple[str, object]]]:
    """One call of any RPC of `service` (a ServiceDescriptor) with any message."""
    return st.one_of(*[st.tuples(st.just(m.name), message_of(m.input_type)).map(lambda call: [call]) for m in service.methods])


def call_sequences(service, scenario) -> st.SearchStrategy[list[tuple[str, object]]]:
    return st.lists(st.one_of(any_calls(service), scenario()), min_size=1, max_size=4).map(
        lambda parts: [call for part in parts for call in part])


# ---- the servers and the property ------------------------------------------------------------------


@dataclass
class Served:
    stub: object
    channel: grpc.Channel
    cleanup: Callable[[], None]  # frees every request the example may have registered


@contextmanager
def served(address: str, stub_class, cleanup_with) -> Iterator[Served]:
    with grpc.insecure_channel(address) as channel:
        stub = stub_class(channel)
        yield Served(stub=stub, channel=channel, cleanup=lambda: cleanup_with(stub))


@pytest.fixture(scope="module")
def addresses():
    """(verifier, drafter, scheduler): the verifier's KV budget small (two requests can exhaust it), the
    drafter the tiny DSpark drafter on a model of its own, the scheduler's engine drafting 3 tokens."""
    runtime = make_tiny_runtime(capture_layers=CAPTURE_LAYERS, kv_budget_tokens=64)
    drafter = make_serving_drafter(make_tiny_runtime(capture_layers=CAPTURE_LAYERS))
    with tiny_services(runtime, drafter, hidden_size=HIDDEN, num_speculative_tokens=3) as addresses:
        yield addresses


@pytest.fixture(scope="module")
def verifier(addresses):
    with served(addresses[0], verifier_pb2_grpc.VerifierStub, lambda stub: stub.RemoveRequest(
            verifier_pb2.VerifierRemoveRequest(request_ids=list(REQUEST_IDS)), timeout=CALL_TIMEOUT_S)) as s:
        yield s


@pytest.fixture(scope="module")
def drafter(addresses):
    with served(addresses[1], drafter_pb2_grpc.DrafterStub, lambda stub: stub.RemoveRequest(
            drafter_pb2.DrafterRemoveRequest(request_ids=list(REQUEST_IDS)), timeout=CALL_TIMEOUT_S)) as s:
        yield s


@pytest.fixture(scope="module")
def scheduler(addresses):
    with served(addresses[2], scheduler_pb2_grpc.SchedulerStub, lambda stub: None) as s:  # a Submit ends inside its call
        yield s


def run_calls(s: Served, calls: list[tuple[str, object]]) -> None:
    try:
        for rpc, request in calls:
            try:
                reply = getattr(s.stub, rpc)(request, timeout=CALL_TIMEOUT_S)
                if hasattr(reply, "__next__"):  # a server stream: read it to its end
                    list(reply)
            except grpc.RpcError as err:
                code, details = err.code(), err.details()
                assert code in CLIENT_ERRORS, f"{rpc}({request!r}) ended with {code.name}: {details}"
                assert details, f"{rpc} ended with {code.name} and no message"
    finally:
        s.cleanup()
    assert health_reply(s.channel, timeout=CALL_TIMEOUT_S).status == health_pb2.HealthCheckResponse.SERVING


@FUZZ
@given(calls=call_sequences(verifier_pb2.DESCRIPTOR.services_by_name["Verifier"], verifier_scenario))
def test_the_verifier_answers_any_calls_with_ok_or_a_client_error(verifier, calls):
    run_calls(verifier, calls)
    info = verifier.stub.GetInfo(verifier_pb2.GetVerifierInfoRequest(), timeout=CALL_TIMEOUT_S)
    assert info.free_kv_tokens == info.kv_budget_tokens  # nothing leaked: every reservation was freed


@FUZZ
@given(calls=call_sequences(drafter_pb2.DESCRIPTOR.services_by_name["Drafter"], drafter_scenario))
def test_the_drafter_answers_any_calls_with_ok_or_a_client_error(drafter, calls):
    run_calls(drafter, calls)
    assert drafter.stub.GetInfo(drafter_pb2.GetDrafterInfoRequest(), timeout=CALL_TIMEOUT_S).vocab_size == VOCAB


@FUZZ
@given(calls=call_sequences(scheduler_pb2.DESCRIPTOR.services_by_name["Scheduler"], scheduler_scenario))
def test_the_scheduler_answers_any_calls_with_ok_or_a_client_error(scheduler, calls):
    run_calls(scheduler, calls)
    outputs = list(scheduler.stub.Submit(scheduler_pb2.GenerationRequest(
        request_id="after-the-fuzz", prompt_ids=[1, 2, 3], max_new_tokens=3, params=common_pb2.SamplingParams(top_p=1.0)),
        timeout=CALL_TIMEOUT_S))
    assert sum(len(o.new_token_ids) for o in outputs) == 3 and outputs[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
