"""Boundary validation of incoming dspark.v1 messages.

A servicer validates every request before touching state and maps the error to gRPC:

    try:
        validate(request, vocab_size=runtime.vocab_size)
    except ValidationError as err:
        context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(err))   # "field: message"

Every check raises `ValidationError(field, message)`, `field` being the path of the offending
value (`requests[2].proposal.sparse.probs`) and `message` what was got and what was expected.
Nothing else escapes for any message the protobuf runtime can parse (a hypothesis test holds us
to that). What is checked: ids non-empty and unique within a call, token ids in [0, vocab),
lengths consistent with their sibling counts, probabilities finite, >= 0 and rows summing to 1
(within the rejection sampler's ROW_SUM_TOL), sparse ids in range or -1 padding (prob 0, no id
twice in a row), every draft token with p_d(x) > 0 under its own row, sampling params as in
SamplingParams, tensors whose bytes match dtype and shape, features that are finite. Inside the
services the messages are then trusted.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import numpy as np

from dspark.protos.dspark.v1 import common_pb2, drafter_pb2, scheduler_pb2, verifier_pb2
from dspark.sampling.logprobs import MAX_LOGPROBS, NOT_ASKED
from dspark.sampling.params import MIN_TEMPERATURE
from dspark.sampling.rejection_sampler import ROW_SUM_TOL  # one tolerance on draft rows, here and in the sampler
MAX_REQUEST_ID_LEN = 256
_ITEMSIZE = {common_pb2.DTYPE_FLOAT32: 4, common_pb2.DTYPE_FLOAT16: 2, common_pb2.DTYPE_BFLOAT16: 2}
_NUMPY_DTYPE = {common_pb2.DTYPE_FLOAT32: "<f4", common_pb2.DTYPE_FLOAT16: "<f2", common_pb2.DTYPE_BFLOAT16: "<u2"}


class ValidationError(ValueError):
    """An invalid field of an incoming message; servicers answer INVALID_ARGUMENT with str(self)."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


def _check(ok: bool, field: str | Callable[[], str], message: str | Callable[[], str]) -> None:
    """Raise unless ok; a callable field or message is evaluated only on failure."""
    if not ok:
        raise ValidationError(field() if callable(field) else field, message() if callable(message) else message)


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _preview(values: Sequence) -> str:
    vals = list(values[:5])
    return f"{vals}{' ...' if len(values) > 5 else ''}"


# ---------------------------------------------------------------------------------------------
# Building blocks
# ---------------------------------------------------------------------------------------------


def request_id(value: str, field: str = "request_id") -> None:
    _check(len(value) > 0, field, "must be a non-empty string")
    _check(len(value) <= MAX_REQUEST_ID_LEN, field, f"must be at most {MAX_REQUEST_ID_LEN} characters, got {len(value)}")


def _unique_ids(values: Sequence[str], field: str) -> None:
    seen: set[str] = set()
    for i, v in enumerate(values):
        _check(v not in seen, f"{field}[{i}]", f"request id {v!r} appears more than once")
        seen.add(v)


def token_ids(values: Sequence[int], field: str, *, vocab_size: int, allow_empty: bool = True) -> np.ndarray:
    """[n] ids in [0, vocab_size); returns them as int64."""
    arr = np.asarray(values, dtype=np.int64)
    _check(allow_empty or arr.size > 0, field, "must hold at least one token id, got none")
    bad = np.flatnonzero((arr < 0) | (arr >= vocab_size))
    _check(bad.size == 0, lambda: f"{field}[{bad[0]}]", lambda: f"token id {arr[bad[0]]} out of range [0, {vocab_size})")
    return arr


def sampling_params(msg: common_pb2.SamplingParams, field: str = "") -> None:
    t, p = msg.temperature, msg.top_p
    _check(t == 0.0 or (math.isfinite(t) and t >= MIN_TEMPERATURE), _join(field, "temperature"),
           f"must be 0 (greedy) or finite and >= {MIN_TEMPERATURE:g} (smaller ones overflow), got {t}")
    _check(0.0 < p <= 1.0, _join(field, "top_p"), f"must be in (0, 1], got {p}")
    _check(msg.top_k >= 0, _join(field, "top_k"), f"must be >= 0 (0 disables it), got {msg.top_k}")


