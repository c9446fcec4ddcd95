"""Boundary validation: each invalid message raises ValidationError naming the offending field,
valid ones pass, and no message the protobuf runtime can parse raises anything else."""

from __future__ import annotations

import math

import pytest
from google.protobuf.message import DecodeError
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dspark.protos import validate as v
from dspark.protos.dspark.v1 import common_pb2, drafter_pb2, scheduler_pb2, verifier_pb2
from dspark.protos.validate import ValidationError, validate

VOCAB = 16


def _params(**kw) -> common_pb2.SamplingParams:
    return common_pb2.SamplingParams(**({"temperature": 1.0, "top_p": 1.0} | kw))


def _proposal(**kw) -> common_pb2.DraftProposal:
    """Two drafts [3, 5], sparse k = 3 with one padding entry."""
    msg = common_pb2.DraftProposal(
        token_ids=[3, 5], sparse=common_pb2.SparseRows(k=3, ids=[3, 4, -1, 5, 6, 7], probs=[0.5, 0.5, 0.0, 0.25, 0.25, 0.5]),
        confidences=[0.9, 0.4],
    )
    for name, value in kw.items():
        field = getattr(msg, name)
        if name in ("sparse", "dense"):
            field.CopyFrom(value)
        else:
            del field[:]
            field.extend(value)
    return msg


def _dense(n: int = 2) -> common_pb2.DenseRows:
    row = [1.0 / VOCAB] * VOCAB
    return common_pb2.DenseRows(vocab_size=VOCAB, probs=row * n)


def _batch(**kw) -> verifier_pb2.VerifyBatch:
    msg = verifier_pb2.VerifyBatch(
        round_id=1, request_ids=["a", "b"], anchor_token_ids=[-1, 2], num_draft_tokens=[0, 2], draft_token_ids=[3, 5],
        sparse=_proposal().sparse,
    )
    for name, value in kw.items():
        if name in ("sparse", "dense"):
            getattr(msg, name).CopyFrom(value)
        else:
            field = getattr(msg, name)
            del field[:]
            field.extend(value)
    return msg


def _result(**kw) -> verifier_pb2.VerifyResult:
    msg = verifier_pb2.VerifyResult(
        round_id=1, request_ids=["a", "b"], num_accepted=[0, 2], emitted_token_ids=[1, 3, 5, 7], max_num_draft=2,
        hidden_states=common_pb2.Tensor(dtype=common_pb2.DTYPE_BFLOAT16, shape=[4, 1, 2], data=bytes(16)),
        num_hidden_positions=[1, 3],
    )
    for name, value in kw.items():
        if name in ("hidden_states", "logprobs"):
            getattr(msg, name).CopyFrom(value)
        elif name == "max_num_draft":
            msg.max_num_draft = value
        else:
            field = getattr(msg, name)
            del field[:]
            field.extend(value)
    return msg


def _logprobs(n: int = 4, k: int = 2, **kw) -> common_pb2.TokenLogprobs:
    base = {"logprobs": [-0.5] * n, "k": k, "top_ids": [1, 2] * n if k == 2 else [1] * (n * k), "top_logprobs": [-0.5] * (n * k)}
    return common_pb2.TokenLogprobs(**(base | kw))


def _gen(**kw) -> scheduler_pb2.GenerationRequest:
    base = {"request_id": "g", "prompt_ids": [1, 2], "max_new_tokens": 4, "params": _params(), "stop_token_ids": [0]}
    return scheduler_pb2.GenerationRequest(**(base | kw))


def _draft_request(**kw) -> drafter_pb2.DraftRequest:
    base = {"request_id": "r", "token_ids": [1, 2, 3], "num_prompt_tokens": 2, "params": _params(), "max_draft_tokens": 4}
    return drafter_pb2.DraftRequest(**(base | kw))


