"""Lookup proposals beside a model drafter (issue #15 item 8; docs/method.md §8).

Per request and round, BEFORE anything is sampled, the drafter chooses where the block comes
from:

- a context lookup: the tokens that followed the latest earlier occurrence of the context's
  last n tokens (n = max_n down to min_n, `find_ngram_continuation`), proposed as point masses
  (p_d(x_k) = 1), with conditional confidences c_k estimated online from how earlier lookup
  drafts of the same match length fared (`LookupAcceptance`);
- a datastore chain, where the drafter has one (`NgramDatastore`, datastore.py: the target's own
  earlier answers): the most frequent successors of the context's suffix, point masses too, with
  c_k estimated online per bin of the successor's stored share and per regime, greedy or sampled
  (`ShareAcceptance`);
- or the model drafter's block (DSpark: its own sampled tokens, exact rows and STS confidences).

Of the lookups found it takes the one with the larger expected accepted length Σ_k Π_{j<=k} c_j
(c_j of a context lookup estimated per match length and per how the request's previous lookup
fared: missed, partly or all right, a repetition loop being the last), when that is at least the
model drafter's recent expected accepted length (the running mean of the same sum over the
model's own calibrated confidences). Then the model drafter is not run for that request at all:
the round costs a suffix search instead of a backbone forward. On a round whose model drafting
the engine's draft gate skips (DraftRequest.free_only), the better lookup is proposed whatever
its estimate (Algorithm 1 still decides how much of it to verify) and the model is not run.

Lossless (docs/method.md §5, §8): the choice is a function of the context and of earlier rounds
only, never of a token drawn this round (the model drafter samples after the choice, if chosen);
a lookup token is a deterministic function of the context, drawn from the point mass the proposal
reports; the model drafter's rows are its own. Whatever ℓ Algorithm 1 then verifies, rejection
sampling is exact.

Estimating acceptance without being told: a request's next proposal sees the tokens the round
emitted. For a point-mass draft x_k the emitted token at that position equals x_k with
probability exactly p_t(x_k), the acceptance probability, whether x_k was verified (accepted, or
rejected and resampled from the residual, which is zero at x_k) or was cut off by the scheduler
(then the position holds the target's own sample, or the next rounds' tokens). So comparing the
proposal with the emitted tokens up to the first mismatch counts, per position k, tries and hits
of the conditional acceptance P(x_k accepted | x_<k accepted).

The same holds for a lookup that was found but NOT proposed (another block won): the emitted
tokens have the target's distribution whatever was proposed (that is losslessness), so they score
the unproposed continuation just as well. Every match is scored ("shadow" scoring). Without it an
estimate that starts below the model's expected accepted length is never tried and never learns:
on mbpp the shipped drafter's lookups were never chosen (0 of 638 rounds) although the same
lookups were right 25 times in 26 on humaneval.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import numpy as np
import torch

from dspark.drafters.base import Drafter, DraftProposal, DraftRequest
from dspark.drafters.datastore import NgramDatastore
from dspark.drafters.ngram import ContextIndex, find_ngram_continuation


def longest_match(tokens: np.ndarray, *, min_n: int, max_n: int, k: int) -> tuple[int, list[int]]:
    """(n, continuation): the longest suffix length n in [min_n, max_n] that occurred earlier and
    up to k tokens that followed its latest earlier occurrence; (0, []) when none.
    tokens: [seq_len] int64. The plain reference of ContextIndex.longest_match, which serves."""
    for n in range(min(max_n, tokens.shape[0] - 1), min_n - 1, -1):
        cont = find_ngram_continuation(tokens, min_n=n, max_n=n, k=k)
        if cont:
            return n, cont
    return 0, []


# How the request's previous lookup fared (a lookup that was right all along is usually a
# repetition loop, and the next one is right again): the history bucket of the estimates.
NO_HISTORY, MISSED, PARTLY, ALL_RIGHT = 0, 1, 2, 3
NUM_HISTORIES = 4


def history_bucket(matched: int, proposed: int) -> int:
    """The bucket after a lookup of `proposed` tokens whose first `matched` were right."""
    return MISSED if matched == 0 else ALL_RIGHT if matched == proposed else PARTLY


@dataclass
class LookupAcceptance:
    """Per (match length n, history bucket h, draft position k): hits / tries of the conditional
    acceptance, with a Beta(prior_hits, prior_misses) prior so that an unseen cell has a cautious
    estimate."""

    max_n: int
    block_size: int
    prior_hits: float = 1.0
    prior_misses: float = 2.0
    hits: np.ndarray = field(init=False)  # [max_n + 1, NUM_HISTORIES, block_size]
    tries: np.ndarray = field(init=False)  # [max_n + 1, NUM_HISTORIES, block_size]

    def __post_init__(self) -> None:
        self.hits = np.zeros((self.max_n + 1, NUM_HISTORIES, self.block_size))
        self.tries = np.zeros((self.max_n + 1, NUM_HISTORIES, self.block_size))

    def confidences(self, n: int, history: int, length: int) -> np.ndarray:  # [length] c_1..c_length
        h, t = self.hits[n, history, :length], self.tries[n, history, :length]
        return (h + self.prior_hits) / (t + self.prior_hits + self.prior_misses)

    def record(self, n: int, history: int, proposed: list[int], emitted: list[int]) -> int:
        """Score `proposed` drafts of a lookup (match length n, history bucket) against the tokens
        that followed; returns how many leading drafts were right."""
        for k, (x, y) in enumerate(zip(proposed, emitted)):
            self.tries[n, history, k] += 1
            if x != y:
                return k
            self.hits[n, history, k] += 1
        return min(len(proposed), len(emitted))


GREEDY_REGIME, SAMPLED_REGIME = 0, 1
SHARE_BINS = 10  # a datastore draft's stored share, in bins of 0.1
# How often anything followed the draft's stored suffix, in buckets (1, 2-4, 5-19, 20+): a share
# of 1.0 seen once is right far less often than the same share seen 20 times.
EVIDENCE_EDGES = (2, 5, 20)
NUM_BINS = SHARE_BINS * (len(EVIDENCE_EDGES) + 1)


def share_bin(share: float, total: int = 1) -> int:
    """The calibration cell of a datastore draft: its share's bin within its evidence bucket."""
    evidence = sum(total >= edge for edge in EVIDENCE_EDGES)
    return evidence * SHARE_BINS + min(int(share * SHARE_BINS), SHARE_BINS - 1)


