"""Conversion between the contract dataclasses and the dspark.v1 protobuf messages.

Each message mirrors one dataclass field for field; `to_proto(x)` / `<name>_from_proto(msg)`
convert both ways and round-trip exactly (floats are fp32 on the wire where the dataclass holds
fp32, doubles where it holds Python floats). Wire encoding of tensors (protos/README.md):

  * token ids, draft rows, confidences, counts: packed repeated scalars (int32, float32),
    flattened row-major, their shape given by sibling fields (k, vocab_size, num_draft_tokens);
  * hidden states: `Tensor` = raw little-endian bytes + dtype (fp32/fp16/bf16) + shape.

`VerifyBatch` (the draft side of a `RejectionBatch`: what the scheduler sends a verifier) and
`VerifyResult` (a `RejectionResult` plus the captured hidden states) live beside the Verifier
contract in dspark.engine.verifier and are re-exported here. Conversion does not validate: run
dspark.protos.validate on incoming messages first (from_proto on an invalid message may raise anything).
"""

from __future__ import annotations

import sys

import numpy as np
import torch

from dspark.drafters.base import DraftProposal, DraftRequest
from dspark.engine.speculative import GenerationRequest, StepOutput
from dspark.engine.verifier import VerifyBatch, VerifyResult
from dspark.profiling.sps import SPSProfile
from dspark.protos.dspark.v1 import common_pb2, drafter_pb2, scheduler_pb2, verifier_pb2
from dspark.sampling.logprobs import RoundLogprobs, TokenLogprobs
from dspark.sampling.params import SamplingParams
from dspark.sampling.rejection_sampler import DraftProbs, RejectionResult

if sys.byteorder != "little":  # Tensor.data is little-endian and we copy raw memory
    raise ImportError("dspark.protos.convert assumes a little-endian host")

_DTYPES = {
    torch.float32: common_pb2.DTYPE_FLOAT32,
    torch.float16: common_pb2.DTYPE_FLOAT16,
    torch.bfloat16: common_pb2.DTYPE_BFLOAT16,
}
_TORCH_DTYPES = {v: k for k, v in _DTYPES.items()}
_FINISH_REASONS = {
    None: common_pb2.FINISH_REASON_UNSPECIFIED,
    "stop": common_pb2.FINISH_REASON_STOP,
    "length": common_pb2.FINISH_REASON_LENGTH,
    "abort": common_pb2.FINISH_REASON_ABORT,
}
_FINISH_NAMES = {v: k for k, v in _FINISH_REASONS.items()}


# ---------------------------------------------------------------------------------------------
# Scalars and tensors
# ---------------------------------------------------------------------------------------------


def _ints(t: torch.Tensor) -> list[int]:
    return t.reshape(-1).tolist()


def _floats(t: torch.Tensor) -> np.ndarray:  # [numel] fp32
    return t.detach().reshape(-1).to(torch.float32).cpu().numpy()


def _long(values, shape: tuple[int, ...] | None = None) -> torch.Tensor:
    t = torch.tensor(np.asarray(values, dtype=np.int64))
    return t.reshape(shape) if shape is not None else t


def _f32(values, shape: tuple[int, ...] | None = None) -> torch.Tensor:
    t = torch.from_numpy(np.array(values, dtype=np.float32))
    return t.reshape(shape) if shape is not None else t


def tensor_to_proto(t: torch.Tensor) -> common_pb2.Tensor:
    """Raw bytes of a fp32 / fp16 / bf16 tensor (bf16 goes through an int16 view: numpy has no bf16)."""
    if t.dtype not in _DTYPES:
        raise ValueError(f"Tensor dtype must be one of {list(_DTYPES)}, got {t.dtype}")
    flat = t.detach().contiguous().cpu().reshape(-1)
    raw = flat.view(torch.int16) if t.dtype in (torch.float16, torch.bfloat16) else flat
    return common_pb2.Tensor(dtype=_DTYPES[t.dtype], shape=list(t.shape), data=raw.numpy().tobytes())


