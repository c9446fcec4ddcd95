"""What one streamed request measured, and what one load point sums up to (pure functions).

Definitions (the columns of docs/results/serving.csv, docs/method.md §10, Figs. 7 and 8):

- time to first token (TTFT): from sending the request to the first SSE chunk that carries text
  (the chat role chunk, sent when the scheduler accepts the request, carries none).
- time per output token (TPOT) of a request: (last token time - first token time) / (output
  tokens - 1), the time each token after the first one took. Its inverse is the request's
  per-user tokens/s, its decode speed: what Fig. 7's "tokens/s per user" is (the speed a user
  watches text arrive at); queueing and prefill are TTFT's, so they are left out of it. Over the
  whole request (output tokens / latency) would mix the two, and is kept as `request_tok_s`.
- per-user tokens/s of a point: 1 / mean TPOT (the harmonic mean of the requests' speeds), and
  p50 / p90 as 1 / p50 / p90 of TPOT. Through TPOT, as serving engines report it, because a
  request whose chunks reached the client in one burst (a starved server loop flushing several
  rounds at once) has a near-zero decode time: its speed is huge and would dominate an
  arithmetic mean of speeds, while its TPOT just counts as fast. The p90 column is thus the
  speed 90% of the requests reach or beat (1 / p90 of TPOT): the tail a per-user SLA is about.
- aggregate throughput: all measured requests' output tokens / the point's wall time (first
  measured request sent to last one finished).
- verification budget (`verify_tokens_per_request`): draft tokens sent to the verifier per
  decode round per request, Σ draft_tokens / Σ rounds over the measured requests (every
  (request, round) pair weighs the same). The anchor, always verified, is not counted: the
  paper's "MTP-1 verifies 2 tokens per request" is budget 1 here.
- accepted length τ: tokens emitted per decode round (accepted drafts + the bonus/corrected
  token), Σ τ_r · rounds_r / Σ rounds_r.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class RequestRecord:
    """One request as the client saw it; times in seconds on the load point's clock."""

    index: int  # request number in its phase (measured requests 0, 1, ...; warm-up ones separately)
    benchmark: str  # which prompt set the prompt came from
    warmup: bool  # warm-up requests are sent but never counted
    start_s: float  # request sent
    end_s: float  # response complete ([DONE] or the connection closed)
    first_token_s: float | None = None  # first chunk with text
    last_token_s: float | None = None  # last chunk with text or the finish reason
    output_tokens: int = 0  # usage.completion_tokens (chunks with text if the server sent no usage)
    rounds: int | None = None  # decode rounds (`speculative` extension of the final chunk)
    draft_tokens: int | None = None  # draft tokens verified over those rounds
    accepted_tokens: int | None = None  # of those, accepted
    accepted_length: float | None = None  # τ of this request: tokens emitted per decode round
    error: str | None = None  # HTTP status or in-band error message; the request is then not counted

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_s is None else self.first_token_s - self.start_s

    @property
    def latency_s(self) -> float:
        return self.end_s - self.start_s

    @property
    def tpot_s(self) -> float | None:
        """Time per output token after the first: (last token - first token) / (output tokens - 1);
        None below 2 tokens."""
        if self.first_token_s is None or self.last_token_s is None or self.output_tokens < 2:
            return None
        return (self.last_token_s - self.first_token_s) / (self.output_tokens - 1)

    @property
    def per_user_tok_s(self) -> float | None:
        """Decode speed, 1 / TPOT; None without a TPOT or when every token came in one chunk."""
        tpot = self.tpot_s
        return 1.0 / tpot if tpot else None

    @property
    def request_tok_s(self) -> float | None:
        """Output tokens over the whole request (TTFT included)."""
        return self.output_tokens / self.latency_s if self.latency_s > 0 else None