def _params_field(parent, field: str) -> None:
    _check(parent.HasField("params"), field, "missing: sampling params are required")
    sampling_params(parent.params, field)


def tensor(msg: common_pb2.Tensor, field: str, *, ndim: int | None = None, dims: str = "") -> tuple[int, ...]:
    """dtype known, sizes >= 0, len(data) == prod(shape) * itemsize; returns the shape."""
    _check(msg.dtype in _ITEMSIZE, f"{field}.dtype", f"must be FLOAT32, FLOAT16 or BFLOAT16, got enum value {msg.dtype}")
    shape = tuple(msg.shape)
    if ndim is not None:
        _check(len(shape) == ndim, f"{field}.shape", f"must have {ndim} dims [{dims}], got {list(shape)}")
    _check(all(s >= 0 for s in shape), f"{field}.shape", f"sizes must be >= 0, got {list(shape)}")
    want = math.prod(shape) * _ITEMSIZE[msg.dtype]
    _check(len(msg.data) == want, f"{field}.data", f"must be {want} bytes for shape {list(shape)}, got {len(msg.data)}")
    return shape


def finite_tensor(msg: common_pb2.Tensor, field: str) -> None:
    """Every element of an (already checked) tensor is finite: NaN or inf features would poison the
    drafter's distributions (they cannot be sampled from)."""
    values = np.frombuffer(msg.data, dtype=_NUMPY_DTYPE[msg.dtype])
    # bf16 as raw uint16: all exponent bits set means inf or NaN
    bad = np.flatnonzero((values & 0x7F80) == 0x7F80 if msg.dtype == common_pb2.DTYPE_BFLOAT16 else ~np.isfinite(values))
    _check(bad.size == 0, f"{field}.data", lambda: f"element {bad[0]} (of {values.size}) is NaN or infinite; features must be finite")


def _rows(probs: np.ndarray, field: str) -> None:
    """probs [n, width] fp32: finite, >= 0, each row sums to 1 within ROW_SUM_TOL."""
    bad = np.argwhere(~np.isfinite(probs) | (probs < 0))
    _check(bad.size == 0, field, lambda: f"row {bad[0][0]} has {probs[tuple(bad[0])]}: probabilities must be finite and >= 0")
    if probs.shape[0]:
        sums = probs.astype(np.float64).sum(axis=1)
        r = int(np.abs(sums - 1.0).argmax())
        _check(abs(sums[r] - 1.0) <= ROW_SUM_TOL, field, lambda: f"row {r} sums to {sums[r]:.6f}, expected 1 (tol {ROW_SUM_TOL})")