def tensor_from_proto(msg: common_pb2.Tensor) -> torch.Tensor:
    dtype = _TORCH_DTYPES[msg.dtype]
    if not msg.data:  # frombuffer rejects an empty buffer
        return torch.empty(tuple(msg.shape), dtype=dtype)
    return torch.frombuffer(bytearray(msg.data), dtype=dtype).reshape(tuple(msg.shape))


# ---------------------------------------------------------------------------------------------
# common.proto
# ---------------------------------------------------------------------------------------------


def sampling_params_to_proto(p: SamplingParams) -> common_pb2.SamplingParams:
    return common_pb2.SamplingParams(temperature=p.temperature, top_p=p.top_p, top_k=p.top_k, seed=p.seed)


def sampling_params_from_proto(msg: common_pb2.SamplingParams) -> SamplingParams:
    return SamplingParams(
        temperature=msg.temperature, top_p=msg.top_p, top_k=msg.top_k,
        seed=msg.seed if msg.HasField("seed") else None,
    )


def sparse_rows_to_proto(ids: torch.Tensor, probs: torch.Tensor) -> common_pb2.SparseRows:  # [n, k] each
    msg = common_pb2.SparseRows(k=int(ids.shape[1]) if ids.dim() == 2 else 0, ids=_ints(ids))
    msg.probs.extend(_floats(probs).tolist())  # a list extends ~4x faster than a numpy array
    return msg


def sparse_rows_from_proto(msg: common_pb2.SparseRows) -> tuple[torch.Tensor, torch.Tensor]:  # [n, k] int64, fp32
    k = msg.k
    n = len(msg.ids) // k if k else 0
    return _long(msg.ids, (n, k)), _f32(msg.probs, (n, k))


def dense_rows_to_proto(probs: torch.Tensor) -> common_pb2.DenseRows:  # [n, vocab]
    msg = common_pb2.DenseRows(vocab_size=int(probs.shape[1]))
    msg.probs.extend(_floats(probs).tolist())
    return msg