@dataclass(frozen=True)
class PointSummary:
    """One load point: a policy at a temperature under one load."""

    policy: str
    temperature: float
    concurrency: float  # closed loop: clients; open loop: mean requests in flight (Little's law)
    rate_req_s: float | None  # open loop: the Poisson arrival rate; None for closed loop
    num_requests: int  # measured requests that completed
    num_errors: int  # measured requests that failed (not in any statistic below)
    duration_s: float  # first measured request sent -> last one done
    output_tokens: int
    throughput_tok_s: float  # aggregate output tokens/s
    per_user_tok_s: float | None  # 1 / mean TPOT
    p50_per_user_tok_s: float | None  # 1 / p50 TPOT
    p90_per_user_tok_s: float | None  # 1 / p90 TPOT: the speed 90% of requests reach
    ttft_s: float | None  # mean
    p90_ttft_s: float | None
    verify_tokens_per_request: float | None  # None when the server sent no speculative statistics
    accepted_length: float | None
    verifier_batch_tokens: float | None = None  # from the server's /metrics; None when it exposes none


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) with linear interpolation between order statistics (numpy's
    default): position (n - 1) · q / 100 in the sorted values."""
    if not values:
        raise ValueError("percentile of no values")
    if not 0 <= q <= 100:
        raise ValueError(f"q must be in [0, 100], got {q}")
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def _mean(xs: Sequence[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


def _inverse(x: float | None) -> float | None:
    return 1.0 / x if x else None


def measured_window(records: Sequence[RequestRecord]) -> float:
    """Seconds from the first measured request sent to the last one done (0 with none)."""
    measured = [r for r in records if not r.warmup]
    if not measured:
        return 0.0
    return max(r.end_s for r in measured) - min(r.start_s for r in measured)


def mean_in_flight(records: Sequence[RequestRecord]) -> float:
    """Mean number of measured requests in flight over the window (Little's law: Σ latency / window)."""
    window = measured_window(records)
    return sum(r.latency_s for r in records if not r.warmup) / window if window > 0 else 0.0


def verify_budget(records: Sequence[RequestRecord]) -> tuple[float | None, float | None]:
    """(draft tokens verified per round per request, accepted length τ), pooled over the
    requests' decode rounds; (None, None) without speculative statistics or rounds."""
    with_stats = [r for r in records if r.rounds is not None and r.draft_tokens is not None]
    rounds = sum(r.rounds for r in with_stats)
    if rounds == 0:
        return None, None
    budget = sum(r.draft_tokens for r in with_stats) / rounds
    taus = [r for r in with_stats if r.accepted_length is not None]
    tau_rounds = sum(r.rounds for r in taus)
    tau = sum(r.accepted_length * r.rounds for r in taus) / tau_rounds if tau_rounds else None
    return budget, tau


def summarize(
    records: Sequence[RequestRecord],
    *,
    policy: str,
    temperature: float,
    concurrency: float | None,  # None: measured (open loop), mean requests in flight
    rate_req_s: float | None = None,
    verifier_batch_tokens: float | None = None,
) -> PointSummary:
    """The point's statistics over its measured (non-warm-up) requests; failed ones are counted
    in `num_errors` only."""
    measured = [r for r in records if not r.warmup]
    if not measured:
        raise ValueError("no measured requests: every record is a warm-up one")
    ok = [r for r in measured if r.ok]
    tpots = [t for r in ok if (t := r.tpot_s) is not None]
    ttfts = [t for r in ok if (t := r.ttft_s) is not None]
    duration = measured_window(records)
    tokens = sum(r.output_tokens for r in ok)
    budget, tau = verify_budget(ok)
    return PointSummary(
        policy=policy,
        temperature=temperature,
        concurrency=mean_in_flight(records) if concurrency is None else concurrency,
        rate_req_s=rate_req_s,
        num_requests=len(ok),
        num_errors=len(measured) - len(ok),
        duration_s=duration,
        output_tokens=tokens,
        throughput_tok_s=tokens / duration if duration > 0 else 0.0,
        per_user_tok_s=_inverse(_mean(tpots)),
        p50_per_user_tok_s=_inverse(percentile(tpots, 50)) if tpots else None,
        p90_per_user_tok_s=_inverse(percentile(tpots, 90)) if tpots else None,  # 90% of requests are at least this fast
        ttft_s=_mean(ttfts),
        p90_ttft_s=percentile(ttfts, 90) if ttfts else None,
        verify_tokens_per_request=budget,
        accepted_length=tau,
        verifier_batch_tokens=verifier_batch_tokens,
    )