@dataclass
class ShareAcceptance:
    """Per (regime, share bin): hits / tries of a datastore draft's conditional acceptance, with
    the Beta prior of LookupAcceptance. A draft's position in its chain is not a dimension: the
    drafts before it being right, its context is the real one, and its share says the rest."""

    prior_hits: float = 1.0
    prior_misses: float = 2.0
    hits: np.ndarray = field(default_factory=lambda: np.zeros((2, NUM_BINS)))  # [regimes, bins]
    tries: np.ndarray = field(default_factory=lambda: np.zeros((2, NUM_BINS)))  # [regimes, bins]

    def confidences(self, regime: int, bins: list[int]) -> np.ndarray:  # [len(bins)] c_1..c_k
        h, t = self.hits[regime, bins], self.tries[regime, bins]
        return (h + self.prior_hits) / (t + self.prior_hits + self.prior_misses)

    def record(self, regime: int, bins: list[int], proposed: list[int], emitted: list[int]) -> int:
        """As LookupAcceptance.record: scored up to the first mismatch; returns the drafts right."""
        for k, (x, y) in enumerate(zip(proposed, emitted)):
            self.tries[regime, bins[k]] += 1
            if x != y:
                return k
            self.hits[regime, bins[k]] += 1
        return min(len(proposed), len(emitted))


def expected_accepted(confidences: np.ndarray) -> float:
    """Σ_k Π_{j<=k} c_j: the expected number of accepted drafts of a block (docs/method.md §5)."""
    return float(np.cumprod(confidences).sum())


@dataclass
class _Pending:
    context_len: int  # len(token_ids) when found: the continuation sits at positions context_len...
    n: int
    history: int
    tokens: list[int]  # proposed, or found and not proposed (another block won): scored alike


@dataclass
class _PendingChain:  # a datastore chain, as _Pending
    context_len: int
    regime: int
    bins: list[int]
    tokens: list[int]


