"""Skip a drafting round that will not pay for itself (issue #15 item 7; the paper's named limit:
"the backbone's drafting cost is paid even for hard requests").

Algorithm 1 chooses ℓ_r AFTER the drafts exist, so their cost is sunk by then. The gate decides
BEFORE drafting, from the engine's last rounds only, whether this round drafts at all:

    tokens/s without drafting   R / T_v(R + P)
    tokens/s with drafting      R (1 + g) / (R t_d + T_v(R + P + R ℓ̄))

with R decoding requests, P prefill tokens riding in the same forward, T_v(B) = 1 / SPS(B) the
verifier's measured step time at B tokens, and running means (exponential, weight `smoothing`
on the newest round) over the rounds that drafted: t_d the drafting time per request, ℓ̄ the
drafts verified per request and g the drafts accepted per request, counting only the requests
the model drafted for (a free proposal, `DraftProposal.free`: a context lookup, costs no model
forward and is made whatever the gate says, so it must not vouch for the model). It drafts when the second
is higher, and also after `probe_every` rounds in a row without drafting (the estimates must
see new rounds to notice that a request got easier). A probe that does not pay doubles the wait
before the next one, up to `max_probe_every`; a round that pays resets it: with a drafter that
does not pay on this hardware (a verify step that grows steeply with B, as on compact fp32
weights), fixed probes every 8 rounds cost ~8% of plain decoding's speed, backed-off ones ~1-2%.
The wait is also never shorter than what keeps probes within `probe_budget` of decoding time:

    probe cost  c = R t_d + T_v(R + P + R ℓ̄) − (1 + g) T_v(R + P)     (its time beyond what plain
                                                                     decoding of its tokens takes)
    wait        ≥ c / (probe_budget · T_v(R + P)) rounds

On a fast step the doubling alone was not enough: with int8 activations (a 7.4 ms step against
a 3.5 ms drafting round) back-off probes cost 3.5-4.6% of plain decoding on the benchmarks of
bench_peers.py (docs/results/compact_weights.md); a 1% budget waits ~60 rounds there.
Before any drafted round it drafts.

Used by the `dspark` policy (`Policy.gates_drafting`); not by `dspark-async`, whose capacity
comes from confidences of two rounds earlier that skipped rounds would not produce.

Lossless: whether round n drafts is a function of rounds < n (their timings and accepted counts,
i.e. of tokens already emitted), never of round n's draft tokens; each round's rejection
sampling is exact given the past whatever ℓ it verifies, ℓ = 0 included (docs/method.md §5).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np


@dataclass
class DraftGate:
    smoothing: float = 0.3  # weight of the newest drafted round in the running means
    probe_every: int = 8  # draft anyway after this many rounds in a row without drafting
    max_probe_every: int = 64  # the wait doubles after each probe that did not pay, up to this
    probe_budget: float | None = 0.01  # probes that do not pay take at most this share of decoding time; None: no bound
    draft_s_per_request: float | None = None  # fixed t_d (benchmarks, tests); None = measured
    # running means over drafted rounds (None until the first one)
    _t_d: float | None = None
    _verified: float | None = None  # ℓ̄
    _accepted: float | None = None  # g
    _skipped_in_a_row: int = 0
    _probe_wait: int = 0  # rounds to skip before the next probe (probe_every .. max_probe_every)

    def __post_init__(self) -> None:
        if not 0 < self.smoothing <= 1:
            raise ValueError(f"smoothing must be in (0, 1], got {self.smoothing}")
        if self.probe_every < 1:
            raise ValueError(f"probe_every must be >= 1, got {self.probe_every}")
        if self.max_probe_every < self.probe_every:
            raise ValueError(f"max_probe_every must be >= probe_every ({self.probe_every}), got {self.max_probe_every}")
        if self.probe_budget is not None and not 0 < self.probe_budget <= 1:
            raise ValueError(f"probe_budget must be in (0, 1], got {self.probe_budget}")
        self._probe_wait = self.probe_every

    def expected_gain(self, *, num_requests: int, sps_table: np.ndarray, prefill_tokens: int = 0) -> float | None:
        """Expected tokens/s with drafting over without it (None before any drafted round). The
        table's last entry stands in for batches beyond it."""
        if self._verified is None or num_requests == 0:
            return None
        r, step_s = num_requests, _step_seconds(sps_table)
        plain = r / step_s(r + prefill_tokens)
        spec = r * (1.0 + self._accepted) / (r * self._draft_s() + step_s(r + prefill_tokens + r * self._verified))
        return spec / plain

    def budget_wait(self, *, num_requests: int, sps_table: np.ndarray, prefill_tokens: int = 0) -> int:
        """The fewest rounds between two probes that keeps probes within `probe_budget` of decoding
        time (module docstring), from the running means; 0 before any drafted round or without a budget."""
        if self._verified is None or num_requests == 0 or self.probe_budget is None:
            return 0
        r, step_s = num_requests, _step_seconds(sps_table)
        plain = step_s(r + prefill_tokens)
        cost = r * self._draft_s() + step_s(r + prefill_tokens + r * self._verified) - (1.0 + self._accepted) * plain
        return max(0, math.ceil(cost / (self.probe_budget * plain)))

    def _draft_s(self) -> float:  # t_d: fixed, or the running mean
        return self._t_d if self.draft_s_per_request is None else self.draft_s_per_request

    def should_draft(self, *, num_requests: int, sps_table: np.ndarray | None, prefill_tokens: int = 0) -> bool:
        if sps_table is None or num_requests == 0:
            return True
        gain = self.expected_gain(num_requests=num_requests, sps_table=sps_table, prefill_tokens=prefill_tokens)
        if gain is None or gain > 1.0:
            self._skipped_in_a_row, self._probe_wait = 0, self.probe_every
            return True
        wait = max(self._probe_wait, self.budget_wait(num_requests=num_requests, sps_table=sps_table, prefill_tokens=prefill_tokens))
        if self._skipped_in_a_row >= wait:  # a probe; if it does not pay either, wait longer next time
            self._skipped_in_a_row = 0
            self._probe_wait = min(2 * self._probe_wait, self.max_probe_every)
            return True
        self._skipped_in_a_row += 1
        return False

    def record(self, *, num_requests: int, draft_seconds: float, verified: int, accepted: int) -> None:
        """After a drafted round: R requests drafted in `draft_seconds`, `verified` of their drafts
        went to the verifier and `accepted` of those were accepted (totals over the R requests)."""
        if num_requests <= 0:
            return
        new = (draft_seconds / num_requests, verified / num_requests, accepted / num_requests)
        if self._verified is None:
            self._t_d, self._verified, self._accepted = new
            return
        a = self.smoothing
        self._t_d = (1 - a) * self._t_d + a * new[0]
        self._verified = (1 - a) * self._verified + a * new[1]
        self._accepted = (1 - a) * self._accepted + a * new[2]


def _step_seconds(sps_table: np.ndarray):
    """B -> T_v(B) = 1 / SPS(B) from the table (SPS(B) at index B - 1); its last entry stands in
    for batches beyond it."""
    sps = np.asarray(sps_table, dtype=np.float64)  # [B_max]

    def step_s(batch: float) -> float:
        return 1.0 / sps[min(max(int(round(batch)), 1), len(sps)) - 1]

    return step_s


__all__ = ["DraftGate"]
