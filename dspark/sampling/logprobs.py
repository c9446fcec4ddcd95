"""Log-probabilities of emitted tokens: what the API's `logprobs` / `top_logprobs` report.

The distribution: the target model's own next-token distribution at the position a token was
emitted, `log_softmax` of the target's logits in fp32, BEFORE temperature, top-k and top-p (what
vLLM returns by default; OpenAI's numbers do not move with temperature either). A greedy and a
sampled request get the same numbers for the same tokens, and so do plain and speculative
decoding: the rows are the very logits rows the verifier's forward produced for the emitted
positions (the rejection sampler's target rows), and the forward is batch-invariant
(dspark/model/fused_ops.py), so a row's bits do not depend on how many drafts rode with it.

Alternatives: the k most likely tokens of that distribution, most likely first, ties to the
lowest token id (greedy's tie rule). `top_k_logprobs` finds them with one `topk` and orders the
few ties exactly; `top_k_logprobs_reference` (a stable sort of the whole row) defines it.

Cost: only the rows of requests that ask are read; a round where none asks computes nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["MAX_LOGPROBS", "RoundLogprobs", "TokenLogprobs", "round_logprobs", "top_k_logprobs", "top_k_logprobs_reference"]

MAX_LOGPROBS = 20  # alternatives per token the engine computes at most (OpenAI's chat top_logprobs limit)
NOT_ASKED = -1  # num_logprobs of a request that wants no log-probabilities


@dataclass
class RoundLogprobs:
    """A round's log-probabilities, laid out like RejectionResult.output_token_ids (request r's
    emitted tokens in row r, then padding). Entries of requests that did not ask are padding."""

    token_logprobs: torch.Tensor  # [num_requests, max_l + 1] fp32 log p(emitted token); NaN = padding
    top_token_ids: torch.Tensor  # [num_requests, max_l + 1, k] int64, most likely first; -1 = padding
    top_logprobs: torch.Tensor  # [num_requests, max_l + 1, k] fp32; NaN = padding

    def for_request(self, r: int, num_tokens: int, k: int) -> TokenLogprobs:
        """Request r's first `num_tokens` entries with its own `k` alternatives (host lists)."""
        return TokenLogprobs(
            logprobs=self.token_logprobs[r, :num_tokens].tolist(),
            top_ids=self.top_token_ids[r, :num_tokens, :k].tolist(),
            top_logprobs=self.top_logprobs[r, :num_tokens, :k].tolist(),
        )


@dataclass(frozen=True)
class TokenLogprobs:
    """Log-probabilities of a run of one request's emitted tokens, on the host (what an output
    event carries next to its token ids, entry i for token i)."""

    logprobs: list[float]  # [num_tokens]
    top_ids: list[list[int]]  # [num_tokens, k]
    top_logprobs: list[list[float]]  # [num_tokens, k]

    def __post_init__(self) -> None:
        if not (len(self.logprobs) == len(self.top_ids) == len(self.top_logprobs)):
            raise ValueError(f"one entry per token: got {len(self.logprobs)} logprobs, {len(self.top_ids)} top_ids "
                             f"and {len(self.top_logprobs)} top_logprobs")
        if any(len(ids) != len(lps) for ids, lps in zip(self.top_ids, self.top_logprobs)):
            raise ValueError("top_ids and top_logprobs must have the same number of alternatives per token")

    def __len__(self) -> int:
        return len(self.logprobs)

    def head(self, n: int) -> TokenLogprobs:
        """The first n tokens' entries."""
        return TokenLogprobs(self.logprobs[:n], self.top_ids[:n], self.top_logprobs[:n])

    @staticmethod
    def empty() -> TokenLogprobs:
        return TokenLogprobs([], [], [])


def top_k_logprobs_reference(
    logprobs: torch.Tensor,  # [n, vocab] fp32
    k: int,
) -> tuple[torch.Tensor, torch.Tensor]:  # ids [n, k] int64, logprobs [n, k] fp32
    """The definition: a stable descending sort of each whole row (ties keep id order)."""
    values, ids = torch.sort(logprobs, dim=-1, descending=True, stable=True)
    return ids[:, :k], values[:, :k]


