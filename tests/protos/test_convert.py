"""Every contract dataclass survives dataclass -> message -> bytes -> message -> dataclass exactly."""

from __future__ import annotations

import pytest
import torch

from dspark.drafters.base import DraftProposal, DraftRequest
from dspark.engine.speculative import GenerationRequest, StepOutput
from dspark.profiling.sps import SPSProfile
from dspark.protos import convert
from dspark.protos.convert import VerifyBatch, VerifyResult
from dspark.protos.dspark.v1 import common_pb2, drafter_pb2, scheduler_pb2, verifier_pb2
from dspark.protos.validate import validate
from dspark.sampling.logprobs import TokenLogprobs, round_logprobs
from dspark.sampling.params import SamplingParams
from dspark.sampling.rejection_sampler import DraftProbs, RejectionResult

VOCAB = 50


def _wire(msg):
    """Serialise and parse back: what the other side of the channel sees."""
    return type(msg).FromString(msg.SerializeToString())


def _sparse_rows(gen: torch.Generator, n: int, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    ids = torch.stack([torch.randperm(VOCAB, generator=gen)[:k] for _ in range(n)]) if n else torch.empty(0, k, dtype=torch.long)
    probs = torch.rand(n, k, generator=gen) + 0.01
    probs[:, -1] = 0.0  # one padding column
    ids[:, -1] = -1
    probs = probs / probs.sum(-1, keepdim=True)
    tokens = ids[:, 0].clone()
    return tokens, ids, probs


def _dense_rows(gen: torch.Generator, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    probs = torch.softmax(torch.randn(n, VOCAB, generator=gen), -1)
    return torch.multinomial(probs, 1, generator=gen).squeeze(1) if n else torch.empty(0, dtype=torch.long), probs


def _assert_proposals_equal(a: DraftProposal, b: DraftProposal) -> None:
    for name in ("token_ids", "prob_ids", "probs", "dense_probs", "confidences"):
        x, y = getattr(a, name), getattr(b, name)
        assert (x is None) == (y is None), name
        if x is not None:
            assert x.dtype == y.dtype and torch.equal(x, y), name
    assert a.free == b.free


@pytest.mark.parametrize("params", [SamplingParams(), SamplingParams(temperature=0.0), SamplingParams(0.7, 0.9, 20, seed=-3), SamplingParams(seed=2**62)])
def test_sampling_params_round_trip_exactly(params):
    assert convert.sampling_params_from_proto(_wire(convert.to_proto(params))) == params


def test_sampling_params_without_seed_stays_without_seed():
    msg = _wire(convert.sampling_params_to_proto(SamplingParams(seed=None)))
    assert not msg.HasField("seed")


@pytest.mark.parametrize("n", [0, 1, 7])
@pytest.mark.parametrize("with_conf", [False, True])
def test_sparse_draft_proposal_round_trips(n, with_conf):
    gen = torch.Generator().manual_seed(n)
    tokens, ids, probs = _sparse_rows(gen, n, 4)
    conf = torch.rand(n, generator=gen) if with_conf and n else None
    p = DraftProposal(token_ids=tokens, prob_ids=ids, probs=probs, confidences=conf)
    msg = _wire(convert.to_proto(p))
    validate(msg, vocab_size=VOCAB)
    assert msg.WhichOneof("rows") == "sparse"
    _assert_proposals_equal(convert.draft_proposal_from_proto(msg), p)


@pytest.mark.parametrize("n", [0, 1, 5])
def test_dense_draft_proposal_round_trips(n):
    gen = torch.Generator().manual_seed(10 + n)
    tokens, probs = _dense_rows(gen, n)
    p = DraftProposal(token_ids=tokens, dense_probs=probs, confidences=torch.rand(n, generator=gen) if n else None)
    msg = _wire(convert.to_proto(p))
    validate(msg, vocab_size=VOCAB)
    assert msg.WhichOneof("rows") == "dense"
    _assert_proposals_equal(convert.draft_proposal_from_proto(msg), p)


@pytest.mark.parametrize("p", [DraftProposal.empty(), DraftProposal.point_mass([3, 1, 4])], ids=["empty", "point_mass"])
def test_constructor_proposals_round_trip(p):
    msg = _wire(convert.to_proto(p))
    validate(msg, vocab_size=VOCAB)
    _assert_proposals_equal(convert.draft_proposal_from_proto(msg), p)


def test_a_free_proposal_and_a_free_only_request_stay_so_on_the_wire():
    # a lookup's proposal is free (the draft gate learns from the others); a round the gate
    # skipped asks for free proposals only
    p = DraftProposal.point_mass([3, 1, 4])
    p.free = True
    assert convert.draft_proposal_from_proto(_wire(convert.to_proto(p))).free
    assert not convert.draft_proposal_from_proto(_wire(convert.to_proto(DraftProposal.point_mass([3])))).free
    r = DraftRequest(request_id="a", token_ids=[1, 2, 3], num_prompt_tokens=2, params=SamplingParams(), max_draft_tokens=4,
                     free_only=True)
    assert convert.draft_request_from_proto(_wire(convert.to_proto(r))) == r


def test_draft_request_round_trips_full_and_as_a_suffix():
    r = DraftRequest(request_id="a", token_ids=[1, 2, 3, 4, 5], num_prompt_tokens=3, params=SamplingParams(0.5, seed=7), max_draft_tokens=4)
    msg = _wire(convert.to_proto(r))
    validate(msg, vocab_size=VOCAB)
    assert convert.draft_request_from_proto(msg) == r
    suffix = _wire(convert.draft_request_to_proto(r, token_offset=4))
    validate(suffix, vocab_size=VOCAB)
    assert list(suffix.token_ids) == [5]
    assert convert.draft_request_from_proto(suffix, known_token_ids=[1, 2, 3, 4]) == r
    with pytest.raises(ValueError, match="token_offset 4"):
        convert.draft_request_from_proto(suffix)


def test_draft_round_and_block_round_trip():
    reqs = [DraftRequest(request_id=f"r{i}", token_ids=[i + 1] * 3, num_prompt_tokens=2, params=SamplingParams(), max_draft_tokens=3) for i in range(3)]
    msg = _wire(convert.draft_round_to_proto(9, reqs))
    validate(msg, vocab_size=VOCAB)
    assert msg.round_id == 9 and [convert.draft_request_from_proto(m) for m in msg.requests] == reqs
    p = DraftProposal.point_mass([2, 2])
    block = _wire(convert.draft_block_to_proto(9, "r1", p))
    validate(block, vocab_size=VOCAB)
    round_id, rid, back = convert.draft_block_from_proto(block)
    assert (round_id, rid) == (9, "r1")
    _assert_proposals_equal(back, p)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_tensor_round_trips_bit_exactly(dtype):
    t = torch.randn(3, 2, 8, generator=torch.Generator().manual_seed(0)).to(dtype)
    msg = _wire(convert.tensor_to_proto(t))
    assert len(msg.data) == t.numel() * t.element_size()
    back = convert.tensor_from_proto(msg)
    assert back.dtype == dtype and torch.equal(back, t)
    empty = convert.tensor_from_proto(_wire(convert.tensor_to_proto(torch.empty(0, 2, 8, dtype=dtype))))
    assert empty.shape == (0, 2, 8) and empty.dtype == dtype


def test_append_features_round_trip():
    feats = {"a": torch.randn(4, 2, 8).bfloat16(), "b": torch.randn(1, 2, 8).half()}
    msg = _wire(convert.append_features_to_proto(feats))
    validate(msg, vocab_size=VOCAB)
    back = convert.append_features_from_proto(msg)
    assert back.keys() == feats.keys() and all(torch.equal(back[k], feats[k]) for k in feats)


@pytest.mark.parametrize("rows", ["sparse", "dense", "none"])
def test_verify_batch_round_trips(rows):
    gen = torch.Generator().manual_seed(1)
    lens = [0, 3, 2] if rows != "none" else [0, 0, 0]
    n = sum(lens)
    if rows == "sparse":
        tokens, ids, probs = _sparse_rows(gen, n, 5)
        dp = DraftProbs(sparse_ids=ids, sparse_probs=probs)
    elif rows == "dense":
        tokens, probs = _dense_rows(gen, n)
        dp = DraftProbs(dense=probs)
    else:
        tokens, dp = torch.empty(0, dtype=torch.long), None
    b = VerifyBatch(
        round_id=3, request_ids=["p", "q", "r"], anchor_token_ids=torch.tensor([-1, 7, 8]),
        num_draft_tokens=torch.tensor(lens), draft_token_ids=tokens, draft_probs=dp, capture_hidden_states=True,
        num_logprobs=torch.tensor([0, -1, 20]) if rows != "none" else None,  # None: no request asks
    )
    msg = _wire(convert.to_proto(b))
    validate(msg, vocab_size=VOCAB)
    back = convert.verify_batch_from_proto(msg)
    assert (back.round_id, back.request_ids, back.capture_hidden_states) == (3, ["p", "q", "r"], True)
    assert (back.num_logprobs is None and b.num_logprobs is None) or torch.equal(back.num_logprobs, b.num_logprobs)
    for name in ("anchor_token_ids", "num_draft_tokens", "draft_token_ids"):
        assert torch.equal(getattr(back, name), getattr(b, name)), name
    if dp is None:
        assert back.draft_probs is None
    else:
        for name in ("dense", "sparse_ids", "sparse_probs"):
            x, y = getattr(dp, name), getattr(back.draft_probs, name)
            assert (x is None) == (y is None) and (x is None or torch.equal(x, y)), name


@pytest.mark.parametrize("hidden", [True, False])
def test_verify_result_round_trips(hidden):
    out = torch.tensor([[5, -1, -1, -1], [1, 2, 3, 4], [9, 8, -1, -1]])
    accepted = torch.tensor([0, 3, 1])
    v = VerifyResult(
        round_id=4, request_ids=["a", "b", "c"], result=RejectionResult(output_token_ids=out, num_accepted=accepted),
        hidden_states=torch.randn(7, 2, 8).bfloat16() if hidden else None,
        num_hidden_positions=torch.tensor([1, 4, 2]) if hidden else None,
    )
    msg = _wire(convert.to_proto(v))
    validate(msg, vocab_size=VOCAB)
    assert list(msg.emitted_token_ids) == [5, 1, 2, 3, 4, 9, 8] and msg.max_num_draft == 3
    back = convert.verify_result_from_proto(msg)
    assert torch.equal(back.result.output_token_ids, out) and torch.equal(back.result.num_accepted, accepted)
    if hidden:
        assert torch.equal(back.hidden_states, v.hidden_states)
        assert torch.equal(back.num_hidden_positions, v.num_hidden_positions)
    else:
        assert back.hidden_states is None and back.num_hidden_positions is None


def test_verify_result_logprobs_round_trip_bit_exactly():
    out = torch.tensor([[5, -1, -1, -1], [1, 2, 3, 4], [9, 8, -1, -1]])
    accepted, num_drafts = torch.tensor([0, 3, 1]), torch.tensor([0, 3, 3])
    logits = torch.randn(int(num_drafts.sum()) + 3, VOCAB, generator=torch.Generator().manual_seed(0))
    lp = round_logprobs(logits, output_token_ids=out, num_accepted=accepted, num_draft_tokens=num_drafts,
                        num_logprobs=torch.tensor([2, -1, 0]))  # one request did not ask, one wants no alternatives
    v = VerifyResult(round_id=4, request_ids=["a", "b", "c"], result=RejectionResult(output_token_ids=out, num_accepted=accepted),
                     logprobs=lp)
    msg = _wire(convert.to_proto(v))
    validate(msg, vocab_size=VOCAB)
    assert msg.logprobs.k == 2 and len(msg.logprobs.logprobs) == 7  # one entry per emitted token
    back = convert.verify_result_from_proto(msg).logprobs
    for name in ("token_logprobs", "top_token_ids", "top_logprobs"):
        assert torch.equal(getattr(back, name).nan_to_num(7.0), getattr(lp, name).nan_to_num(7.0)), name
    assert convert.verify_result_from_proto(_wire(convert.to_proto(VerifyResult(4, ["a"], v.result)))).logprobs is None


def test_sps_profile_round_trips_exactly():
    p = SPSProfile(batch_sizes=[1, 2, 8, 64], step_seconds=[0.055, 0.0571, 0.079, 0.164])
    msg = _wire(convert.to_proto(p))
    validate(msg, vocab_size=VOCAB)
    assert convert.sps_profile_from_proto(msg) == p


def test_generation_request_round_trips():
    r = GenerationRequest(request_id="g", prompt_ids=[1, 2, 3], max_new_tokens=16, params=SamplingParams(0.8, 0.95, 40, seed=1), stop_token_ids=frozenset({2, 0}))
    msg = _wire(convert.to_proto(r))
    validate(msg, vocab_size=VOCAB)
    assert list(msg.stop_token_ids) == [0, 2]
    assert convert.generation_request_from_proto(msg) == r
    for logprobs in (0, 5):
        asking = GenerationRequest(request_id="g", prompt_ids=[1], max_new_tokens=2, logprobs=logprobs)
        assert convert.generation_request_from_proto(_wire(convert.to_proto(asking))) == asking


@pytest.mark.parametrize("reason", [None, "stop", "length", "abort"])
def test_step_output_round_trips(reason):
    s = StepOutput(request_id="g", new_token_ids=[4, 5] if reason != "abort" else [], finish_reason=reason)
    msg = _wire(convert.to_proto(s))
    validate(msg, vocab_size=VOCAB)
    assert convert.step_output_from_proto(msg) == s
    if s.new_token_ids:
        lp = TokenLogprobs([-0.25, -1.125], [[4, 1], [5, 4]], [[-0.25, -2.5], [-1.125, -1.5]])
        with_logprobs = StepOutput(request_id="g", new_token_ids=[4, 5], finish_reason=reason, logprobs=lp)
        assert convert.step_output_from_proto(_wire(convert.to_proto(with_logprobs))) == with_logprobs


def test_empty_and_stats_messages_round_trip():
    for msg in (
        drafter_pb2.DrafterAddResponse(), drafter_pb2.AppendFeaturesResponse(), drafter_pb2.DrafterRemoveResponse(num_removed=2),
        verifier_pb2.VerifierAddResponse(free_kv_tokens=10), verifier_pb2.GetSPSProfileRequest(),
        scheduler_pb2.SchedulerStats(num_waiting=1, num_running=2, num_finished=3, num_rounds=4,
                                     generation_tokens_per_second=1.5, mean_accepted_length=2.5),
        scheduler_pb2.CancelRequest(request_id="x"), scheduler_pb2.CancelResponse(cancelled=True),
        drafter_pb2.GetDrafterInfoRequest(), verifier_pb2.GetVerifierInfoRequest(),
        drafter_pb2.DrafterInfo(name="ngram", vocab_size=VOCAB),
        verifier_pb2.VerifierInfo(model="m", vocab_size=VOCAB, max_model_len=64, hidden_size=8, kv_budget_tokens=9, free_kv_tokens=9),
    ):
        assert _wire(msg) == msg
        validate(msg, vocab_size=VOCAB)


def test_to_proto_names_what_it_cannot_convert():
    with pytest.raises(TypeError, match="no message mirrors int"):
        convert.to_proto(3)


def test_unsupported_tensor_dtype_is_rejected():
    with pytest.raises(ValueError, match="Tensor dtype"):
        convert.tensor_to_proto(torch.zeros(2, dtype=torch.int32))


def test_common_enums_are_stable():
    # Field numbers and enum values are the wire format: changing one breaks deployed peers.
    assert common_pb2.DTYPE_FLOAT32 == 1 and common_pb2.DTYPE_FLOAT16 == 2 and common_pb2.DTYPE_BFLOAT16 == 3
    assert [common_pb2.FinishReason.Value(n) for n in ("FINISH_REASON_STOP", "FINISH_REASON_LENGTH", "FINISH_REASON_ABORT")] == [1, 2, 3]