def dense_rows_from_proto(msg: common_pb2.DenseRows) -> torch.Tensor:  # [n, vocab] fp32
    v = msg.vocab_size
    return _f32(msg.probs, (len(msg.probs) // v if v else 0, v))


def draft_proposal_to_proto(p: DraftProposal) -> common_pb2.DraftProposal:
    """Confidences None and an empty confidence tensor both travel as an empty list (read back as None
    when there are no drafts, as an empty tensor never when there are: validation rejects it)."""
    msg = common_pb2.DraftProposal(token_ids=_ints(p.token_ids), free=p.free)
    if p.dense_probs is not None:
        msg.dense.CopyFrom(dense_rows_to_proto(p.dense_probs))
    else:
        msg.sparse.CopyFrom(sparse_rows_to_proto(p.prob_ids, p.probs))
    if p.confidences is not None:
        msg.confidences.extend(_floats(p.confidences).tolist())
    return msg


def draft_proposal_from_proto(msg: common_pb2.DraftProposal) -> DraftProposal:
    n = len(msg.token_ids)
    confidences = _f32(msg.confidences) if len(msg.confidences) else None
    if msg.WhichOneof("rows") == "dense":
        return DraftProposal(token_ids=_long(msg.token_ids), dense_probs=dense_rows_from_proto(msg.dense), confidences=confidences,
                             free=msg.free)
    ids, probs = sparse_rows_from_proto(msg.sparse)
    if n == 0 and msg.sparse.k == 0:
        ids, probs = ids.reshape(0, 1), probs.reshape(0, 1)  # DraftProposal.empty()'s shape
    return DraftProposal(token_ids=_long(msg.token_ids), prob_ids=ids, probs=probs, confidences=confidences, free=msg.free)


def draft_probs_to_proto(dp: DraftProbs, msg) -> None:
    """Fill the `sparse` / `dense` oneof of `msg` (VerifyBatch) from DraftProbs."""
    if dp.is_sparse:
        msg.sparse.CopyFrom(sparse_rows_to_proto(dp.sparse_ids, dp.sparse_probs))
    else:
        msg.dense.CopyFrom(dense_rows_to_proto(dp.dense))


def draft_probs_from_proto(msg) -> DraftProbs | None:
    which = msg.WhichOneof("draft_probs")
    if which is None:
        return None
    if which == "dense":
        return DraftProbs(dense=dense_rows_from_proto(msg.dense))
    ids, probs = sparse_rows_from_proto(msg.sparse)
    return DraftProbs(sparse_ids=ids, sparse_probs=probs)


# ---------------------------------------------------------------------------------------------
# drafter.proto
# ---------------------------------------------------------------------------------------------


def draft_request_to_proto(r: DraftRequest, *, token_offset: int = 0) -> drafter_pb2.DraftRequest:
    """token_offset > 0 sends only token_ids[token_offset:] (the drafter keeps the rest)."""
    if not 0 <= token_offset < len(r.token_ids):
        raise ValueError(f"token_offset must be in [0, {len(r.token_ids)}) to keep the anchor, got {token_offset}")
    return drafter_pb2.DraftRequest(
        request_id=r.request_id, token_ids=r.token_ids[token_offset:], num_prompt_tokens=r.num_prompt_tokens,
        params=sampling_params_to_proto(r.params), max_draft_tokens=r.max_draft_tokens, token_offset=token_offset,
        free_only=r.free_only,
    )


def draft_request_from_proto(
    msg: drafter_pb2.DraftRequest,
    *,
    known_token_ids: list[int] | None = None,  # the drafter's copy of the sequence, if token_offset > 0
    generator: torch.Generator | None = None,  # the request's stream, kept by the drafter
) -> DraftRequest:
    tokens = list(msg.token_ids)
    if msg.token_offset:
        if known_token_ids is None or len(known_token_ids) < msg.token_offset:
            have = "none" if known_token_ids is None else len(known_token_ids)
            raise ValueError(f"token_offset {msg.token_offset} needs that many known tokens, have {have}")
        tokens = list(known_token_ids[: msg.token_offset]) + tokens
    return DraftRequest(
        request_id=msg.request_id, token_ids=tokens, num_prompt_tokens=msg.num_prompt_tokens,
        params=sampling_params_from_proto(msg.params), max_draft_tokens=msg.max_draft_tokens, generator=generator,
        free_only=msg.free_only,
    )


def draft_round_to_proto(round_id: int, requests: list[DraftRequest]) -> drafter_pb2.DraftRoundRequest:
    return drafter_pb2.DraftRoundRequest(round_id=round_id, requests=[draft_request_to_proto(r) for r in requests])


def draft_block_to_proto(round_id: int, request_id: str, proposal: DraftProposal) -> drafter_pb2.DraftBlock:
    return drafter_pb2.DraftBlock(round_id=round_id, request_id=request_id, proposal=draft_proposal_to_proto(proposal))


def draft_block_from_proto(msg: drafter_pb2.DraftBlock) -> tuple[int, str, DraftProposal]:
    return msg.round_id, msg.request_id, draft_proposal_from_proto(msg.proposal)


def append_features_to_proto(features: dict[str, torch.Tensor]) -> drafter_pb2.AppendFeaturesRequest:
    """features: request id -> [num_new_positions, num_capture_layers, hidden]."""
    return drafter_pb2.AppendFeaturesRequest(
        requests=[drafter_pb2.RequestFeatures(request_id=r, features=tensor_to_proto(f)) for r, f in features.items()]
    )


def append_features_from_proto(msg: drafter_pb2.AppendFeaturesRequest) -> dict[str, torch.Tensor]:
    return {item.request_id: tensor_from_proto(item.features) for item in msg.requests}


def token_logprobs_to_proto(lp: TokenLogprobs) -> common_pb2.TokenLogprobs:
    k = len(lp.top_ids[0]) if lp.top_ids else 0
    return common_pb2.TokenLogprobs(logprobs=lp.logprobs, k=k, top_ids=[t for row in lp.top_ids for t in row],
                                    top_logprobs=[x for row in lp.top_logprobs for x in row])


def token_logprobs_from_proto(msg: common_pb2.TokenLogprobs) -> TokenLogprobs:
    n, k = len(msg.logprobs), msg.k
    ids, lps = list(msg.top_ids), list(msg.top_logprobs)
    return TokenLogprobs(logprobs=list(msg.logprobs), top_ids=[ids[i * k : (i + 1) * k] for i in range(n)],
                         top_logprobs=[lps[i * k : (i + 1) * k] for i in range(n)])


def _emitted(num_accepted: torch.Tensor, width: int) -> torch.Tensor:  # [num_requests, width] bool
    return torch.arange(width)[None, :] <= num_accepted.cpu()[:, None]


def round_logprobs_to_proto(lp: RoundLogprobs, num_accepted: torch.Tensor) -> common_pb2.TokenLogprobs:
    """A round's logprobs over its emitted tokens, concatenated like VerifyResult.emitted_token_ids."""
    emitted = _emitted(num_accepted, lp.token_logprobs.shape[1])
    return common_pb2.TokenLogprobs(logprobs=_floats(lp.token_logprobs[emitted]).tolist(), k=lp.top_token_ids.shape[2],
                                    top_ids=_ints(lp.top_token_ids[emitted]), top_logprobs=_floats(lp.top_logprobs[emitted]).tolist())


def round_logprobs_from_proto(msg: common_pb2.TokenLogprobs, num_accepted: torch.Tensor, width: int) -> RoundLogprobs:
    r, k = num_accepted.shape[0], msg.k
    emitted = _emitted(num_accepted, width)
    token_logprobs = torch.full((r, width), float("nan"))
    top_token_ids = torch.full((r, width, k), -1, dtype=torch.long)
    top_logprobs = torch.full((r, width, k), float("nan"))
    token_logprobs[emitted] = _f32(msg.logprobs)
    top_token_ids[emitted] = _long(msg.top_ids, (-1, k))
    top_logprobs[emitted] = _f32(msg.top_logprobs, (-1, k))
    return RoundLogprobs(token_logprobs=token_logprobs, top_token_ids=top_token_ids, top_logprobs=top_logprobs)


# ---------------------------------------------------------------------------------------------
# verifier.proto
# ---------------------------------------------------------------------------------------------


def verify_batch_to_proto(b: VerifyBatch) -> verifier_pb2.VerifyBatch:
    msg = verifier_pb2.VerifyBatch(
        round_id=b.round_id, request_ids=b.request_ids, anchor_token_ids=_ints(b.anchor_token_ids),
        num_draft_tokens=_ints(b.num_draft_tokens), draft_token_ids=_ints(b.draft_token_ids),
        capture_hidden_states=b.capture_hidden_states,
        num_logprobs=[] if b.num_logprobs is None else _ints(b.num_logprobs),
    )
    if b.draft_probs is not None:
        draft_probs_to_proto(b.draft_probs, msg)
    return msg


def verify_batch_from_proto(msg: verifier_pb2.VerifyBatch) -> VerifyBatch:
    return VerifyBatch(
        round_id=msg.round_id, request_ids=list(msg.request_ids), anchor_token_ids=_long(msg.anchor_token_ids),
        num_draft_tokens=_long(msg.num_draft_tokens), draft_token_ids=_long(msg.draft_token_ids),
        draft_probs=draft_probs_from_proto(msg), capture_hidden_states=msg.capture_hidden_states,
        num_logprobs=_long(msg.num_logprobs) if len(msg.num_logprobs) else None,
    )


def verify_result_to_proto(v: VerifyResult) -> verifier_pb2.VerifyResult:
    out = v.result.output_token_ids
    accepted = _ints(v.result.num_accepted)
    rows = out.tolist()
    msg = verifier_pb2.VerifyResult(
        round_id=v.round_id, request_ids=v.request_ids, num_accepted=accepted,
        emitted_token_ids=[t for row, a in zip(rows, accepted) for t in row[: a + 1]],
        max_num_draft=int(out.shape[1]) - 1,
    )
    if v.hidden_states is not None:
        msg.hidden_states.CopyFrom(tensor_to_proto(v.hidden_states))
        msg.num_hidden_positions.extend(_ints(v.num_hidden_positions))
    if v.logprobs is not None:
        msg.logprobs.CopyFrom(round_logprobs_to_proto(v.logprobs, v.result.num_accepted))
    return msg


def verify_result_from_proto(msg: verifier_pb2.VerifyResult) -> VerifyResult:
    accepted = list(msg.num_accepted)
    out = torch.full((len(accepted), msg.max_num_draft + 1), -1, dtype=torch.int64)
    offset = 0
    for r, a in enumerate(accepted):  # per request: a few tokens, host side
        out[r, : a + 1] = torch.tensor(msg.emitted_token_ids[offset : offset + a + 1], dtype=torch.int64)
        offset += a + 1
    has_hidden = msg.HasField("hidden_states")
    num_accepted = _long(accepted)
    return VerifyResult(
        round_id=msg.round_id, request_ids=list(msg.request_ids),
        result=RejectionResult(output_token_ids=out, num_accepted=num_accepted),
        hidden_states=tensor_from_proto(msg.hidden_states) if has_hidden else None,
        num_hidden_positions=_long(msg.num_hidden_positions) if has_hidden else None,
        logprobs=round_logprobs_from_proto(msg.logprobs, num_accepted, msg.max_num_draft + 1) if msg.HasField("logprobs") else None,
    )


def sps_profile_to_proto(p: SPSProfile) -> verifier_pb2.SPSProfile:
    return verifier_pb2.SPSProfile(batch_sizes=p.batch_sizes, step_seconds=p.step_seconds)


def sps_profile_from_proto(msg: verifier_pb2.SPSProfile) -> SPSProfile:
    return SPSProfile(batch_sizes=list(msg.batch_sizes), step_seconds=list(msg.step_seconds))


# ---------------------------------------------------------------------------------------------
# scheduler.proto
# ---------------------------------------------------------------------------------------------


def generation_request_to_proto(r: GenerationRequest) -> scheduler_pb2.GenerationRequest:
    return scheduler_pb2.GenerationRequest(
        request_id=r.request_id, prompt_ids=r.prompt_ids, max_new_tokens=r.max_new_tokens,
        params=sampling_params_to_proto(r.params), stop_token_ids=sorted(r.stop_token_ids), logprobs=r.logprobs,
    )


def generation_request_from_proto(msg: scheduler_pb2.GenerationRequest) -> GenerationRequest:
    return GenerationRequest(
        request_id=msg.request_id, prompt_ids=list(msg.prompt_ids), max_new_tokens=msg.max_new_tokens,
        params=sampling_params_from_proto(msg.params), stop_token_ids=frozenset(msg.stop_token_ids),
        logprobs=msg.logprobs if msg.HasField("logprobs") else None,
    )


def step_output_to_proto(s: StepOutput) -> scheduler_pb2.StepOutput:
    msg = scheduler_pb2.StepOutput(
        request_id=s.request_id, new_token_ids=s.new_token_ids, finish_reason=_FINISH_REASONS[s.finish_reason]
    )
    if s.logprobs is not None:
        msg.logprobs.CopyFrom(token_logprobs_to_proto(s.logprobs))
    return msg


def step_output_from_proto(msg: scheduler_pb2.StepOutput) -> StepOutput:
    return StepOutput(
        request_id=msg.request_id, new_token_ids=list(msg.new_token_ids), finish_reason=_FINISH_NAMES[msg.finish_reason],
        logprobs=token_logprobs_from_proto(msg.logprobs) if msg.HasField("logprobs") else None,
    )


_TO_PROTO = {
    SamplingParams: sampling_params_to_proto,
    DraftProposal: draft_proposal_to_proto,
    DraftRequest: draft_request_to_proto,
    VerifyBatch: verify_batch_to_proto,
    VerifyResult: verify_result_to_proto,
    SPSProfile: sps_profile_to_proto,
    GenerationRequest: generation_request_to_proto,
    StepOutput: step_output_to_proto,
}


def to_proto(x):
    """The message mirroring dataclass `x` (DraftBlock / DraftRoundRequest / AppendFeatures have
    their own functions: they wrap more than one dataclass)."""
    try:
        return _TO_PROTO[type(x)](x)
    except KeyError:
        raise TypeError(f"no message mirrors {type(x).__name__}; expected one of {[t.__name__ for t in _TO_PROTO]}") from None
