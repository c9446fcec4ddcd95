"""DSpark's sequential stage: the Markov / RNN logit-bias heads, the confidence head, and the
left-to-right sampler that turns backbone logits into draft tokens with exact rows.

Position k's draft distribution (docs/method.md §2):
    p_k(v | x_0, x_<k) = softmax_v( U_k(v) + B_k(x_0, x_<k, v) )
where U_k are the parallel backbone's logits and B_k the head's bias given the previous token.
- Markov head (default):  B(x_{k-1}, ·) = W1[x_{k-1}] W2,  W1 ∈ R^{V×r}, W2 ∈ R^{r×N}.
- RNN head (Eq. 6):       z_k = [s_{k-1}; W1[x_{k-1}]; h_k],  [g̃; c̃; õ] = W z_k + b,
                          g = σ(g̃),  s_k = g ⊙ s_{k-1} + (1-g) ⊙ tanh(c̃),  B_k = W2ᵀ tanh(õ),  s_0 = 0.
- Gated Markov head:      B(x_{k-1}, h_k, ·) = (σ(W_g [h_k ; W1[x_{k-1}]] + b_g) ⊙ W1[x_{k-1}]) W2
                          (DeepSpec's "gated" head: the bigram bias scaled per rank by the backbone state).
- Confidence head:        c_k = σ(wᵀ [h_k ; W1[x_{k-1}]] + b), the probability that x_k survives
                          verification given x_1..x_{k-1} were accepted (or σ(wᵀ h_k + b) with
                          `reads_prev` False, as a DeepSpec checkpoint may have it).
W1 is ONE table per drafter, read by the sequential head and the confidence head alike; it is
indexed by TARGET token ids (x_0 may be any token). U_k, B_k and p_k live on the drafter's output
vocabulary of N tokens: the whole target vocabulary (N = V), or a draft vocabulary whose index i
stands for target token draft_to_target[i] (FR-Spec); p_k is zero on the other V - N tokens.
W2 starts at zero, so an untrained head leaves the backbone's distribution unchanged.

Two modes: teacher-forced (training; x_{k-1} are the ground-truth tokens, x_0 the anchor) and
`sample_sequential` (serving; x_{k-1} are the tokens just sampled). Both go through the same
`step` of each head; the Markov head's vectorised teacher-forced path is tested against it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from dspark.drafters.base import DraftProposal
from dspark.sampling.categorical import sample_categorical
from dspark.sampling.params import logits_to_probs

HeadState = torch.Tensor | None  # RNN: [n, r]; Markov: None (memoryless)


class MarkovHead(nn.Module):
    """Low-rank learned bigram bias B(x_{k-1}, ·) = W1[x_{k-1}] W2 (memoryless)."""

    def __init__(self, *, vocab_size: int, rank: int, output_size: int | None = None):
        super().__init__()
        self.w1 = nn.Embedding(vocab_size, rank)  # [V, r], shared with the confidence head
        self.w2 = nn.Parameter(torch.zeros(rank, output_size or vocab_size))  # [r, N], zero: B = 0 at init
        self.__dict__["w2_gemm"] = None  # serving: x -> x W2 prepacked, row-invariant (dspark/drafters/serving_gemms.py)

    def project(self, x: torch.Tensor) -> torch.Tensor:
        # x: [n, r] -> [n, N] = x W2
        gemm = self.__dict__["w2_gemm"]
        return x @ self.w2 if gemm is None else gemm(x.float())

    def init_state(self, num_rows: int, *, like: torch.Tensor) -> HeadState:
        return None

    def step(
        self,
        prev_emb: torch.Tensor,  # [n, r] W1[x_{k-1}]
        hidden: torch.Tensor,  # [n, hidden] h_k (unused: the Markov bias sees only x_{k-1})
        state: HeadState,
    ) -> tuple[torch.Tensor, HeadState]:  # bias [n, N], state
        return self.project(prev_emb), state

    def teacher_forced(
        self,
        prev_emb: torch.Tensor,  # [n, γ, r] W1[x_{k-1}] for k = 1..γ (x_0 = anchor)
        hidden: torch.Tensor,  # [n, γ, hidden]
    ) -> torch.Tensor:  # [n, γ, N]
        # memoryless: every position at once (equal to looping `step`, tested)
        return prev_emb @ self.w2


class RNNHead(nn.Module):
    """Gated recurrent bias over the block (docs/method.md §2, RNN head); s_0 = 0.

    `joint` is the one linear layer split three ways: output rows [0, r) are W_g, [r, 2r) W_c,
    [2r, 3r) W_o, acting on z = [s_{k-1}; W1[x_{k-1}]; h_k] (in that order)."""

    def __init__(self, *, vocab_size: int, rank: int, hidden_size: int, output_size: int | None = None):
        super().__init__()
        self.rank = rank
        self.w1 = nn.Embedding(vocab_size, rank)  # [V, r]
        self.w2 = nn.Parameter(torch.zeros(rank, output_size or vocab_size))  # [r, N]
        self.joint = nn.Linear(2 * rank + hidden_size, 3 * rank)  # [3r, 2r + hidden] (+ bias [3r])
        self.__dict__["w2_gemm"] = None  # serving: x -> x W2 prepacked, row-invariant (dspark/drafters/serving_gemms.py)

    def project(self, x: torch.Tensor) -> torch.Tensor:
        # x: [n, r] -> [n, N] = x W2
        gemm = self.__dict__["w2_gemm"]
        return x @ self.w2 if gemm is None else gemm(x.float())

    def init_state(self, num_rows: int, *, like: torch.Tensor) -> HeadState:
        return like.new_zeros(num_rows, self.rank)  # [n, r] s_0 = 0

    def step(
        self,
        prev_emb: torch.Tensor,  # [n, r]
        hidden: torch.Tensor,  # [n, hidden]
        state: HeadState,  # [n, r] s_{k-1}
    ) -> tuple[torch.Tensor, torch.Tensor]:  # bias [n, N], s_k [n, r]
        z = torch.cat([state, prev_emb, hidden], dim=-1)  # [n, 2r + hidden]
        g_raw, c_raw, o_raw = self.joint(z).chunk(3, dim=-1)  # [n, r] each
        g = torch.sigmoid(g_raw)
        new_state = g * state + (1.0 - g) * torch.tanh(c_raw)  # Eq. 6 state update
        return self.project(torch.tanh(o_raw)), new_state  # B_k = W2ᵀ tanh(W_o z)

    def teacher_forced(
        self,
        prev_emb: torch.Tensor,  # [n, γ, r]
        hidden: torch.Tensor,  # [n, γ, hidden]
    ) -> torch.Tensor:  # [n, γ, N]
        # A loop over γ positions (≤ 15): the recurrence is inherently sequential.
        state = self.init_state(prev_emb.shape[0], like=prev_emb)
        biases = []
        for k in range(prev_emb.shape[1]):
            bias, state = self.step(prev_emb[:, k], hidden[:, k], state)
            biases.append(bias)
        return torch.stack(biases, dim=1)


class GatedMarkovHead(MarkovHead):
    """The Markov bias with a per-rank gate from the backbone state (memoryless, like MarkovHead,
    whose W1, W2, `project` and `init_state` it keeps):
    B = (σ(W_g [h_k ; W1[x_{k-1}]] + b_g) ⊙ W1[x_{k-1}]) W2. DeepSpec's "gated" head type."""

    def __init__(self, *, vocab_size: int, rank: int, hidden_size: int, output_size: int | None = None):
        super().__init__(vocab_size=vocab_size, rank=rank, output_size=output_size)
        self.gate = nn.Linear(hidden_size + rank, rank)  # [r, hidden + r] (+ bias [r]), input [h_k ; W1[x_{k-1}]]

    def gated(self, prev_emb: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        # prev_emb: [..., r], hidden: [..., hidden] -> σ(W_g [h ; e] + b_g) ⊙ e [..., r]
        return torch.sigmoid(self.gate(torch.cat([hidden, prev_emb], dim=-1))) * prev_emb

    def step(self, prev_emb: torch.Tensor, hidden: torch.Tensor, state: HeadState) -> tuple[torch.Tensor, HeadState]:
        # prev_emb: [n, r], hidden: [n, hidden] -> bias [n, N], state (None)
        return self.project(self.gated(prev_emb, hidden)), state

    def teacher_forced(self, prev_emb: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        # prev_emb: [n, γ, r], hidden: [n, γ, hidden] -> [n, γ, N]; memoryless: every position at once
        return self.gated(prev_emb, hidden) @ self.w2


SequentialHead = MarkovHead | RNNHead | GatedMarkovHead


def make_sequential_head(*, head_type: str, vocab_size: int, rank: int, hidden_size: int,
                         output_size: int | None = None) -> SequentialHead:
    # vocab_size: V (rows of W1, indexed by target ids); output_size: N (columns of W2), default V
    if head_type == "markov":
        return MarkovHead(vocab_size=vocab_size, rank=rank, output_size=output_size)
    if head_type == "rnn":
        return RNNHead(vocab_size=vocab_size, rank=rank, hidden_size=hidden_size, output_size=output_size)
    if head_type == "gated":
        return GatedMarkovHead(vocab_size=vocab_size, rank=rank, hidden_size=hidden_size, output_size=output_size)
    raise ValueError(f"head_type must be 'markov', 'rnn' or 'gated', got {head_type!r}")


class ConfidenceHead(nn.Module):
    """Raw confidence logit wᵀ[h_k ; W1[x_{k-1}]] + b; c_k = σ(logit) (before STS calibration).
    reads_prev False: wᵀ h_k + b (a DeepSpec checkpoint trained with confidence_head_with_markov off)."""

    def __init__(self, *, hidden_size: int, rank: int, reads_prev: bool = True):
        super().__init__()
        self.reads_prev = reads_prev
        self.proj = nn.Linear(hidden_size + (rank if reads_prev else 0), 1)  # w: [1, hidden + r] (or [1, hidden]), b: [1]

    def forward(
        self,
        hidden: torch.Tensor,  # [..., hidden] h_k
        prev_emb: torch.Tensor,  # [..., r] W1[x_{k-1}]
    ) -> torch.Tensor:  # [...] logit of c_k
        # a product and a sum over the last dim, not a [rows, hidden + r] x [hidden + r, 1] GEMM:
        # each row's logit is then the same bits however many rows are computed at once (serving
        # computes a batch's positions together; a seeded request must not see its neighbours)
        z = torch.cat([hidden, prev_emb], dim=-1) if self.reads_prev else hidden  # [..., hidden + r] (or [..., hidden])
        return (z * self.proj.weight[0]).sum(dim=-1) + self.proj.bias[0]


# ---- serving: left-to-right sampling ----------------------------------------------------------


@dataclass
class DraftSample:
    """γ draft tokens per row and the exact rows they were sampled from.

    Exactly one of `dense_probs` / (`sparse_ids`, `sparse_probs`) is set: dense when the row is
    the full softmax (temperature > 0, no truncation), sparse for top-k / top-p truncation
    (renormalised; ids of zero-probability tokens omitted, padding id -1 with prob 0) and for
    temperature 0 (a point mass on the argmax: ids [[x_k]], probs [[1.0]])."""

    tokens: torch.Tensor  # [n, γ] int64
    confidence_logits: torch.Tensor  # [n, γ] fp32 raw logits of c_k (calibrate with STS)
    dense_probs: torch.Tensor | None = None  # [n, γ, V] fp32
    sparse_ids: torch.Tensor | None = None  # [n, γ, width] int64, -1 = padding
    sparse_probs: torch.Tensor | None = None  # [n, γ, width] fp32

    def to(self, device: torch.device | str) -> "DraftSample":
        """The same sample on `device` (serving on a GPU hands the engine host tensors: one copy a round)."""
        move = lambda t: None if t is None else t.to(device)  # noqa: E731
        return DraftSample(tokens=move(self.tokens), confidence_logits=move(self.confidence_logits), dense_probs=move(self.dense_probs),
                           sparse_ids=move(self.sparse_ids), sparse_probs=move(self.sparse_probs))

    def proposal(self, row: int, *, num_tokens: int | None = None, confidences: torch.Tensor | None = None) -> DraftProposal:
        """Row `row` (its first `num_tokens` drafts) in the engine's contract, dense or sparse as
        sampled. confidences: [γ] (calibrated), optional."""
        k = self.tokens.shape[1] if num_tokens is None else num_tokens
        conf = None if confidences is None else confidences[:k]
        if self.dense_probs is not None:
            return DraftProposal(token_ids=self.tokens[row, :k], dense_probs=self.dense_probs[row, :k], confidences=conf)
        return DraftProposal(
            token_ids=self.tokens[row, :k], prob_ids=self.sparse_ids[row, :k], probs=self.sparse_probs[row, :k], confidences=conf
        )


def _sparsify(probs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    # probs: [n, γ, V] with zeros outside the kept set -> ids, probs [n, γ, width]
    width = max(int((probs > 0).sum(-1).max()), 1)
    values, ids = torch.topk(probs, width, dim=-1)  # descending: kept tokens first
    return torch.where(values > 0, ids, torch.full_like(ids, -1)), values


@torch.no_grad()
def sample_sequential(
    *,
    base_logits: torch.Tensor,  # [n, γ, N] U_1..U_γ from the backbone, over the drafter's output vocabulary
    hidden: torch.Tensor,  # [n, γ, hidden] h_1..h_γ
    anchor_tokens: torch.Tensor,  # [n] int64 x_0 (a target id)
    head: SequentialHead,
    confidence_head: ConfidenceHead,
    temperature: float,
    top_k: int = 0,
    top_p: float = 1.0,
    generator: torch.Generator | list[torch.Generator | None] | None = None,
    draft_to_target: torch.Tensor | None = None,  # [N] int64 target id of each draft index; None: N = V, the identity
    num_tokens: list[int] | None = None,  # [n] drafts each row needs (<= γ); None: γ for every row
) -> DraftSample:
    """Sample x_1..x_γ left to right from p_k = softmax((U_k + B_k)/T), truncated by top-k/top-p
    and renormalised exactly as the target side does (`logits_to_probs`).

    Invariant: the row returned for (i, k) is, bit for bit, the distribution x[i, k] was drawn
    from, and B_k was computed from the x[i, k-1] actually sampled; the verifier's losslessness
    rests on this. Temperature 0 takes the argmax (ties: lowest draft index) as a point mass.
    With a draft vocabulary the rows come back sparse over target ids (draft_to_target of every
    draft index; zero on the other V - N tokens), and the tokens are target ids.

    Batches of requests (serving): `generator` may be a list, one per row, and `num_tokens` says
    how far each row drafts; row i then draws exactly num_tokens[i] uniforms of its own generator
    and its outputs past num_tokens[i] are meaningless. With row-invariant GEMMs (the serving
    drafters' packed ones) a row gets the same tokens, rows and generator state as alone."""
    n, gamma, vocab = base_logits.shape
    if hidden.shape[:2] != (n, gamma) or anchor_tokens.shape != (n,):
        raise ValueError(
            f"expected hidden [{n}, {gamma}, hidden] and anchor_tokens [{n}], "
            f"got {tuple(hidden.shape)} and {tuple(anchor_tokens.shape)}"
        )
    if draft_to_target is not None and tuple(draft_to_target.shape) != (vocab,):
        raise ValueError(f"draft_to_target must be [{vocab}] (one target id per draft index), got {tuple(draft_to_target.shape)}")
    if not temperature >= 0.0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if num_tokens is not None and (len(num_tokens) != n or min(num_tokens, default=0) < 0 or max(num_tokens, default=0) > gamma):
        raise ValueError(f"num_tokens must give each of the {n} rows a count in [0, {gamma}], got {num_tokens}")
    greedy = temperature == 0.0
    truncated = not greedy and ((0 < top_k < vocab) or top_p < 1.0)
    to_target = (lambda i: i) if draft_to_target is None else (lambda i: draft_to_target[i])  # noqa: E731

    tokens = torch.empty(n, gamma, dtype=torch.long, device=base_logits.device)  # target ids
    rows = None if greedy else torch.empty(n, gamma, vocab, dtype=torch.float32, device=base_logits.device)  # over draft indices
    prev = anchor_tokens.long()  # [n] x_{k-1}, target ids
    prev_embs = []  # [n, r] per position: W1[x_{k-1}], read again by the confidence head
    state = head.init_state(n, like=hidden)
    # A Python loop over γ positions: x_k's distribution depends on the sampled x_{k-1}, which is
    # the point of the sequential stage (the backbone's γ positions ran in parallel before it).
    for k in range(gamma):
        prev_emb = head.w1(prev)  # [n, r]
        prev_embs.append(prev_emb)
        bias, state = head.step(prev_emb, hidden[:, k], state)  # [n, N]
        logits = base_logits[:, k].float() + bias.float()  # [n, N] U_k + B_k
        if greedy:
            index = logits.argmax(dim=-1)
        else:
            probs = logits_to_probs(logits, temperature=temperature, top_k=top_k, top_p=top_p)  # [n, N]
            index = _draw(probs, generator, None if num_tokens is None else [k < m for m in num_tokens])  # [n]
            rows[:, k] = probs
        prev = to_target(index)
        tokens[:, k] = prev
    # c_k reads h_k and W1[x_{k-1}], both known now: every position at once
    conf_logits = confidence_head(hidden, torch.stack(prev_embs, dim=1)).float()  # [n, γ]
    if greedy:
        ones = torch.ones(n, gamma, 1, dtype=torch.float32, device=tokens.device)
        return DraftSample(tokens=tokens, confidence_logits=conf_logits, sparse_ids=tokens.unsqueeze(-1), sparse_probs=ones)
    if truncated:
        ids, probs = _sparsify(rows)  # draft indices, -1 = padding
        if draft_to_target is not None:
            ids = torch.where(ids >= 0, draft_to_target[ids.clamp(min=0)], ids)
        return DraftSample(tokens=tokens, confidence_logits=conf_logits, sparse_ids=ids, sparse_probs=probs)
    if draft_to_target is not None:  # the whole draft vocabulary, sparse over its target ids
        ids = draft_to_target.expand(n, gamma, vocab)
        return DraftSample(tokens=tokens, confidence_logits=conf_logits, sparse_ids=ids, sparse_probs=rows)
    return DraftSample(tokens=tokens, confidence_logits=conf_logits, dense_probs=rows)


def _draw(probs: torch.Tensor, generator, live: list[bool] | None) -> torch.Tensor:
    """One draft index per row of probs [n, N]; rows not `live` (past their own draft count) draw
    nothing and get a placeholder (their argmax), so their generators are left untouched."""
    if live is None or all(live):
        return sample_categorical(probs, generator)
    index = probs.argmax(dim=-1)  # [n]
    rows = [i for i, x in enumerate(live) if x]
    if rows:
        gens = [generator[i] for i in rows] if isinstance(generator, list) else generator
        index[rows] = sample_categorical(probs[rows], gens)
    return index


def teacher_forced_logits(
    *,
    base_logits: torch.Tensor,  # [n, γ, N] U_k
    hidden: torch.Tensor,  # [n, γ, hidden] h_k
    prev_tokens: torch.Tensor,  # [n, γ] int64 x_0, x*_1, ..., x*_{γ-1} (target ids)
    head: SequentialHead,
    confidence_head: ConfidenceHead,
) -> tuple[torch.Tensor, torch.Tensor]:  # draft logits [n, γ, N] (U + B), confidence logits [n, γ]
    """Training mode: B_k and c_k conditioned on the ground-truth previous tokens."""
    prev_emb = head.w1(prev_tokens)  # [n, γ, r]
    logits = base_logits + head.teacher_forced(prev_emb, hidden)
    return logits, confidence_head(hidden, prev_emb)


__all__ = [
    "ConfidenceHead", "DraftSample", "GatedMarkovHead", "MarkovHead", "RNNHead", "SequentialHead",
    "make_sequential_head", "sample_sequential", "teacher_forced_logits",
]