def top_k_logprobs(
    logprobs: torch.Tensor,  # [n, vocab] fp32
    k: int,
) -> tuple[torch.Tensor, torch.Tensor]:  # ids [n, k] int64, logprobs [n, k] fp32
    """Equal to `top_k_logprobs_reference`, without sorting the vocabulary: `topk` finds each
    row's k-th value, every entry at least that large is a candidate (k of them, more on a tie
    at the k-th value), and only the candidates are ordered by (row, value descending, id)."""
    n, vocab = logprobs.shape
    if k == 0 or n == 0:
        return torch.empty(n, k, dtype=torch.long), torch.empty(n, k, dtype=torch.float32)
    if not 0 < k <= vocab:
        raise ValueError(f"k must be in [0, vocab = {vocab}], got {k}")
    kth = torch.topk(logprobs, k, dim=-1, sorted=False).values.amin(dim=-1, keepdim=True)  # [n, 1]
    rows, ids = (logprobs >= kth).nonzero(as_tuple=True)  # [m] each, by row then id
    values = logprobs[rows, ids]  # [m]
    order = torch.sort(values, descending=True, stable=True).indices  # ties keep (row, id) order
    order = order[torch.sort(rows[order], stable=True).indices]  # then by row, keeping that order
    rows, ids, values = rows[order], ids[order], values[order]
    counts = torch.bincount(rows, minlength=n)  # [n] candidates per row, each >= k
    rank = torch.arange(rows.shape[0]) - torch.repeat_interleave(torch.cumsum(counts, 0) - counts, counts)  # [m]
    keep = rank < k
    return ids[keep].view(n, k), values[keep].view(n, k)


def round_logprobs(
    logits: torch.Tensor,  # [num_draft_tokens + num_requests, vocab] the round's target rows (RejectionBatch layout)
    *,
    output_token_ids: torch.Tensor,  # [num_requests, max_l + 1] int64, RejectionResult's
    num_accepted: torch.Tensor,  # [num_requests] int64
    num_draft_tokens: torch.Tensor,  # [num_requests] int64
    num_logprobs: torch.Tensor,  # [num_requests] int64 alternatives wanted; NOT_ASKED = none
) -> RoundLogprobs | None:
    """The log-probabilities of every emitted token of the requests that ask (None if none does).

    Request r's emitted token j (its accepted drafts, then the corrected-or-bonus token) was
    chosen at target row cu_r + r + j, cu_r = sum of l_q for q < r: the row that scored it.
    """
    # The host reads these (few numbers) only in a round where a request asks: the API's lists live there.
    num_logprobs, num_draft_tokens = num_logprobs.cpu(), num_draft_tokens.cpu()
    asking = (num_logprobs != NOT_ASKED).nonzero().squeeze(1)  # [n_ask]
    if asking.numel() == 0:
        return None
    output_token_ids, num_accepted = output_token_ids.cpu(), num_accepted.cpu()
    num_requests, width = output_token_ids.shape
    k = int(num_logprobs[asking].max())
    first_row = torch.cumsum(num_draft_tokens, 0) - num_draft_tokens + torch.arange(num_requests)  # [num_requests]
    position = torch.arange(width)  # [max_l + 1]
    emitted = position[None, :] <= num_accepted[asking][:, None]  # [n_ask, max_l + 1]
    rows = (first_row[asking][:, None] + position[None, :])[emitted]  # [n_emitted]
    logprobs = torch.log_softmax(logits.index_select(0, rows.to(logits.device)).float(), dim=-1).cpu()  # [n_emitted, vocab]
    tokens = output_token_ids[asking][emitted]  # [n_emitted]
    chosen = logprobs.gather(1, tokens[:, None]).squeeze(1)  # [n_emitted]
    top_ids, top_lps = top_k_logprobs(logprobs, k)  # [n_emitted, k] each

    token_logprobs = torch.full((num_requests, width), float("nan"))
    top_token_ids = torch.full((num_requests, width, k), -1, dtype=torch.long)
    top_logprobs = torch.full((num_requests, width, k), float("nan"))
    r_index = asking[:, None].expand(-1, width)[emitted]  # [n_emitted] request of each entry
    j_index = position[None, :].expand(asking.numel(), -1)[emitted]  # [n_emitted] its position
    token_logprobs[r_index, j_index] = chosen
    top_token_ids[r_index, j_index] = top_ids
    top_logprobs[r_index, j_index] = top_lps
    return RoundLogprobs(token_logprobs=token_logprobs, top_token_ids=top_token_ids, top_logprobs=top_logprobs)