class LookupDrafter(Drafter):
    """A model drafter (DSpark) with lookup proposals where the context repeats itself."""

    def __init__(self, model_drafter: Drafter, *, min_n: int = 2, max_n: int = 4, smoothing: float = 0.1,
                 datastore: NgramDatastore | None = None):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}")
        inner = model_drafter.spec
        if not inner.provides_confidences:
            raise ValueError(f"drafter {inner.name!r} gives no confidences: a lookup cannot be weighed against it")
        if inner.block_size is None:
            raise ValueError(f"drafter {inner.name!r} declares no block_size: the lookup's acceptance estimates need one")
        self.model = model_drafter
        # the model drafter's needs, plus a suffix search that is asked for even on rounds the draft gate skips
        self.spec = dataclasses.replace(inner, name=f"{inner.name}-lookup", free_proposals=True)
        self.min_n, self.max_n = min_n, max_n
        self.smoothing = smoothing  # weight of the newest model proposal in its running expected accepted length
        self.acceptance = LookupAcceptance(max_n=max_n, block_size=inner.block_size)
        self.datastore = datastore
        self.share_acceptance = ShareAcceptance()
        self.model_expected: float = 0.0  # running Σ Π c_k of the model's proposals (0 until one is seen)
        self._pending: dict[str, _Pending] = {}
        self._pending_chain: dict[str, _PendingChain] = {}
        self._history: dict[str, int] = {}  # request -> bucket of its last scored lookup
        self._index: dict[str, ContextIndex] = {}  # request -> its context's n-grams, grown round by round
        # what the last rounds chose (benchmarks and tests read these)
        self.lookup_proposals = 0  # context lookups and datastore chains
        self.datastore_proposals = 0  # of which datastore chains
        self.model_proposals = 0

    # ---- the context, forwarded: the model drafter must see every verified position ----------

    def observe(self, request_id: str, features: torch.Tensor) -> None:
        self.model.observe(request_id, features)

    def context_len(self, request_id: str) -> int:
        return self.model.context_len(request_id)

    def remove_request(self, request_id: str) -> None:
        self._pending.pop(request_id, None)
        self._pending_chain.pop(request_id, None)
        self._history.pop(request_id, None)
        self._index.pop(request_id, None)
        self.model.remove_request(request_id)

    # ---- one round ---------------------------------------------------------------------------

    def propose(self, requests: list[DraftRequest]) -> list[DraftProposal]:
        out = [DraftProposal.empty() for _ in requests]
        to_model = []
        for i, req in enumerate(requests):
            self._learn(req)
            if req.max_draft_tokens <= 0:
                continue
            found = self._lookups(req)  # [(expected accepted, tokens, confidences, from the datastore)]
            if found:
                expected, cont, conf, from_store = max(found, key=lambda f: f[0])  # ties: the context lookup
                if req.free_only or expected >= self.model_expected:
                    proposal = DraftProposal.point_mass(cont)
                    proposal.confidences = torch.from_numpy(conf).float()
                    proposal.free = True  # a search: the draft gate weighs the model's proposals only
                    out[i] = proposal
                    self.lookup_proposals += 1
                    self.datastore_proposals += int(from_store)
                    continue
            if not req.free_only:
                to_model.append(i)
        if to_model:
            proposals = self.model.propose([requests[i] for i in to_model])
            for i, p in zip(to_model, proposals):
                out[i] = p
                if len(p):
                    e = expected_accepted(p.confidences.double().numpy())
                    a = self.smoothing if self.model_proposals else 1.0
                    self.model_expected = (1 - a) * self.model_expected + a * e
                    self.model_proposals += 1
        return out

    def _lookups(self, req: DraftRequest) -> list[tuple[float, list[int], np.ndarray, bool]]:
        """The context lookup and the datastore chain found for `req`, each kept pending to be
        scored next round whether it is proposed or not."""
        found = []
        index = self._index.get(req.request_id)
        if index is None:
            index = self._index[req.request_id] = ContextIndex(min_n=self.min_n, max_n=self.max_n)
        index.update(req.token_ids)
        n, cont = index.longest_match(req.max_draft_tokens)
        if n:
            history = self._history.get(req.request_id, NO_HISTORY)
            conf = self.acceptance.confidences(n, history, len(cont))  # [len(cont)]
            self._pending[req.request_id] = _Pending(len(req.token_ids), n, history, cont)
            found.append((expected_accepted(conf), cont, conf, False))
        if self.datastore is not None:
            chain, shares, totals = self.datastore.chain_with_totals(req.token_ids, req.max_draft_tokens)
            if chain:
                regime = GREEDY_REGIME if req.params.temperature == 0.0 else SAMPLED_REGIME
                bins = [share_bin(x, t) for x, t in zip(shares, totals)]
                conf = self.share_acceptance.confidences(regime, bins)  # [len(chain)]
                self._pending_chain[req.request_id] = _PendingChain(len(req.token_ids), regime, bins, chain)
                found.append((expected_accepted(conf), chain, conf, True))
        return found

    def _learn(self, req: DraftRequest) -> None:
        # the tokens emitted since this request's last lookups, proposed or not, score them (module docstring)
        pending = self._pending.pop(req.request_id, None)
        if pending is not None:
            emitted = req.token_ids[pending.context_len:]
            matched = self.acceptance.record(pending.n, pending.history, pending.tokens, emitted)
            self._history[req.request_id] = history_bucket(matched, min(len(pending.tokens), len(emitted)))
        chain = self._pending_chain.pop(req.request_id, None)
        if chain is not None:
            self.share_acceptance.record(chain.regime, chain.bins, chain.tokens, req.token_ids[chain.context_len:])


__all__ = ["LookupAcceptance", "LookupDrafter", "ShareAcceptance", "expected_accepted", "longest_match", "share_bin"]