def draft_rows(parent, oneof: str, tokens: np.ndarray, field: str, *, vocab_size: int, token_field: str = "token_ids") -> None:
    """The sparse / dense rows under `parent`'s oneof `oneof`, one per token of `tokens` [n]
    (already checked to be in range); `field` is the path of `parent` ("" at the top level)."""
    n = tokens.shape[0]
    which = parent.WhichOneof(oneof)
    _check(which is not None, _join(field, oneof), f"missing: {n} draft tokens need their rows (sparse or dense)")
    if which == "dense":
        d, f = parent.dense, _join(field, "dense")
        _check(d.vocab_size == vocab_size, f"{f}.vocab_size", f"must be the model's vocab size {vocab_size}, got {d.vocab_size}")
        _check(len(d.probs) == n * vocab_size, f"{f}.probs", f"must hold num_draft * vocab_size = {n} * {vocab_size} floats, got {len(d.probs)}")
        probs = np.asarray(d.probs, dtype=np.float32).reshape(n, vocab_size)
        _rows(probs, f"{f}.probs")
        p_x = probs[np.arange(n), tokens]
    else:
        s, f = parent.sparse, _join(field, "sparse")
        _check(s.k >= 1 or (n == 0 and s.k == 0), f"{f}.k", f"must be >= 1 (or 0 with no rows), got {s.k}")
        _check(s.k <= vocab_size, f"{f}.k", f"must be <= the vocab size {vocab_size}, got {s.k}")
        k = max(s.k, 0)
        _check(len(s.ids) == n * k, f"{f}.ids", f"must hold num_draft * k = {n} * {k} ids, got {len(s.ids)}")
        _check(len(s.probs) == n * k, f"{f}.probs", f"must hold num_draft * k = {n} * {k} probs, got {len(s.probs)}")
        if n == 0:
            return
        ids = np.asarray(s.ids, dtype=np.int64).reshape(n, k)
        probs = np.asarray(s.probs, dtype=np.float32).reshape(n, k)
        bad = np.argwhere((ids < -1) | (ids >= vocab_size))
        _check(bad.size == 0, lambda: f"{f}.ids", lambda: f"row {bad[0][0]} has id {ids[tuple(bad[0])]}, expected [0, {vocab_size}) or -1 (padding)")
        pad = ids == -1
        bad = np.argwhere(pad & (probs != 0))
        _check(bad.size == 0, lambda: f"{f}.probs", lambda: f"row {bad[0][0]} gives padding (id -1) probability {probs[tuple(bad[0])]}, expected 0")
        _rows(probs, f"{f}.probs")
        srt = np.sort(np.where(pad, -1 - np.arange(k), ids), axis=1)  # padding made distinct
        dup = np.argwhere(srt[:, 1:] == srt[:, :-1])
        _check(dup.size == 0, lambda: f"{f}.ids", lambda: f"row {dup[0][0]} lists id {srt[tuple(dup[0])]} twice")
        p_x = np.where(ids == tokens[:, None], probs, 0).sum(axis=1)
    bad = np.flatnonzero(p_x <= 0)
    _check(bad.size == 0, lambda: _join(field, f"{token_field}[{bad[0]}]"),
           lambda: f"token {tokens[bad[0]]} has p_d = 0 under its own row: the drafter cannot have sampled it")


# ---------------------------------------------------------------------------------------------
# common.proto
# ---------------------------------------------------------------------------------------------


def draft_proposal(msg: common_pb2.DraftProposal, *, vocab_size: int, field: str = "proposal",
                   max_draft_tokens: int | None = None) -> None:
    tokens = token_ids(msg.token_ids, f"{field}.token_ids", vocab_size=vocab_size)
    n = tokens.shape[0]
    if max_draft_tokens is not None:
        _check(n <= max_draft_tokens, f"{field}.token_ids", f"{n} draft tokens, at most max_draft_tokens = {max_draft_tokens} allowed")
    draft_rows(msg, "rows", tokens, field, vocab_size=vocab_size)
    c = msg.confidences
    _check(len(c) in (0, n), f"{field}.confidences", f"must be empty or hold one per draft token ({n}), got {len(c)}")
    conf = np.asarray(c, dtype=np.float32)
    bad = np.flatnonzero(~((conf >= 0) & (conf <= 1)))
    _check(bad.size == 0, lambda: f"{field}.confidences[{bad[0]}]", lambda: f"must be in [0, 1], got {conf[bad[0]]}")


# ---------------------------------------------------------------------------------------------
# drafter.proto
# ---------------------------------------------------------------------------------------------


def drafter_add_request(msg: drafter_pb2.DrafterAddRequest, *, vocab_size: int) -> None:
    request_id(msg.request_id)
    token_ids(msg.prompt_ids, "prompt_ids", vocab_size=vocab_size, allow_empty=False)
    _params_field(msg, "params")


