"""Lossless verification of draft tokens: the rejection sampler over a flattened batch.

This module owns the contract between the engine and the verifier (`DraftProbs`,
`RejectionBatch`, `RejectionResult`), the validation of that contract at the boundary, the
random numbers a round consumes (`draw_rejection_randoms`), the plain per-request torch
reference (`rejection_sample_reference`, the definition the Triton kernel and the batched torch
path `rejection_sample_batched` are tested against) and the public entry point
`rejection_sample(batch, backend="torch" | "triton")`.

The math (docs/method.md §1), per request r with drafts x_1..x_l:
  * accept x_k iff u_k < p_t(x_k) / p_d(x_k), evaluated as u_k * p_d(x_k) < p_t(x_k) in fp32;
  * at the first rejection emit a draw from norm(max(0, p_t - p_d)) at that position;
  * if all l drafts are accepted emit the bonus, a draw from p_t at position l + 1.
The output then has exactly the target's distribution, for any p_d, provided p_d is the very
row the drafter sampled x_k from. Drafters draw x_k ~ row / sum(row) (`categorical.py`), so the
verifier renormalises each row before using it: a row whose fp32 sum is off by rounding (up to
~2e-5 for a dense softmax over 150k tokens) is then exactly the distribution x_k came from.
A request draws exactly ONE categorical token per round (the residual or the bonus), by the
exponential race argmax_v w(v) / E_r(v) with E_r ~ iid Exp(1): the winner of that race is
distributed as w / sum(w) without normalising w. Both backends evaluate the same fp32
expressions on the same random numbers, so they agree exactly.
Temperature 0 (greedy): accept while x_k == argmax of the target logits (ties: lowest id), then
emit that argmax.

Run the tests with `python -m pytest tests/sampling -q`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from dspark.model.fused_ops import race_argmax, row_argmax
from dspark.sampling.params import SamplingParams, logits_to_probs

BACKENDS = ("torch", "triton")
# How far a draft row's sum may be from 1. Rows are renormalised before use (exactness does not
# rest on this); the check refuses rows that are not distributions at all. fp32 softmax rows sum
# to 1 within 4e-6 at V = 49,152 and 2e-5 at V = 151,936 (the normaliser's rounding; top-p
# truncations within 4e-6, top-k ones within 3e-7): 1e-4 leaves a margin of five.
ROW_SUM_TOL = 1e-4
# A request whose support is at most 1/8 of the vocabulary (top-p / top-k rows: a few dozen
# tokens) draws Exp(1) on its support only, and the race runs on the gathered columns; a wider
# one (temperature alone) draws a whole vocabulary, with no support lookup (finding the ids of
# 49,152 columns, drawing on them and scattering back cost ~2 ms a request), and the race runs
# on whole rows.
COMPACT_RACE_FRACTION = 8


@dataclass
class DraftProbs:
    """The exact rows the drafter sampled each draft token from: dense, or sparse (truncated).

    Sparse rows are the drafter's top-k / top-p truncation, renormalised; p_d is zero outside
    the listed ids. Padding entries (id -1, prob 0) are allowed.
    """

    dense: torch.Tensor | None = None  # [num_draft_tokens, vocab] fp32, rows sum to 1 (within ROW_SUM_TOL)
    sparse_ids: torch.Tensor | None = None  # [num_draft_tokens, k] int64, -1 = padding
    sparse_probs: torch.Tensor | None = None  # [num_draft_tokens, k] fp32, rows sum to 1 (within ROW_SUM_TOL)

    def __post_init__(self) -> None:
        has_dense = self.dense is not None
        has_sparse = self.sparse_ids is not None or self.sparse_probs is not None
        if has_dense == has_sparse:
            raise ValueError(
                "DraftProbs needs exactly one of dense or (sparse_ids, sparse_probs), got "
                f"dense={'set' if has_dense else 'None'}, sparse={'set' if has_sparse else 'None'}"
            )
        if has_sparse and (self.sparse_ids is None or self.sparse_probs is None):
            raise ValueError("DraftProbs sparse rows need both sparse_ids and sparse_probs, got only one")

    @property
    def is_sparse(self) -> bool:
        return self.dense is None

    def to(self, device: torch.device | str, *, non_blocking: bool = False) -> "DraftProbs":
        """The same rows on `device` (the verifier's), without a copy where they already are."""
        def move(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.to(device, non_blocking=non_blocking)
        return DraftProbs(dense=move(self.dense), sparse_ids=move(self.sparse_ids), sparse_probs=move(self.sparse_probs))


@dataclass
class RejectionBatch:
    """One verification round of many requests, concatenated in request order (vLLM v1 style).

    Request r owns draft tokens [cu_r, cu_r + l_r) and target rows [cu_r + r, cu_r + r + l_r + 1),
    where cu_r = sum of l_j for j < r: its anchor's query position and one per draft token.
    """

    draft_token_ids: torch.Tensor  # [num_draft_tokens] int64
    num_draft_tokens: torch.Tensor  # [num_requests] int64, l_r >= 0
    target_logits: torch.Tensor  # [num_draft_tokens + num_requests, vocab]
    draft_probs: DraftProbs | None  # None only if no sampled request has a draft token
    params: list[SamplingParams]  # [num_requests]
    uniforms: torch.Tensor  # [num_draft_tokens] fp32 in [0, 1)
    # [num_requests, vocab] fp32, iid Exponential(1); None = drawn after the target side is
    # evaluated, only where a request's rows have mass, from `noise_generators` (draw_exp_noise)
    exp_noise: torch.Tensor | None
    noise_generators: list[torch.Generator | None] | None = None  # [num_requests], with exp_noise None

    @property
    def num_requests(self) -> int:
        return self.num_draft_tokens.shape[0]

    @property
    def vocab_size(self) -> int:
        return self.target_logits.shape[-1]


@dataclass
class RejectionResult:
    """Per request: the accepted drafts, then the corrected-or-bonus token, then -1 padding."""

    output_token_ids: torch.Tensor  # [num_requests, max_l + 1] int64
    num_accepted: torch.Tensor  # [num_requests] int64; tokens emitted = num_accepted + 1


@dataclass
class PreparedBatch:
    """What both backends consume: a validated batch with the target side already evaluated."""

    draft_token_ids: torch.Tensor  # [num_draft_tokens] int64
    cu_num_draft: torch.Tensor  # [num_requests + 1] int64, cu[r] = first draft token of request r
    target: torch.Tensor  # [num_draft_tokens + num_requests, vocab] fp32: p_t rows; raw logits for greedy requests
    is_greedy: torch.Tensor  # [num_requests] bool
    draft_probs: torch.Tensor | None  # [num_draft_tokens, vocab] fp32 dense p_d, rows renormalised; None if unused
    uniforms: torch.Tensor  # [num_draft_tokens] fp32
    exp_noise: torch.Tensor | None  # [num_requests, vocab] fp32; None when `race` holds the noise (or until drawn)
    max_num_draft: int  # max_r l_r, fixes the output width
    race: "RaceSupport | None" = None  # the noise on each request's support only (prepare_batch draws it so)


@dataclass
class RaceSupport:
    """Each request's exponentials on its race support only (noise_support), compactly.

    Row r lists its support's token ids in ascending order, then padding; `noise` holds the
    Exp(1) draws in the same places (1 on padding and in greedy requests' rows, which have no
    support). `dense_noise` is the same noise as a [num_requests, vocab] table with 1 outside
    the support: what draw_exp_noise(support=...) returns, from the same streams.
    """

    ids: torch.Tensor  # [num_requests, max_support] int64, ascending within a row's valid prefix; 0 on padding
    valid: torch.Tensor  # [num_requests, max_support] bool, True on the row's first |support_r| entries
    noise: torch.Tensor  # [num_requests, max_support] fp32

    def dense_noise(self, vocab: int) -> torch.Tensor:  # [num_requests, vocab] fp32
        dense = torch.ones(self.ids.shape[0], vocab, device=self.noise.device)
        rows = torch.arange(self.ids.shape[0], device=self.ids.device).unsqueeze(1).expand_as(self.ids)  # [R, S]
        dense[rows[self.valid], self.ids[self.valid]] = self.noise[self.valid]
        return dense


def support_ids(support: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[num_requests, vocab] bool -> (ids, valid) [num_requests, max_support]: each row's True
    columns in ascending order, then padding (id 0, valid False). One nonzero over the whole
    table: its indices come row-major, which is the order the ids are written in."""
    num_requests, vocab = support.shape
    flat = support.reshape(-1).nonzero().squeeze(1)  # [total] row-major positions of the True entries
    counts = torch.bincount(flat // vocab, minlength=num_requests)  # [R] (not support.sum(1): an int64 copy of the table)
    width = int(counts.max()) if num_requests else 0
    valid = torch.arange(width, device=support.device).unsqueeze(0) < counts.unsqueeze(1)  # [R, S]
    ids = torch.zeros(num_requests, width, dtype=torch.int64, device=support.device)
    ids[valid] = flat % vocab
    return ids, valid


def wide_supports(support: torch.Tensor) -> list[bool]:  # [num_requests, vocab] bool -> [num_requests]
    """The requests whose support is wider than 1/COMPACT_RACE_FRACTION of the vocabulary: they
    draw a whole vocabulary of exponentials (their race runs on whole rows). A function of the
    request's own rows only, so a seeded request draws the same numbers whatever the batch."""
    return (support.sum(1) > support.shape[1] // COMPACT_RACE_FRACTION).tolist()


def draw_race_noise(
    support: torch.Tensor,  # [num_requests, vocab] bool, every row narrow (not wide_supports)
    generators: list[torch.Generator | None],  # [num_requests]
    *,
    greedy: list[bool] | None = None,  # [num_requests] requests that consume no randomness
) -> RaceSupport:
    """draw_exp_noise on narrow supports, kept compact: the same draws from the same streams
    (request r's support in id order, from its own generator or, without one, from the default
    generator in request order)."""
    skip = _draw_plan(support.shape[0], generators, greedy)
    if any(skip):
        support = support & ~torch.tensor(skip, dtype=torch.bool, device=support.device).unsqueeze(1)
    if any(wide_supports(support)):
        raise ValueError("draw_race_noise takes narrow supports only: a wider one draws a whole vocabulary (draw_exp_noise)")
    ids, valid = support_ids(support)
    device = support.device
    noise = torch.ones(ids.shape, device=device)
    for r, (gen, n) in enumerate(zip(generators, valid.sum(1).tolist())):
        if n:
            noise[r, :n] = exponentials(n, gen, device=device)
    return RaceSupport(ids=ids, valid=valid, noise=noise)


# ---------------------------------------------------------------------------------------------
# Random numbers
# ---------------------------------------------------------------------------------------------


def _draw_plan(
    num_requests: int, generators: list[torch.Generator | None], greedy: list[bool] | None
) -> list[bool]:  # [num_requests] requests that draw nothing
    if len(generators) != num_requests:
        raise ValueError(f"need one generator (or None) per request: got {len(generators)} for {num_requests} requests")
    if greedy is not None and len(greedy) != num_requests:
        raise ValueError(f"need one greedy flag per request: got {len(greedy)} for {num_requests} requests")
    return list(greedy) if greedy is not None else [False] * num_requests


def draw_uniforms(
    num_draft_tokens: torch.Tensor,  # [num_requests] int64
    generators: list[torch.Generator | None],  # [num_requests]
    *,
    device: torch.device | str | None = None,
    greedy: list[bool] | None = None,  # [num_requests] requests that consume no randomness
) -> torch.Tensor:  # [num_draft_tokens] fp32 in [0, 1)
    """The acceptance uniforms of one round: l_r from request r's generator (one batched draw
    from the default generator for requests without one); greedy requests draw nothing."""
    if num_draft_tokens.dim() != 1:
        raise ValueError(f"num_draft_tokens must be 1-D [num_requests], got shape {tuple(num_draft_tokens.shape)}")
    device = torch.device(device) if device is not None else num_draft_tokens.device
    lens = num_draft_tokens.tolist()  # host lengths: they size the per-request slices below
    skip = _draw_plan(len(lens), generators, greedy)
    if all(skip):  # plain greedy decoding: nothing drawn, no generator advanced
        return torch.zeros(sum(lens), device=device)
    uniforms = torch.rand(sum(lens), device=device)
    offset = 0
    for r, (n, gen) in enumerate(zip(lens, generators)):
        # Why a per-request loop: each seeded request must consume only its own stream.
        if gen is not None and not skip[r]:
            uniforms[offset : offset + n] = torch.rand(n, generator=gen, device=gen.device).to(device)
        offset += n
    return uniforms


def exponentials(shape: int | tuple[int, ...], generator: torch.Generator | None, *,
                 device: torch.device | str) -> torch.Tensor:  # [*shape] fp32, iid Exp(1)
    """Exp(1) draws by the inverse CDF, E = -log(1 - u) of 53-bit uniforms u in [0, 1) (float64
    until after the log, so small E, the race's decisive ones, keep fp32's relative precision),
    from `generator` or the default one. 2.4x faster than ATen's exponential_ on a CPU (1.1 ms
    a 49,152-token row there, a quarter of a sampled decoding step at one request)."""
    u = torch.rand(shape, dtype=torch.float64, generator=generator,
                   device=generator.device if generator is not None else device)  # [*shape] in [0, 1)
    return u.neg_().log1p_().neg_().to(device=device, dtype=torch.float32)


def draw_exp_noise(
    vocab: int,
    generators: list[torch.Generator | None],  # [num_requests]
    *,
    device: torch.device | str,
    greedy: list[bool] | None = None,  # [num_requests] requests that consume no randomness
    support: torch.Tensor | None = None,  # [num_requests, vocab] bool: where a request's race can be won; None = everywhere
) -> torch.Tensor:  # [num_requests, vocab] fp32
    """The exponentials of one round's categorical draws (the exponential race), per request.

    Without a support every request draws a whole vocabulary in id order, from its own
    generator, after its uniforms; requests without a generator share one batched draw from the
    default generator. With one, request r draws a whole vocabulary if its support is wide
    (wide_supports: temperature alone), else one Exp(1) per support token in id order (top-p,
    top-k), in request order; entries it did not draw hold 1. Either way a seeded request
    reproduces whatever else is in the batch, and greedy requests' rows hold 1 and draw
    nothing. The race never reads an entry off the support: a token there has zero weight in
    every row the request can draw from (docs/method.md §1: residual and bonus rows vanish where
    p_t does). Why a support: a vocabulary of exponentials costs ~0.45 ms a request a round on a
    CPU; with top-p or top-k a row's support is a few dozen tokens.
    """
    device = torch.device(device)
    skip = _draw_plan(len(generators), generators, greedy)
    num_requests = len(generators)
    noise = torch.ones(num_requests, vocab, device=device)
    if all(skip):
        return noise
    if support is not None:
        if tuple(support.shape) != (num_requests, vocab):
            raise ValueError(f"support must be [num_requests, vocab] = {[num_requests, vocab]}, got {list(support.shape)}")
        support = support.to(device)
        for r, (gen, wide) in enumerate(zip(generators, wide_supports(support))):
            if skip[r]:
                continue
            if wide:
                noise[r] = exponentials(vocab, gen, device=device)
            else:
                cols = support[r].nonzero().squeeze(1)  # [|support_r|] ascending ids
                if cols.numel():
                    noise[r, cols] = exponentials(cols.numel(), gen, device=device)
        return noise
    shared = [r for r, gen in enumerate(generators) if gen is None and not skip[r]]
    if shared:
        if len(shared) == num_requests:
            noise = exponentials((num_requests, vocab), None, device=device)
        else:
            noise[shared] = exponentials((len(shared), vocab), None, device=device)
    for r, gen in enumerate(generators):
        if gen is not None and not skip[r]:
            noise[r] = exponentials(vocab, gen, device=device)
    return noise


def draw_rejection_randoms(
    num_draft_tokens: torch.Tensor,  # [num_requests] int64
    vocab: int,
    generators: list[torch.Generator | None],  # [num_requests]
    *,
    device: torch.device | str | None = None,
    greedy: list[bool] | None = None,  # [num_requests] requests that consume no randomness
) -> tuple[torch.Tensor, torch.Tensor]:  # uniforms [num_draft_tokens] fp32, exp_noise [num_requests, vocab] fp32
    """The random numbers one round consumes, each request's from its own generator: its l_r
    uniforms, then a whole vocabulary of exponentials (draw_uniforms, then draw_exp_noise
    without a support). Greedy requests draw nothing. `device` defaults to num_draft_tokens'."""
    device = torch.device(device) if device is not None else num_draft_tokens.device
    uniforms = draw_uniforms(num_draft_tokens, generators, device=device, greedy=greedy)
    return uniforms, draw_exp_noise(vocab, generators, device=device, greedy=greedy)


def noise_support(prep: "PreparedBatch") -> torch.Tensor:  # [num_requests, vocab] bool
    """Where request r's exponential race can be won: the tokens with p_t > 0 in any of its
    target rows (the residual's support lies inside its row's p_t support, and the bonus and the
    fallback draw from p_t itself). Greedy requests race nowhere."""
    num_requests = prep.is_greedy.shape[0]
    lens = prep.cu_num_draft[1:] - prep.cu_num_draft[:-1]  # [num_requests]
    positive = prep.target > 0  # [num_rows, vocab]
    if positive.shape[0] == num_requests:  # plain decoding: one row per request
        support = positive
    else:
        row_request = torch.repeat_interleave(torch.arange(num_requests, device=positive.device), lens + 1,
                                              output_size=positive.shape[0])  # [num_rows]
        support = torch.zeros(num_requests, positive.shape[1], dtype=torch.int32, device=positive.device)
        support = support.index_add_(0, row_request, positive.to(torch.int32)) > 0
    greedy_rows = prep.is_greedy.nonzero().squeeze(1)  # [num_greedy]; rows of raw logits, not p_t
    if greedy_rows.numel():
        support[greedy_rows] = False  # a few rows written, not a pass over the whole table
    return support


# ---------------------------------------------------------------------------------------------
# Validation and preparation (the boundary)
# ---------------------------------------------------------------------------------------------


def _check(cond: bool, message: str) -> None:
    if not cond:
        raise ValueError(message)


def _is_int(t: torch.Tensor) -> bool:
    return not t.is_floating_point() and not t.is_complex() and t.dtype != torch.bool


def _expect(name: str, t: torch.Tensor, dims: str, shape: tuple[int, ...], *, integer: bool) -> None:
    """ValueError unless `t` has `shape` and the right kind of dtype; `dims` names the axes."""
    kind_ok = _is_int(t) if integer else t.is_floating_point()
    if tuple(t.shape) != shape or not kind_ok:
        kind = "integer" if integer else "float"
        raise ValueError(
            f"{name} must be {kind} [{dims}] = {list(shape)}, got {t.dtype} {list(t.shape)}"
        )


def _validate_shapes(batch: RejectionBatch) -> list[int]:
    """Shape, dtype and device checks; returns the host list of l_r."""
    nd, logits, ids = batch.num_draft_tokens, batch.target_logits, batch.draft_token_ids
    _check(
        nd.dim() == 1 and _is_int(nd),
        f"num_draft_tokens must be integer [num_requests], got {nd.dtype} {list(nd.shape)}",
    )
    lens = nd.tolist()  # host sync: the output width and the checks below need the lengths
    num_requests, total = len(lens), sum(lens)
    _check(all(n >= 0 for n in lens), f"num_draft_tokens must be >= 0, got {lens}")
    _check(
        len(batch.params) == num_requests,
        f"need one SamplingParams per request: got {len(batch.params)} for {num_requests} requests",
    )
    _expect("draft_token_ids", ids, "num_draft_tokens", (total,), integer=True)
    _check(
        logits.dim() == 2 and logits.shape[0] == total + num_requests and logits.shape[1] >= 1,
        f"target_logits must be [num_draft_tokens + num_requests, vocab] with {total} + {num_requests} = "
        f"{total + num_requests} rows, got {list(logits.shape)}",
    )
    _check(logits.is_floating_point(), f"target_logits must be float, got {logits.dtype}")
    vocab = logits.shape[1]
    _expect("uniforms", batch.uniforms, "num_draft_tokens", (total,), integer=False)
    tensors = {"draft_token_ids": ids, "uniforms": batch.uniforms}
    if batch.exp_noise is not None:
        _expect("exp_noise", batch.exp_noise, "num_requests, vocab", (num_requests, vocab), integer=False)
        tensors["exp_noise"] = batch.exp_noise
    else:
        gens = batch.noise_generators
        _check(
            gens is not None and len(gens) == num_requests,
            f"exp_noise is None: noise_generators must hold one generator (or None) per request [{num_requests}], "
            f"got {'None' if gens is None else len(gens)}",
        )
    dp = batch.draft_probs
    if dp is not None and dp.is_sparse:
        k = dp.sparse_ids.shape[-1] if dp.sparse_ids.dim() else 0
        _expect("sparse_ids", dp.sparse_ids, "num_draft_tokens, k", (total, k), integer=True)
        _expect("sparse_probs", dp.sparse_probs, "num_draft_tokens, k", (total, k), integer=False)
        tensors |= {"sparse_ids": dp.sparse_ids, "sparse_probs": dp.sparse_probs}
    elif dp is not None:
        _expect("dense draft probs", dp.dense, "num_draft_tokens, vocab", (total, vocab), integer=False)
        tensors["dense draft probs"] = dp.dense
    for name, t in tensors.items():  # num_draft_tokens may stay on the host
        _check(t.device == logits.device, f"{name} is on {t.device}, expected target_logits' device {logits.device}")
    return lens


def _has_nan(t: torch.Tensor) -> torch.Tensor:  # [] bool
    """Whether t holds a NaN: max propagates NaN (and +inf, -inf alone never make one), one read
    pass without the [rows, vocab] bool table isnan().any() writes (~7x faster at 64 x 49,152)."""
    return torch.isnan(t.amax()) if t.numel() else torch.zeros((), dtype=torch.bool, device=t.device)


def _validate_values(batch: RejectionBatch, is_greedy: torch.Tensor, target: torch.Tensor) -> None:
    """Value checks, gathered as flags on the device and read with ONE host sync.

    Messages with details (which values, which sum) are computed only on failure. Rows of greedy
    requests are never read, so they are not checked; `target` is the evaluated target side.
    """
    vocab = batch.vocab_size
    ids, logits, u, e = batch.draft_token_ids, batch.target_logits, batch.uniforms, batch.exp_noise
    checks: list[tuple[torch.Tensor, Callable[[], str]]] = [  # (ok flag [], message), in reporting order
        (
            ((ids >= 0) & (ids < vocab)).all(),
            lambda: f"draft_token_ids must be in [0, {vocab}), got values in [{int(ids.min())}, {int(ids.max())}]",
        ),
        (~_has_nan(logits), lambda: "target_logits contain NaN"),
        (
            ~_has_nan(target) if target is not logits else torch.ones((), dtype=torch.bool, device=logits.device),
            lambda: "target probabilities are NaN: a sampled request has a target logits row with no finite "
            "entry (all -inf or +inf), or a temperature so small that logits / temperature overflow",
        ),
        (
            ((u >= 0) & (u < 1)).all(),
            lambda: f"uniforms must lie in [0, 1), got values in [{float(u.min())}, {float(u.max())}]",
        ),
    ]
    if e is not None:
        checks.append(((e >= 0).all(), lambda: "exp_noise must be >= 0 (Exponential(1) draws), got negative or NaN entries"))
    dp = batch.draft_probs
    if dp is not None and ids.numel() and not bool(is_greedy.all()):  # all greedy: no row is ever read
        token_request = torch.repeat_interleave(
            torch.arange(is_greedy.shape[0], device=ids.device),
            batch.num_draft_tokens.to(ids.device),
            output_size=ids.shape[0],
        )  # [num_draft_tokens]
        skip = is_greedy[token_request]  # [num_draft_tokens]: rows of greedy requests are never read
        if dp.is_sparse:
            sid, rows = dp.sparse_ids, dp.sparse_probs.float()  # [num_draft_tokens, k]
            checks += [
                (
                    ((sid >= -1) & (sid < vocab)).all(),
                    lambda: f"sparse_ids must be in [0, {vocab}) or -1 (padding), "
                    f"got values in [{int(sid.min())}, {int(sid.max())}]",
                ),
                (~((sid < 0) & (rows != 0)).any(), lambda: "sparse padding entries (id -1) must have prob 0"),
            ]
            p_x = torch.where(sid == ids[:, None], rows, 0.0).sum(-1)  # [num_draft_tokens] p_d(x_k)
        else:
            rows = dp.dense.float()  # [num_draft_tokens, vocab]
            p_x = rows.gather(1, ids.long().clamp(0, vocab - 1)[:, None]).squeeze(1)  # clamp: range checked above
        sum_error = torch.where(skip, 0.0, (rows.sum(-1) - 1).abs())  # [num_draft_tokens]
        checks += [
            (((rows >= 0).all(-1) | skip).all(), lambda: "draft probs must be non-negative (and not NaN)"),
            (
                (sum_error <= ROW_SUM_TOL).all(),
                lambda: f"draft prob rows must sum to 1 (tol {ROW_SUM_TOL}), "
                f"got a row off by {float(sum_error.max()):.6f}",
            ),
            (
                ((p_x > 0) | skip).all(),
                lambda: f"a draft token has p_d(x) = 0 under its own row ({int(((p_x <= 0) & ~skip).sum())} such "
                "tokens): the drafter cannot have sampled it",
            ),
        ]
    flags = torch.stack([ok for ok, _ in checks]).tolist()  # the one host sync of the value checks
    for flag, (_, message) in zip(flags, checks):
        if not flag:
            raise ValueError(message())


def normalised_rows(rows: torch.Tensor) -> torch.Tensor:  # [n, vocab] fp32 -> [n, vocab] fp32
    """rows / their sums: the distributions the drafter sampled from (it draws x ~ row / sum(row)).
    A row without mass (a greedy request's, never read) is left as it is."""
    total = rows.sum(-1, keepdim=True)  # [n, 1]
    return rows / torch.where(total > 0, total, 1.0)


def densify_draft_probs(draft: DraftProbs, vocab: int) -> torch.Tensor:  # [num_draft_tokens, vocab] fp32
    """Dense p_d rows; sparse rows are zero outside their ids (padding adds 0 at id 0)."""
    if not draft.is_sparse:
        return draft.dense.float()
    ids = draft.sparse_ids.long().clamp_min(0)
    probs = torch.where(draft.sparse_ids >= 0, draft.sparse_probs.float(), 0.0)
    dense = torch.zeros(ids.shape[0], vocab, dtype=torch.float32, device=ids.device)
    return dense.scatter_add_(1, ids, probs)


def _target_rows(batch: RejectionBatch, lens: list[int]) -> torch.Tensor:
    """p_t for every row of a sampled request, raw fp32 logits for every row of a greedy one.

    logits_to_probs runs once per distinct (temperature, top_k, top_p), not once per request.
    """
    logits = batch.target_logits
    groups: dict[tuple[float, int, float], list[int]] = {}
    for r, p in enumerate(batch.params):
        if not p.is_greedy:
            groups.setdefault((p.temperature, p.top_k, p.top_p), []).append(r)
    if not groups:  # every request greedy: raw logits throughout
        return logits.float()
    if len(groups) == 1 and len(next(iter(groups.values()))) == len(lens):  # one setting for the whole batch
        (temperature, top_k, top_p), = groups
        return logits_to_probs(logits, temperature=temperature, top_k=top_k, top_p=top_p)
    target = logits.float()  # rows of greedy requests stay raw logits
    if target is logits and groups:
        target = target.clone()  # the index_copy_ below must not write into the caller's logits
    row_request = torch.repeat_interleave(
        torch.arange(len(lens)), torch.tensor(lens) + 1, output_size=logits.shape[0]
    )  # [num_rows] host: request of each target row
    for (temperature, top_k, top_p), reqs in groups.items():
        rows = torch.isin(row_request, torch.tensor(reqs)).nonzero().squeeze(1).to(logits.device)  # [n_rows_in_group]
        probs = logits_to_probs(logits.index_select(0, rows), temperature=temperature, top_k=top_k, top_p=top_p)
        target.index_copy_(0, rows, probs)
    return target


def prepare_batch(batch: RejectionBatch) -> PreparedBatch:
    """Validate `batch` (ValueError naming what was got and expected) and evaluate the target side;
    a batch without exp_noise gets it drawn here, on each request's support (noise_support)."""
    _check(isinstance(batch, RejectionBatch), f"expected a RejectionBatch, got {type(batch).__name__}")
    lens = _validate_shapes(batch)
    device = batch.target_logits.device
    sampled_has_drafts = any(n > 0 and not p.is_greedy for n, p in zip(lens, batch.params))
    _check(
        batch.draft_probs is not None or not sampled_has_drafts,
        "draft_probs is None but a request with temperature > 0 has draft tokens; expected the drafter's rows",
    )
    is_greedy = torch.tensor([p.is_greedy for p in batch.params], dtype=torch.bool, device=device)
    target = _target_rows(batch, lens)
    _validate_values(batch, is_greedy, target)
    vocab = batch.vocab_size
    nd = batch.num_draft_tokens.to(device=device, dtype=torch.int64)
    prep = PreparedBatch(
        draft_token_ids=batch.draft_token_ids.to(torch.int64).contiguous(),
        cu_num_draft=torch.nn.functional.pad(torch.cumsum(nd, 0), (1, 0)),
        target=target.contiguous(),
        is_greedy=is_greedy,
        draft_probs=normalised_rows(densify_draft_probs(batch.draft_probs, vocab)).contiguous() if sampled_has_drafts else None,
        uniforms=batch.uniforms.float().contiguous(),
        exp_noise=None if batch.exp_noise is None else batch.exp_noise.float().contiguous(),
        max_num_draft=max(lens, default=0),
    )
    if prep.exp_noise is None:  # drawn now that the target side says where each request's race can be won
        greedy = [p.is_greedy for p in batch.params]
        if all(greedy):  # plain greedy decoding: no race, nothing drawn (the common case at one request)
            empty = torch.zeros(len(greedy), 0, dtype=torch.int64, device=device)
            return replace(prep, race=RaceSupport(ids=empty, valid=empty.bool(), noise=empty.float()))
        support = noise_support(prep)  # [num_requests, vocab]
        if any(wide_supports(support)):  # temperature alone somewhere: race on whole rows
            prep = replace(prep, exp_noise=draw_exp_noise(vocab, batch.noise_generators, device=device, greedy=greedy,
                                                          support=support))
        else:  # top-p / top-k everywhere: race on the gathered support columns
            prep = replace(prep, race=draw_race_noise(support, batch.noise_generators, greedy=greedy))
    return prep


def dense_exp_noise(prep: PreparedBatch) -> torch.Tensor:  # [num_requests, vocab] fp32
    """The round's exponentials as a whole table (the reference and the Triton kernel read it)."""
    if prep.exp_noise is not None:
        return prep.exp_noise
    assert prep.race is not None, "prepare_batch leaves either exp_noise or race set"
    return prep.race.dense_noise(prep.target.shape[1])


# ---------------------------------------------------------------------------------------------
# The reference
# ---------------------------------------------------------------------------------------------


def exponential_race(
    weights: torch.Tensor,  # [vocab] fp32, unnormalised, >= 0
    fallback: torch.Tensor,  # [vocab] fp32, used if weights are all zero
    exp_noise: torch.Tensor,  # [vocab] fp32, iid Exp(1)
) -> int:
    """One categorical draw from weights / sum(weights): argmax_v w(v) / E(v), ties to the lowest id.

    Zero-weight tokens score -1 so they never win, even if every positive score underflows.
    An all-zero residual can only come from rounding (p_t == p_d up to fp32); then draw from p_t.
    """
    if not bool((weights > 0).any()):
        weights = fallback
    scores = torch.where(weights > 0, weights / exp_noise, -1.0)
    return int(torch.argmax(scores))


def rejection_sample_reference(prep: PreparedBatch) -> RejectionResult:
    """Plain per-request loop over a prepared batch: the definition the kernel must match exactly.

    Invariant of the loop over k: x_1..x_k have been accepted and written to the output; the
    request emits exactly one more token (a residual draw at the first rejection, or the bonus).
    """
    num_requests = prep.is_greedy.shape[0]
    device = prep.target.device
    out = torch.full((num_requests, prep.max_num_draft + 1), -1, dtype=torch.int64, device=device)
    num_accepted = torch.zeros(num_requests, dtype=torch.int64, device=device)
    cu = prep.cu_num_draft.tolist()
    exp_noise = dense_exp_noise(prep)  # [num_requests, vocab]
    for r in range(num_requests):
        start, n = cu[r], cu[r + 1] - cu[r]
        row0 = start + r  # target row of the anchor's query position
        if bool(prep.is_greedy[r]):
            for k in range(n + 1):
                best = int(torch.argmax(prep.target[row0 + k]))
                out[r, k] = best  # an accepted draft equals the argmax; otherwise this is the correction/bonus
                if k == n or int(prep.draft_token_ids[start + k]) != best:
                    num_accepted[r] = k
                    break
            continue
        k = 0
        while k < n:
            x = int(prep.draft_token_ids[start + k])
            p_t, p_d = prep.target[row0 + k, x], prep.draft_probs[start + k, x]
            if not bool(prep.uniforms[start + k] * p_d < p_t):  # u < p_t / p_d without dividing
                break
            out[r, k] = x
            k += 1
        num_accepted[r] = k
        p_t_row = prep.target[row0 + k]
        weights = (p_t_row - prep.draft_probs[start + k]).clamp_min(0.0) if k < n else p_t_row
        out[r, k] = exponential_race(weights, p_t_row, exp_noise[r])
    return RejectionResult(output_token_ids=out, num_accepted=num_accepted)


def _row_argmax(target: torch.Tensor) -> torch.Tensor:  # [num_rows, vocab] -> [num_rows] int64
    """target.argmax(-1), the same indices; on the CPU by the vectorised kernel beside the other
    per-row C++ kernels (ATen's argmax costs ~50 µs a 49,152-entry row, most of a greedy
    round's sampling at one request and ~3 ms a step at 64)."""
    return row_argmax(target)


def _race_winners(
    prep: PreparedBatch,
    sampled: torch.Tensor,  # [num_sampled] the sampled requests
    rows: torch.Tensor,  # [num_sampled] the target row each one draws at
    d_index: torch.Tensor,  # [num_sampled] its draft row there (read only where rejected)
    rejected: torch.Tensor,  # [num_sampled] bool: a residual race, else one on p_t (the bonus)
) -> torch.Tensor:  # [num_sampled] int64 token ids
    """The one drawn token per sampled request: the race argmax_v w(v) / E(v) with w the
    residual max(0, p_t - p_d) (p_t where it has no mass) or p_t. Its columns: each request's
    support (ascending ids, so argmax's lowest-position ties are the lowest ids), or whole rows.
    Off the support every weight is 0 in the reference too (noise_support): it scores -1 there
    and never wins."""
    target = prep.target  # [num_rows, vocab]
    race = prep.race
    if race is None:  # whole rows: one fused pass a race where the kernel is built
        d_rows = None if prep.draft_probs is None else torch.where(rejected, d_index, -1)  # [num_sampled]
        winner = race_argmax(target, rows, prep.draft_probs, d_rows, prep.exp_noise, sampled)
        if winner is not None:
            return winner
        cols = on_support = None
        p_row = target[rows]  # [num_sampled, vocab]
        noise = prep.exp_noise[sampled]  # [num_sampled, vocab]
        d_row = None if prep.draft_probs is None else prep.draft_probs[d_index]
    else:
        cols = race.ids[sampled]  # [num_sampled, S]
        on_support = race.valid[sampled]  # [num_sampled, S]
        noise = race.noise[sampled]  # [num_sampled, S]
        p_row = target[rows.unsqueeze(1), cols]  # [num_sampled, S]
        d_row = None if prep.draft_probs is None else prep.draft_probs[d_index.unsqueeze(1), cols]
    weights = p_row
    if d_row is not None:
        weights = torch.where(rejected[:, None], (p_row - d_row).clamp_min(0.0), p_row)  # [num_sampled, S or vocab]
    positive = weights > 0 if on_support is None else (weights > 0) & on_support
    empty = ~positive.any(-1, keepdim=True)  # [num_sampled, 1] an all-zero residual: draw from p_t
    if bool(empty.any()):
        weights = torch.where(empty, p_row, weights)
        positive = weights > 0 if on_support is None else (weights > 0) & on_support
    scores = (weights / noise).masked_fill_(~positive, -1.0)  # the reference's where(w > 0, w / E, -1)
    winner = scores.argmax(-1)  # [num_sampled]
    return winner if cols is None else cols.gather(1, winner.unsqueeze(1)).squeeze(1)


def rejection_sample_batched(prep: PreparedBatch) -> RejectionResult:
    """The reference's decisions for the whole batch at once, in tensor ops (the torch backend).

    Same fp32 expressions on the same numbers, element by element: the acceptance test
    u_k * p_d(x_k) < p_t(x_k) (greedy: x_k == argmax), the residual max(0, p_t - p_d) and its
    fallback to p_t, the race scores w / E with -1 where w = 0, and argmax's lowest-id ties. So
    it returns exactly the reference's tokens (tests/sampling/test_rejection_sampler.py checks
    this on random batches); it only drops the per-request Python loop, which cost ~0.3 ms a
    request a round (20 ms a step at 64 requests).
    """
    target = prep.target  # [num_rows, vocab]
    device = target.device
    num_requests = prep.is_greedy.shape[0]
    num_drafts = prep.draft_token_ids.shape[0]
    if num_drafts == 0 and bool(prep.is_greedy.all()):  # plain greedy decoding: each row's argmax
        # (what the general path below computes for it, in one op instead of ~20 small ones)
        return RejectionResult(output_token_ids=_row_argmax(target).unsqueeze(1),
                               num_accepted=torch.zeros(num_requests, dtype=torch.int64, device=device))
    if num_drafts == 0 and prep.race is None and not bool(prep.is_greedy.any()):  # plain sampled decoding, whole rows
        every = torch.arange(num_requests, device=device)  # [num_requests] row r is request r's p_t and noise
        winner = race_argmax(target, every, None, None, prep.exp_noise, every)  # the bonus race of every request
        if winner is not None:
            return RejectionResult(output_token_ids=winner.unsqueeze(1),
                                   num_accepted=torch.zeros(num_requests, dtype=torch.int64, device=device))
    lens = prep.cu_num_draft[1:] - prep.cu_num_draft[:-1]  # [num_requests]
    first_draft = prep.cu_num_draft[:-1]  # [num_requests]
    anchor_row = first_draft + torch.arange(num_requests, device=device)  # [num_requests] target row of x_0's position
    best = _row_argmax(target) if bool(prep.is_greedy.any()) else None  # [num_rows]; read for greedy requests only

    # Acceptance of every draft token, then the leading run per request.
    token_request = torch.repeat_interleave(torch.arange(num_requests, device=device), lens, output_size=num_drafts)  # [num_drafts]
    k = torch.arange(num_drafts, device=device) - first_draft[token_request]  # [num_drafts] position within its request
    x = prep.draft_token_ids  # [num_drafts]
    rows = anchor_row[token_request] + k  # [num_drafts] target row each draft is checked against
    greedy_token = prep.is_greedy[token_request]  # [num_drafts]
    accept = torch.zeros(num_drafts, dtype=torch.bool, device=device)
    if best is not None:
        accept = torch.where(greedy_token, x == best[rows], accept)
    if prep.draft_probs is not None and num_drafts:
        p_t = target[rows, x]  # [num_drafts]
        p_d = prep.draft_probs[torch.arange(num_drafts, device=device), x]  # [num_drafts]
        accept = torch.where(greedy_token, accept, prep.uniforms * p_d < p_t)
    first_reject = torch.where(accept, lens[token_request], k)  # [num_drafts]
    num_accepted = lens.clone().scatter_reduce_(0, token_request, first_reject, reduce="amin")  # [num_requests]

    # The one drawn token per request: at the first rejection (residual) or after the last draft (bonus).
    final_row = anchor_row + num_accepted  # [num_requests]
    final = torch.zeros(num_requests, dtype=torch.int64, device=device)
    if best is not None:
        final = torch.where(prep.is_greedy, best[final_row], final)
    sampled = (~prep.is_greedy).nonzero().squeeze(1)  # [num_sampled]
    if sampled.numel():
        d_index = (first_draft[sampled] + num_accepted[sampled]).clamp_max(max(num_drafts - 1, 0))  # [num_sampled]
        rejected = num_accepted[sampled] < lens[sampled]  # [num_sampled] a residual race, else the bonus
        final[sampled] = _race_winners(prep, sampled, final_row[sampled], d_index, rejected)
    out = torch.full((num_requests, prep.max_num_draft + 1), -1, dtype=torch.int64, device=device)
    kept = k < num_accepted[token_request]  # [num_drafts]
    out[token_request[kept], k[kept]] = x[kept]
    out[torch.arange(num_requests, device=device), num_accepted] = final
    return RejectionResult(output_token_ids=out, num_accepted=num_accepted)


# ---------------------------------------------------------------------------------------------
# Entry point
# ---------------------------------------------------------------------------------------------


def rejection_sample(batch: RejectionBatch, *, backend: str = "torch") -> RejectionResult:
    """Verify a round's draft tokens; exact for every request (see the module docstring).

    backend="torch" runs the batched torch path (equal to the plain reference); backend="triton"
    the fused kernel (one program per request; CPU tensors need TRITON_INTERPRET=1 set before
    triton is first imported).
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    prep = prepare_batch(batch)
    if backend == "torch":
        return rejection_sample_batched(prep)
    # Imported here so that the torch path (and `import dspark.sampling`) never imports triton.
    from dspark.sampling.rejection_kernel import rejection_sample_triton

    out, num_accepted = rejection_sample_triton(
        draft_token_ids=prep.draft_token_ids,
        cu_num_draft=prep.cu_num_draft,
        target=prep.target,
        is_greedy=prep.is_greedy,
        draft_probs=prep.draft_probs,
        uniforms=prep.uniforms,
        exp_noise=dense_exp_noise(prep),
        max_num_draft=prep.max_num_draft,
    )
    return RejectionResult(output_token_ids=out, num_accepted=num_accepted)