def _features(shape=(2, 1, 4), dtype=common_pb2.DTYPE_FLOAT16, nbytes=None) -> drafter_pb2.AppendFeaturesRequest:
    data = bytes(nbytes if nbytes is not None else math.prod(shape) * 2)
    return drafter_pb2.AppendFeaturesRequest(
        requests=[drafter_pb2.RequestFeatures(request_id="r", features=common_pb2.Tensor(dtype=dtype, shape=shape, data=data))]
    )


VALID = {
    "params": _params(temperature=0.0, top_p=0.5, top_k=3, seed=1),
    "proposal": _proposal(),
    "dense proposal": common_pb2.DraftProposal(token_ids=[3, 5], dense=_dense()),
    "draft request": _draft_request(),
    "draft round": drafter_pb2.DraftRoundRequest(requests=[_draft_request(), _draft_request(request_id="s")]),
    "draft block": drafter_pb2.DraftBlock(request_id="r", proposal=_proposal()),
    "drafter add": drafter_pb2.DrafterAddRequest(request_id="r", prompt_ids=[1], params=_params()),
    "features": _features(),
    "drafter remove": drafter_pb2.DrafterRemoveRequest(request_ids=["a", "b"]),
    "verifier add": verifier_pb2.VerifierAddRequest(request_id="r", prompt_ids=[1, 2], params=_params(), num_kv_tokens=8),
    "verify batch": _batch(),
    "verify batch dense": _batch(dense=_dense()),
    "verify batch no drafts": verifier_pb2.VerifyBatch(request_ids=["a"], anchor_token_ids=[4], num_draft_tokens=[0]),
    "verify result": _result(),
    "verify batch with logprobs": _batch(num_logprobs=[-1, 20]),
    "verify result with logprobs": _result(logprobs=_logprobs(top_ids=[1, 2, -1, -1, 3, 4, 5, 6])),
    "generation with logprobs": _gen(logprobs=0),
    "step output with logprobs": scheduler_pb2.StepOutput(request_id="g", new_token_ids=[1], logprobs=_logprobs(1, 0)),
    "sps": verifier_pb2.SPSProfile(batch_sizes=[1, 4, 8], step_seconds=[0.01, 0.02, 0.03]),
    "generation": _gen(),
    "step output": scheduler_pb2.StepOutput(request_id="g", new_token_ids=[1], finish_reason=common_pb2.FINISH_REASON_STOP),
    "cancel": scheduler_pb2.CancelRequest(request_id="g"),
    "drafter info": drafter_pb2.DrafterInfo(name="dspark", needs_hidden_states=True, capture_layers=[1, 3], provides_confidences=True,
                                            vocab_size=VOCAB, hidden_size=8, block_size=7, draft_vocab_size=VOCAB // 2),
    "drafter info stateless": drafter_pb2.DrafterInfo(name="ngram", vocab_size=VOCAB),
    "verifier info": verifier_pb2.VerifierInfo(model="m", vocab_size=VOCAB, max_model_len=64, capture_layers=[0, 2], hidden_size=8,
                                               kv_budget_tokens=100, free_kv_tokens=60, sampler_backend="torch"),
}


@pytest.mark.parametrize("name", list(VALID))
def test_valid_messages_pass_and_are_left_unchanged(name):
    msg = VALID[name]
    before = msg.SerializeToString(deterministic=True)
    validate(msg, vocab_size=VOCAB)  # raises ValidationError if it does not pass
    assert msg.SerializeToString(deterministic=True) == before  # validation only reads


# (case, message, the field path the error must name, a word the message must contain)
INVALID = [
    ("negative temperature", _params(temperature=-0.1), "temperature", "0 (greedy) or finite and >="),
    ("temperature that overflows the logits", _params(temperature=1e-300), "temperature", "smaller ones overflow"),
    ("nan temperature", _params(temperature=float("nan")), "temperature", "finite"),
    ("top_p zero", _params(top_p=0.0), "top_p", "(0, 1]"),
    ("top_p above one", _params(top_p=1.5), "top_p", "(0, 1]"),
    ("negative top_k", _params(top_k=-1), "top_k", ">= 0"),
    ("draft token out of vocab", _proposal(token_ids=[3, VOCAB]), "proposal.token_ids[1]", "out of range"),
    ("negative draft token", _proposal(token_ids=[-2, 5]), "proposal.token_ids[0]", "out of range"),
    ("rows missing", common_pb2.DraftProposal(token_ids=[1]), "proposal.rows", "missing"),
    ("sparse k zero", _proposal(sparse=common_pb2.SparseRows(k=0)), "proposal.sparse.k", ">= 1"),
    ("sparse ids short", _proposal(sparse=common_pb2.SparseRows(k=3, ids=[3, 4, -1], probs=[0.5, 0.5, 0.0])), "proposal.sparse.ids", "2 * 3"),
    ("sparse probs short", _proposal(sparse=common_pb2.SparseRows(k=3, ids=[3, 4, -1, 5, 6, 7], probs=[1.0])), "proposal.sparse.probs", "2 * 3"),
    ("sparse id out of vocab", _proposal(sparse=common_pb2.SparseRows(k=3, ids=[3, 4, VOCAB, 5, 6, 7], probs=[0.5, 0.5, 0.0, 0.25, 0.25, 0.5])), "proposal.sparse.ids", "or -1"),
    ("padding with mass", _proposal(sparse=common_pb2.SparseRows(k=3, ids=[3, -1, -1, 5, 6, 7], probs=[0.5, 0.5, 0.0, 0.25, 0.25, 0.5])), "proposal.sparse.probs", "padding"),
    ("negative prob", _proposal(sparse=common_pb2.SparseRows(k=3, ids=[3, 4, -1, 5, 6, 7], probs=[1.5, -0.5, 0.0, 0.25, 0.25, 0.5])), "proposal.sparse.probs", ">= 0"),
    ("nan prob", _proposal(sparse=common_pb2.SparseRows(k=3, ids=[3, 4, -1, 5, 6, 7], probs=[float("nan"), 0.5, 0.0, 0.25, 0.25, 0.5])), "proposal.sparse.probs", "finite"),
    ("row not summing to one", _proposal(sparse=common_pb2.SparseRows(k=3, ids=[3, 4, -1, 5, 6, 7], probs=[0.5, 0.5, 0.0, 0.25, 0.25, 0.49])), "proposal.sparse.probs", "row 1 sums to 0.99"),
    ("duplicate sparse id", _proposal(sparse=common_pb2.SparseRows(k=3, ids=[3, 3, -1, 5, 6, 7], probs=[0.5, 0.5, 0.0, 0.25, 0.25, 0.5])), "proposal.sparse.ids", "twice"),
    ("token outside its row", _proposal(token_ids=[3, 9]), "proposal.token_ids[1]", "p_d = 0"),
    ("dense wrong vocab", common_pb2.DraftProposal(token_ids=[1], dense=common_pb2.DenseRows(vocab_size=4, probs=[0.25] * 4)), "proposal.dense.vocab_size", str(VOCAB)),
    ("dense wrong length", common_pb2.DraftProposal(token_ids=[1, 2], dense=_dense(1)), "proposal.dense.probs", "2 * 16"),
    ("row off by twice the sampler's tolerance", _proposal(sparse=common_pb2.SparseRows(k=3, ids=[3, 4, -1, 5, 6, 7], probs=[0.5, 0.5, 0.0, 0.25, 0.25, 0.5002])), "proposal.sparse.probs", "row 1 sums to 1.0002"),
    ("dense row sum", common_pb2.DraftProposal(token_ids=[1], dense=common_pb2.DenseRows(vocab_size=VOCAB, probs=[0.1] * VOCAB)), "proposal.dense.probs", "sums to 1.6"),
    ("confidence count", _proposal(confidences=[0.5]), "proposal.confidences", "one per draft token"),
    ("confidence above one", _proposal(confidences=[0.5, 1.5]), "proposal.confidences[1]", "[0, 1]"),
    ("empty request id", drafter_pb2.DraftBlock(request_id="", proposal=_proposal()), "request_id", "non-empty"),
    ("long request id", scheduler_pb2.CancelRequest(request_id="x" * 300), "request_id", "256"),
    ("block without proposal", drafter_pb2.DraftBlock(request_id="r"), "proposal", "missing"),
    ("draft request without anchor", _draft_request(token_ids=[]), "request.token_ids", "at least one"),
    ("draft request bad prompt length", _draft_request(num_prompt_tokens=4), "request.num_prompt_tokens", "[1, 3]"),
    ("draft request zero prompt", _draft_request(num_prompt_tokens=0), "request.num_prompt_tokens", "[1, 3]"),
    ("draft request negative offset", _draft_request(token_offset=-1), "request.token_offset", ">= 0"),
    ("draft request negative gamma", _draft_request(max_draft_tokens=-1), "request.max_draft_tokens", ">= 0"),
    ("draft request without params", drafter_pb2.DraftRequest(request_id="r", token_ids=[1], num_prompt_tokens=1), "request.params", "missing"),
    ("draft request bad params", _draft_request(params=_params(top_p=2.0)), "request.params.top_p", "(0, 1]"),
    ("round with a bad request", drafter_pb2.DraftRoundRequest(requests=[_draft_request(), _draft_request(token_ids=[99])]), "requests[1].token_ids[0]", "out of range"),
    ("round with a duplicate", drafter_pb2.DraftRoundRequest(requests=[_draft_request(), _draft_request()]), "requests.request_id[1]", "more than once"),
    ("drafter add empty prompt", drafter_pb2.DrafterAddRequest(request_id="r", params=_params()), "prompt_ids", "at least one"),
    ("negative k with no drafts", verifier_pb2.VerifyBatch(request_ids=["a"], anchor_token_ids=[2], num_draft_tokens=[0],
                                                           sparse=common_pb2.SparseRows(k=-1)), "sparse.k", ">= 1"),
    ("features wrong rank", _features(shape=(2, 4)), "requests[0].features.shape", "3 dims"),
    ("features wrong bytes", _features(nbytes=3), "requests[0].features.data", "16 bytes"),
    ("features unknown dtype", _features(dtype=0), "requests[0].features.dtype", "FLOAT32"),
    ("features negative dim", _features(shape=(-2, 1, -4), nbytes=16), "requests[0].features.shape", ">= 0"),
    ("features with NaN", drafter_pb2.AppendFeaturesRequest(requests=[drafter_pb2.RequestFeatures(request_id="r", features=common_pb2.Tensor(
        dtype=common_pb2.DTYPE_BFLOAT16, shape=[1, 1, 2], data=bytes([0, 0, 0xC0, 0x7F])))]), "requests[0].features.data", "NaN"),
    ("features with inf", drafter_pb2.AppendFeaturesRequest(requests=[drafter_pb2.RequestFeatures(request_id="r", features=common_pb2.Tensor(
        dtype=common_pb2.DTYPE_FLOAT32, shape=[1, 1, 1], data=bytes([0, 0, 0x80, 0x7F])))]), "requests[0].features.data", "infinite"),
    ("remove empty id", drafter_pb2.DrafterRemoveRequest(request_ids=["a", ""]), "request_ids[1]", "non-empty"),
    ("verifier add short reservation", verifier_pb2.VerifierAddRequest(request_id="r", prompt_ids=[1, 2], params=_params(), num_kv_tokens=2), "num_kv_tokens", "exceed"),
    ("verifier add prompt out of vocab", verifier_pb2.VerifierAddRequest(request_id="r", prompt_ids=[VOCAB], params=_params(), num_kv_tokens=8), "prompt_ids[0]", "out of range"),
    ("batch anchors short", _batch(anchor_token_ids=[2]), "anchor_token_ids", "one entry per request (2)"),
    ("batch counts short", _batch(num_draft_tokens=[2]), "num_draft_tokens", "one entry per request"),
    ("batch negative count", _batch(num_draft_tokens=[-1, 3]), "num_draft_tokens[0]", ">= 0"),
    ("batch anchor out of vocab", _batch(anchor_token_ids=[-1, VOCAB]), "anchor_token_ids[1]", "out of range"),
    ("batch prefill with drafts", _batch(anchor_token_ids=[-1, -1], num_draft_tokens=[2, 0]), "num_draft_tokens[0]", "first round"),
    ("batch draft ids vs counts", _batch(num_draft_tokens=[0, 1]), "draft_token_ids", "sum(num_draft_tokens) = 1"),
    ("batch rows missing", verifier_pb2.VerifyBatch(request_ids=["a"], anchor_token_ids=[1], num_draft_tokens=[1], draft_token_ids=[2]), "draft_probs", "missing"),
    ("batch rows short", _batch(dense=_dense(1)), "dense.probs", "2 * 16"),
    ("batch draft outside row", _batch(draft_token_ids=[3, 8]), "draft_token_ids[1]", "p_d = 0"),
    ("batch duplicate ids", _batch(request_ids=["a", "a"]), "request_ids[1]", "more than once"),
    ("result accepted beyond drafts", _result(num_accepted=[0, 3], emitted_token_ids=[1, 3, 5, 7, 9]), "num_accepted[1]", "max_num_draft = 2"),
    ("result emitted count", _result(emitted_token_ids=[1, 3, 5]), "emitted_token_ids", "= 4 ids"),
    ("result emitted out of vocab", _result(emitted_token_ids=[1, 3, 5, VOCAB]), "emitted_token_ids[3]", "out of range"),
    ("result hidden positions sum", _result(num_hidden_positions=[1, 2]), "num_hidden_positions", "sum to hidden_states.shape[0] = 4"),
    ("result hidden positions count", _result(num_hidden_positions=[4]), "num_hidden_positions", "one entry per request"),
    ("sps empty", verifier_pb2.SPSProfile(), "batch_sizes", "at least one"),
    ("sps not ascending", verifier_pb2.SPSProfile(batch_sizes=[1, 4, 4], step_seconds=[0.1, 0.2, 0.3]), "batch_sizes[2]", "ascending"),
    ("sps zero batch", verifier_pb2.SPSProfile(batch_sizes=[0, 4], step_seconds=[0.1, 0.2]), "batch_sizes[0]", ">= 1"),
    ("sps lengths", verifier_pb2.SPSProfile(batch_sizes=[1, 4], step_seconds=[0.1]), "step_seconds", "one time per batch size"),
    ("sps nonpositive time", verifier_pb2.SPSProfile(batch_sizes=[1, 4], step_seconds=[0.1, 0.0]), "step_seconds[1]", "> 0"),
    ("generation empty prompt", _gen(prompt_ids=[]), "prompt_ids", "at least one"),
    ("generation zero max tokens", _gen(max_new_tokens=0), "max_new_tokens", ">= 1"),
    ("generation stop out of vocab", _gen(stop_token_ids=[VOCAB + 3]), "stop_token_ids[0]", "out of range"),
    ("generation without params", scheduler_pb2.GenerationRequest(request_id="g", prompt_ids=[1], max_new_tokens=1), "params", "missing"),
    ("step output unknown reason", scheduler_pb2.StepOutput(request_id="g", finish_reason=7), "finish_reason", "unknown"),
    ("batch logprobs count", _batch(num_logprobs=[1]), "num_logprobs", "one entry per request (2) or none"),
    ("batch logprobs too many", _batch(num_logprobs=[0, 21]), "num_logprobs[1]", "[0, 20]"),
    ("batch logprobs below none", _batch(num_logprobs=[-2, 0]), "num_logprobs[0]", "or -1"),
    ("result logprobs count", _result(logprobs=_logprobs(3)), "logprobs.logprobs", "one entry per token (4)"),
    ("result logprobs alternatives", _result(logprobs=_logprobs(top_ids=[1, 2])), "logprobs.top_ids", "num_tokens * k = 8"),
    ("result logprobs k", _result(logprobs=_logprobs(k=21)), "logprobs.k", "[0, 20]"),
    ("result logprobs id out of vocab", _result(logprobs=_logprobs(top_ids=[1, VOCAB, 1, 1, 1, 1, 1, 1])), "logprobs.top_ids[1]",
     "out of range"),
    ("generation logprobs", _gen(logprobs=21), "logprobs", "[0, 20]"),
    ("step output logprobs count", scheduler_pb2.StepOutput(request_id="g", new_token_ids=[1, 2], logprobs=_logprobs(1, 0)),
     "logprobs.logprobs", "one entry per token (2)"),
    ("drafter info without name", drafter_pb2.DrafterInfo(vocab_size=VOCAB), "name", "non-empty"),
    ("drafter info without vocab", drafter_pb2.DrafterInfo(name="ngram"), "vocab_size", ">= 1"),
    ("drafter info reads no layers", drafter_pb2.DrafterInfo(name="d", vocab_size=VOCAB, needs_hidden_states=True, hidden_size=8),
     "capture_layers", "must list"),
    ("drafter info negative layer", drafter_pb2.DrafterInfo(name="d", vocab_size=VOCAB, capture_layers=[-1]), "capture_layers", ">= 0"),
    ("drafter info negative block", drafter_pb2.DrafterInfo(name="d", vocab_size=VOCAB, block_size=-1), "block_size", ">= 0"),
    ("drafter info draft vocab above the vocab", drafter_pb2.DrafterInfo(name="d", vocab_size=VOCAB, draft_vocab_size=VOCAB + 1),
     "draft_vocab_size", f"[0, vocab_size={VOCAB}]"),
    ("verifier info free above budget", verifier_pb2.VerifierInfo(vocab_size=VOCAB, max_model_len=8, hidden_size=8, kv_budget_tokens=10,
                                                                  free_kv_tokens=11), "free_kv_tokens", "[0, kv_budget_tokens = 10]"),
    ("verifier info without context", verifier_pb2.VerifierInfo(vocab_size=VOCAB, hidden_size=8, kv_budget_tokens=10), "max_model_len", ">= 1"),
]


@pytest.mark.parametrize("case, msg, field, words", INVALID, ids=[c[0] for c in INVALID])
def test_invalid_message_raises_naming_the_field(case, msg, field, words):
    with pytest.raises(ValidationError) as info:
        validate(msg, vocab_size=VOCAB)
    assert info.value.field == field, f"{case}: got field {info.value.field!r} ({info.value.message})"
    assert words in info.value.message, f"{case}: {info.value.message!r} lacks {words!r}"
    assert str(info.value) == f"{field}: {info.value.message}"  # what servicers send with INVALID_ARGUMENT


def test_validation_error_is_a_value_error():
    assert issubclass(ValidationError, ValueError)


def test_optional_context_checks():
    add = VALID["verifier add"]
    with pytest.raises(ValidationError, match="num_kv_tokens: must be <= the context window 4"):
        v.verifier_add_request(add, vocab_size=VOCAB, max_model_len=4)
    with pytest.raises(ValidationError, match="must have 2 layers"):
        v.append_features(_features(), num_capture_layers=2)
    with pytest.raises(ValidationError, match="must have hidden size 8"):
        v.append_features(_features(), hidden_size=8)
    with pytest.raises(ValidationError, match="at most max_draft_tokens = 1"):
        v.draft_block(VALID["draft block"], vocab_size=VOCAB, max_draft_tokens=1)


def test_unknown_message_type_is_a_programming_error():
    with pytest.raises(TypeError, match="no validator"):
        validate(common_pb2.Tensor(), vocab_size=VOCAB)


# ---------------------------------------------------------------------------------------------
# Fuzzing: whatever parses, validation either passes or raises ValidationError
# ---------------------------------------------------------------------------------------------

TOP_LEVEL = [
    common_pb2.SamplingParams, common_pb2.DraftProposal, drafter_pb2.DrafterAddRequest, drafter_pb2.DraftRoundRequest,
    drafter_pb2.DraftBlock, drafter_pb2.AppendFeaturesRequest, drafter_pb2.DrafterRemoveRequest,
    verifier_pb2.VerifierAddRequest, verifier_pb2.VerifierRemoveRequest, verifier_pb2.VerifyBatch,
    verifier_pb2.VerifyResult, verifier_pb2.SPSProfile, scheduler_pb2.GenerationRequest, scheduler_pb2.StepOutput,
    scheduler_pb2.CancelRequest, drafter_pb2.DrafterInfo, verifier_pb2.VerifierInfo,
]

small_int = st.integers(min_value=-3, max_value=VOCAB + 2)
any_int32 = st.one_of(small_int, st.integers(min_value=-(2**31), max_value=2**31 - 1))
any_float = st.one_of(
    st.sampled_from([0.0, 0.25, 0.5, 1.0, 1 / 3]), st.floats(width=32, allow_nan=True, allow_infinity=True)
)
ids_list = st.lists(small_int, max_size=12)


@st.composite
def sparse_rows(draw):
    return common_pb2.SparseRows(k=draw(st.integers(-1, 4)), ids=draw(ids_list), probs=draw(st.lists(any_float, max_size=12)))


@st.composite
def dense_rows(draw):
    vocab = draw(st.sampled_from([VOCAB, 0, 3, -1]))
    n = draw(st.integers(0, 2))
    probs = draw(st.one_of(st.just([1.0 / VOCAB] * (VOCAB * n)), st.lists(any_float, max_size=40)))
    return common_pb2.DenseRows(vocab_size=vocab, probs=probs)


@st.composite
def params(draw):
    msg = common_pb2.SamplingParams(
        temperature=draw(st.one_of(st.floats(allow_nan=True), st.just(1.0))), top_p=draw(st.one_of(st.floats(), st.just(1.0))),
        top_k=draw(any_int32),
    )
    if draw(st.booleans()):
        msg.seed = draw(st.integers(-(2**63), 2**63 - 1))
    return msg


def _with_rows(draw, msg):
    which = draw(st.sampled_from(["sparse", "dense", None]))
    if which == "sparse":
        msg.sparse.CopyFrom(draw(sparse_rows()))
    elif which == "dense":
        msg.dense.CopyFrom(draw(dense_rows()))
    return msg


@st.composite
def proposals(draw):
    msg = common_pb2.DraftProposal(token_ids=draw(ids_list), confidences=draw(st.lists(any_float, max_size=6)))
    return _with_rows(draw, msg)


rid = st.one_of(st.sampled_from(["a", "b", ""]), st.text(max_size=300))


@st.composite
def tensors(draw):
    shape = draw(st.lists(st.integers(-2, 5), max_size=4))
    return common_pb2.Tensor(dtype=draw(st.integers(-1, 5)), shape=shape, data=draw(st.binary(max_size=64)))


@st.composite
def structured(draw):
    kind = draw(st.sampled_from(TOP_LEVEL))
    if kind is common_pb2.SamplingParams:
        return draw(params())
    if kind is common_pb2.DraftProposal:
        return draw(proposals())
    if kind is drafter_pb2.DraftBlock:
        msg = drafter_pb2.DraftBlock(request_id=draw(rid))
        if draw(st.booleans()):
            msg.proposal.CopyFrom(draw(proposals()))
        return msg
    if kind is drafter_pb2.DraftRoundRequest:
        reqs = []
        for _ in range(draw(st.integers(0, 3))):
            r = drafter_pb2.DraftRequest(request_id=draw(rid), token_ids=draw(ids_list), num_prompt_tokens=draw(any_int32),
                                         max_draft_tokens=draw(any_int32), token_offset=draw(any_int32))
            if draw(st.booleans()):
                r.params.CopyFrom(draw(params()))
            reqs.append(r)
        return drafter_pb2.DraftRoundRequest(requests=reqs)
    if kind is drafter_pb2.AppendFeaturesRequest:
        items = [drafter_pb2.RequestFeatures(request_id=draw(rid), features=draw(tensors())) for _ in range(draw(st.integers(0, 2)))]
        return drafter_pb2.AppendFeaturesRequest(requests=items)
    if kind is verifier_pb2.VerifyBatch:
        msg = verifier_pb2.VerifyBatch(
            request_ids=draw(st.lists(rid, max_size=3)), anchor_token_ids=draw(st.lists(small_int, max_size=3)),
            num_draft_tokens=draw(st.lists(st.integers(-1, 3), max_size=3)), draft_token_ids=draw(ids_list),
        )
        return _with_rows(draw, msg)
    if kind is verifier_pb2.VerifyResult:
        msg = verifier_pb2.VerifyResult(
            request_ids=draw(st.lists(rid, max_size=3)), num_accepted=draw(st.lists(st.integers(-1, 3), max_size=3)),
            emitted_token_ids=draw(ids_list), max_num_draft=draw(st.integers(-1, 3)),
            num_hidden_positions=draw(st.lists(st.integers(-1, 4), max_size=3)),
        )
        if draw(st.booleans()):
            msg.hidden_states.CopyFrom(draw(tensors()))
        return msg
    if kind is verifier_pb2.SPSProfile:
        return verifier_pb2.SPSProfile(batch_sizes=draw(st.lists(any_int32, max_size=4)),
                                       step_seconds=draw(st.lists(st.floats(), max_size=4)))
    if kind is scheduler_pb2.StepOutput:
        return scheduler_pb2.StepOutput(request_id=draw(rid), new_token_ids=draw(ids_list), finish_reason=draw(st.integers(-1, 5)))
    if kind is scheduler_pb2.GenerationRequest:
        msg = scheduler_pb2.GenerationRequest(request_id=draw(rid), prompt_ids=draw(ids_list), max_new_tokens=draw(any_int32),
                                              stop_token_ids=draw(ids_list))
        if draw(st.booleans()):
            msg.params.CopyFrom(draw(params()))
        return msg
    if kind is verifier_pb2.VerifierAddRequest:
        msg = verifier_pb2.VerifierAddRequest(request_id=draw(rid), prompt_ids=draw(ids_list), num_kv_tokens=draw(any_int32))
        if draw(st.booleans()):
            msg.params.CopyFrom(draw(params()))
        return msg
    # the rest are built from random wire bytes
    try:
        return kind.FromString(draw(st.binary(max_size=64)))
    except DecodeError:
        return kind()


def _only_validation_errors(msg) -> None:
    """validate(msg) passes or raises a ValidationError whose path names a field (or oneof) of
    `msg`, first or after the message's own name ("proposal.sparse.k"); any other exception
    propagates and fails the test."""
    try:
        validate(msg, vocab_size=VOCAB)
    except ValidationError as err:
        names = set(msg.DESCRIPTOR.fields_by_name) | set(msg.DESCRIPTOR.oneofs_by_name)
        path = [part.split("[")[0] for part in err.field.split(".")]
        assert names & set(path[:2]), f"{type(msg).__name__}: {err!s} names no field of the message"
        assert err.message, err


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(structured())
def test_structured_random_messages_raise_only_validation_errors(msg):
    _only_validation_errors(msg)


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(TOP_LEVEL), st.binary(max_size=200))
def test_random_wire_bytes_raise_only_validation_errors(kind, data):
    try:
        msg = kind.FromString(data)
    except DecodeError:  # not a parseable message: the gRPC layer rejects it before us
        return
    _only_validation_errors(msg)


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(list(VALID.values())), st.binary(max_size=24))
def test_valid_messages_with_appended_random_fields_raise_only_validation_errors(msg, tail):
    # Appending wire bytes merges fields into a valid message: near-valid, the interesting case.
    try:
        mutated = type(msg).FromString(msg.SerializeToString() + tail)
    except DecodeError:
        return
    _only_validation_errors(mutated)