def draft_request(msg: drafter_pb2.DraftRequest, *, vocab_size: int, field: str = "request") -> None:
    request_id(msg.request_id, f"{field}.request_id")
    token_ids(msg.token_ids, f"{field}.token_ids", vocab_size=vocab_size, allow_empty=False)
    _check(msg.token_offset >= 0, f"{field}.token_offset", f"must be >= 0, got {msg.token_offset}")
    total = msg.token_offset + len(msg.token_ids)
    _check(1 <= msg.num_prompt_tokens <= total, f"{field}.num_prompt_tokens",
           f"must be in [1, token_offset + len(token_ids)] = [1, {total}], got {msg.num_prompt_tokens}")
    _params_field(msg, f"{field}.params")
    _check(msg.max_draft_tokens >= 0, f"{field}.max_draft_tokens", f"must be >= 0, got {msg.max_draft_tokens}")


def draft_round_request(msg: drafter_pb2.DraftRoundRequest, *, vocab_size: int) -> None:
    for i, r in enumerate(msg.requests):
        draft_request(r, vocab_size=vocab_size, field=f"requests[{i}]")
    _unique_ids([r.request_id for r in msg.requests], "requests.request_id")


def draft_block(msg: drafter_pb2.DraftBlock, *, vocab_size: int, max_draft_tokens: int | None = None) -> None:
    request_id(msg.request_id)
    _check(msg.HasField("proposal"), "proposal", "missing")
    draft_proposal(msg.proposal, vocab_size=vocab_size, max_draft_tokens=max_draft_tokens)


def append_features(msg: drafter_pb2.AppendFeaturesRequest, *, num_capture_layers: int | None = None,
                    hidden_size: int | None = None) -> None:
    for i, item in enumerate(msg.requests):
        f = f"requests[{i}]"
        request_id(item.request_id, f"{f}.request_id")
        _check(item.HasField("features"), f"{f}.features", "missing")
        shape = tensor(item.features, f"{f}.features", ndim=3, dims="num_new_positions, num_capture_layers, hidden")
        if num_capture_layers is not None:
            _check(shape[1] == num_capture_layers, f"{f}.features.shape", f"must have {num_capture_layers} layers, got {list(shape)}")
        if hidden_size is not None:
            _check(shape[2] == hidden_size, f"{f}.features.shape", f"must have hidden size {hidden_size}, got {list(shape)}")
        finite_tensor(item.features, f"{f}.features")
    _unique_ids([r.request_id for r in msg.requests], "requests.request_id")


def drafter_info(msg: drafter_pb2.DrafterInfo) -> None:
    _check(len(msg.name) > 0, "name", "must be a non-empty drafter name")
    _check(msg.vocab_size >= 1, "vocab_size", f"must be >= 1, got {msg.vocab_size}")
    _check(msg.block_size >= 0, "block_size", f"must be >= 0 (0: no bound), got {msg.block_size}")
    _check(0 <= msg.draft_vocab_size <= msg.vocab_size, "draft_vocab_size",
           f"must be in [0, vocab_size={msg.vocab_size}] (0: the whole vocabulary), got {msg.draft_vocab_size}")
    bad = [layer for layer in msg.capture_layers if layer < 0]
    _check(not bad, "capture_layers", f"layer indices must be >= 0, got {_preview(list(msg.capture_layers))}")
    if msg.needs_hidden_states:
        _check(len(msg.capture_layers) > 0, "capture_layers", "must list the target layers a drafter that needs hidden states reads")
        _check(msg.hidden_size >= 1, "hidden_size", f"must be >= 1 for a drafter that needs hidden states, got {msg.hidden_size}")
    else:
        _check(msg.hidden_size >= 0, "hidden_size", f"must be >= 0, got {msg.hidden_size}")


def remove_request(msg: drafter_pb2.DrafterRemoveRequest | verifier_pb2.VerifierRemoveRequest) -> None:
    for i, r in enumerate(msg.request_ids):
        request_id(r, f"request_ids[{i}]")


# ---------------------------------------------------------------------------------------------
# verifier.proto
# ---------------------------------------------------------------------------------------------


def verifier_add_request(msg: verifier_pb2.VerifierAddRequest, *, vocab_size: int, max_model_len: int | None = None) -> None:
    request_id(msg.request_id)
    token_ids(msg.prompt_ids, "prompt_ids", vocab_size=vocab_size, allow_empty=False)
    _params_field(msg, "params")
    n = len(msg.prompt_ids)
    _check(msg.num_kv_tokens > n, "num_kv_tokens", f"must exceed the prompt length {n} (prompt + max_new_tokens), got {msg.num_kv_tokens}")
    if max_model_len is not None:
        _check(msg.num_kv_tokens <= max_model_len, "num_kv_tokens",
               f"must be <= the context window {max_model_len}, got {msg.num_kv_tokens}")


def verify_batch(msg: verifier_pb2.VerifyBatch, *, vocab_size: int) -> None:
    r = len(msg.request_ids)
    for i, rid in enumerate(msg.request_ids):
        request_id(rid, f"request_ids[{i}]")
    _unique_ids(msg.request_ids, "request_ids")
    for name in ("anchor_token_ids", "num_draft_tokens"):
        got = len(getattr(msg, name))
        _check(got == r, name, f"must hold one entry per request ({r}), got {got}")
    lens = np.asarray(msg.num_draft_tokens, dtype=np.int64)
    bad = np.flatnonzero(lens < 0)
    _check(bad.size == 0, lambda: f"num_draft_tokens[{bad[0]}]", lambda: f"must be >= 0, got {lens[bad[0]]}")
    anchors = np.asarray(msg.anchor_token_ids, dtype=np.int64)
    bad = np.flatnonzero((anchors < -1) | (anchors >= vocab_size))
    _check(bad.size == 0, lambda: f"anchor_token_ids[{bad[0]}]",
           lambda: f"token id {anchors[bad[0]]} out of range [0, {vocab_size}) (or -1 for a first round)")
    bad = np.flatnonzero((anchors == -1) & (lens > 0))
    _check(bad.size == 0, lambda: f"num_draft_tokens[{bad[0]}]",
           lambda: f"a first round (anchor -1) prefills the prompt and takes no drafts, got {lens[bad[0]]}")
    total = int(lens.sum())
    _check(len(msg.draft_token_ids) == total, "draft_token_ids",
           f"must hold sum(num_draft_tokens) = {total} ids, got {len(msg.draft_token_ids)}")
    tokens = token_ids(msg.draft_token_ids, "draft_token_ids", vocab_size=vocab_size)
    if total or msg.WhichOneof("draft_probs") is not None:
        draft_rows(msg, "draft_probs", tokens, "", vocab_size=vocab_size, token_field="draft_token_ids")
    if len(msg.num_logprobs):
        _check(len(msg.num_logprobs) == r, "num_logprobs", f"must hold one entry per request ({r}) or none, got {len(msg.num_logprobs)}")
        k = np.asarray(msg.num_logprobs, dtype=np.int64)
        bad = np.flatnonzero((k < NOT_ASKED) | (k > MAX_LOGPROBS))
        _check(bad.size == 0, lambda: f"num_logprobs[{bad[0]}]",
               lambda: f"must be in [0, {MAX_LOGPROBS}] or {NOT_ASKED} (none), got {k[bad[0]]}")


def token_logprobs(msg: common_pb2.TokenLogprobs, field: str, *, num_tokens: int, vocab_size: int) -> None:
    """Log-probabilities of `num_tokens` tokens: sizes, k, alternative ids (-1 = none)."""
    n = len(msg.logprobs)
    _check(n == num_tokens, _join(field, "logprobs"), f"must hold one entry per token ({num_tokens}), got {n}")
    _check(0 <= msg.k <= MAX_LOGPROBS, _join(field, "k"), f"must be in [0, {MAX_LOGPROBS}], got {msg.k}")
    for name in ("top_ids", "top_logprobs"):
        got = len(getattr(msg, name))
        _check(got == n * msg.k, _join(field, name), f"must hold num_tokens * k = {n * msg.k} entries, got {got}")
    ids = np.asarray(msg.top_ids, dtype=np.int64)
    bad = np.flatnonzero((ids < -1) | (ids >= vocab_size))
    _check(bad.size == 0, lambda: _join(field, f"top_ids[{bad[0]}]"),
           lambda: f"token id {ids[bad[0]]} out of range [0, {vocab_size}) (or -1: none)")


def verify_result(msg: verifier_pb2.VerifyResult, *, vocab_size: int) -> None:
    r = len(msg.request_ids)
    for i, rid in enumerate(msg.request_ids):
        request_id(rid, f"request_ids[{i}]")
    _check(len(msg.num_accepted) == r, "num_accepted", f"must hold one entry per request ({r}), got {len(msg.num_accepted)}")
    _check(msg.max_num_draft >= 0, "max_num_draft", f"must be >= 0, got {msg.max_num_draft}")
    acc = np.asarray(msg.num_accepted, dtype=np.int64)
    bad = np.flatnonzero((acc < 0) | (acc > msg.max_num_draft))
    _check(bad.size == 0, lambda: f"num_accepted[{bad[0]}]", lambda: f"must be in [0, max_num_draft = {msg.max_num_draft}], got {acc[bad[0]]}")
    want = int(acc.sum()) + r
    _check(len(msg.emitted_token_ids) == want, "emitted_token_ids",
           f"must hold sum(num_accepted + 1) = {want} ids, got {len(msg.emitted_token_ids)}")
    token_ids(msg.emitted_token_ids, "emitted_token_ids", vocab_size=vocab_size)
    if msg.HasField("hidden_states"):
        shape = tensor(msg.hidden_states, "hidden_states", ndim=3, dims="num_positions, num_capture_layers, hidden")
        _check(len(msg.num_hidden_positions) == r, "num_hidden_positions",
               f"must hold one entry per request ({r}), got {len(msg.num_hidden_positions)}")
        n = np.asarray(msg.num_hidden_positions, dtype=np.int64)
        _check(bool((n >= 0).all()), "num_hidden_positions", f"must be >= 0, got {_preview(n.tolist())}")
        _check(int(n.sum()) == shape[0], "num_hidden_positions", f"must sum to hidden_states.shape[0] = {shape[0]}, got {int(n.sum())}")
    else:
        _check(len(msg.num_hidden_positions) == 0, "num_hidden_positions", "must be empty when hidden_states is absent")
    if msg.HasField("logprobs"):
        token_logprobs(msg.logprobs, "logprobs", num_tokens=want, vocab_size=vocab_size)


def verifier_info(msg: verifier_pb2.VerifierInfo) -> None:
    _check(msg.vocab_size >= 1, "vocab_size", f"must be >= 1, got {msg.vocab_size}")
    _check(msg.max_model_len >= 1, "max_model_len", f"must be >= 1, got {msg.max_model_len}")
    bad = [layer for layer in msg.capture_layers if layer < 0]
    _check(not bad, "capture_layers", f"layer indices must be >= 0, got {_preview(list(msg.capture_layers))}")
    _check(msg.hidden_size >= 1, "hidden_size", f"must be >= 1, got {msg.hidden_size}")
    _check(msg.kv_budget_tokens >= 1, "kv_budget_tokens", f"must be >= 1, got {msg.kv_budget_tokens}")
    _check(0 <= msg.free_kv_tokens <= msg.kv_budget_tokens, "free_kv_tokens",
           f"must be in [0, kv_budget_tokens = {msg.kv_budget_tokens}], got {msg.free_kv_tokens}")


def sps_profile(msg: verifier_pb2.SPSProfile) -> None:
    b, t = list(msg.batch_sizes), list(msg.step_seconds)
    _check(len(b) > 0, "batch_sizes", "must hold at least one measured batch size")
    _check(len(t) == len(b), "step_seconds", f"must hold one time per batch size ({len(b)}), got {len(t)}")
    _check(b[0] >= 1, "batch_sizes[0]", f"must be >= 1, got {b[0]}")
    for i in range(1, len(b)):
        _check(b[i] > b[i - 1], f"batch_sizes[{i}]", f"must be strictly ascending, got {b[i]} after {b[i - 1]}")
    for i, s in enumerate(t):
        _check(math.isfinite(s) and s > 0, f"step_seconds[{i}]", f"must be finite and > 0, got {s}")


# ---------------------------------------------------------------------------------------------
# scheduler.proto
# ---------------------------------------------------------------------------------------------


def generation_request(msg: scheduler_pb2.GenerationRequest, *, vocab_size: int) -> None:
    request_id(msg.request_id)
    token_ids(msg.prompt_ids, "prompt_ids", vocab_size=vocab_size, allow_empty=False)
    _check(msg.max_new_tokens >= 1, "max_new_tokens", f"must be >= 1, got {msg.max_new_tokens}")
    _params_field(msg, "params")
    token_ids(msg.stop_token_ids, "stop_token_ids", vocab_size=vocab_size)
    if msg.HasField("logprobs"):
        _check(0 <= msg.logprobs <= MAX_LOGPROBS, "logprobs", f"must be in [0, {MAX_LOGPROBS}] when set, got {msg.logprobs}")


def step_output(msg: scheduler_pb2.StepOutput, *, vocab_size: int) -> None:
    request_id(msg.request_id)
    token_ids(msg.new_token_ids, "new_token_ids", vocab_size=vocab_size)
    known = common_pb2.FinishReason.values()
    _check(msg.finish_reason in known, "finish_reason", f"unknown enum value {msg.finish_reason}, expected one of {known}")
    if msg.HasField("logprobs"):
        token_logprobs(msg.logprobs, "logprobs", num_tokens=len(msg.new_token_ids), vocab_size=vocab_size)


def cancel_request(msg: scheduler_pb2.CancelRequest) -> None:
    request_id(msg.request_id)


# ---------------------------------------------------------------------------------------------
# Dispatch
# ---------------------------------------------------------------------------------------------

_NEEDS_VOCAB: dict[type, Callable] = {
    common_pb2.DraftProposal: draft_proposal,
    drafter_pb2.DrafterAddRequest: drafter_add_request,
    drafter_pb2.DraftRequest: draft_request,
    drafter_pb2.DraftRoundRequest: draft_round_request,
    drafter_pb2.DraftBlock: draft_block,
    verifier_pb2.VerifierAddRequest: verifier_add_request,
    verifier_pb2.VerifyBatch: verify_batch,
    verifier_pb2.VerifyResult: verify_result,
    scheduler_pb2.GenerationRequest: generation_request,
    scheduler_pb2.StepOutput: step_output,
}
_NO_CONTEXT: dict[type, Callable] = {
    common_pb2.SamplingParams: sampling_params,
    drafter_pb2.AppendFeaturesRequest: append_features,
    drafter_pb2.DrafterRemoveRequest: remove_request,
    verifier_pb2.VerifierRemoveRequest: remove_request,
    verifier_pb2.SPSProfile: sps_profile,
    scheduler_pb2.CancelRequest: cancel_request,
    drafter_pb2.DrafterInfo: drafter_info,
    verifier_pb2.VerifierInfo: verifier_info,
}
_NOTHING_TO_CHECK = (
    drafter_pb2.DrafterAddResponse, drafter_pb2.AppendFeaturesResponse, drafter_pb2.DrafterRemoveResponse,
    verifier_pb2.VerifierAddResponse, verifier_pb2.VerifierRemoveResponse, verifier_pb2.GetSPSProfileRequest,
    scheduler_pb2.CancelResponse, scheduler_pb2.StatsRequest, scheduler_pb2.SchedulerStats,
    drafter_pb2.GetDrafterInfoRequest, verifier_pb2.GetVerifierInfoRequest,
)


def validate(msg, *, vocab_size: int) -> None:
    """Validate any top-level dspark.v1 message with the defaults (no optional context such as
    max_model_len or the hidden size: call the specific function for those)."""
    kind = type(msg)
    if kind in _NEEDS_VOCAB:
        _NEEDS_VOCAB[kind](msg, vocab_size=vocab_size)
    elif kind in _NO_CONTEXT:
        _NO_CONTEXT[kind](msg)
    elif kind not in _NOTHING_TO_CHECK:
        raise TypeError(f"no validator for {kind.__name__}")
