"""The live round feed: what each engine round did, for whoever watches (the round view, docs/round-view.md).

    feed = engine.round_feed                     # one per SpeculativeEngine
    sub = feed.subscribe(maxsize=256)            # inside a coroutine: bound to the running event loop
    message = await sub.get(timeout=1.0)         # SpsProfile | RoundEvent | None (timeout); raises Dropped
    sub.close()

Produced at one place: `RoundObserver.finish` (dspark/observability/rounds.py), beside the round's
metrics and span attributes and from the same numbers (its RoundRecord). The engine adds what only
it knows (the drafts before the policy cut them, the tokens each request got) in a `RoundDetail`,
and builds that only while `observed.watched`.

Cost. Without subscribers: one read of `feed.watched` (a bool) per round; nothing is built.
With subscribers, the engine thread builds one RoundEvent per round (lists of the round's token
ids and confidences: microseconds) and appends it to each subscriber's deque. It never waits and
never raises into the round: a subscriber holding `maxsize` undelivered messages is dropped (its
`get` raises Dropped, it must subscribe again), and a failure to build or deliver is logged.

Messages, as plain data (`to_wire` / `from_wire`: the JSON the bus carries, dspark/bus/base.py):
  SpsProfile  the verifier's SPS(B) profile, once per profile: the first message of every new
              subscriber (when the engine has one) and whenever it changes; rounds name it by `key`
  RoundEvent  one per round: every request's drafts, confidences, ℓ_r, accepted count and tokens,
              B, Algorithm 1's trace (Θ per admission, where it stopped), the phase times
Token ids only: text is the gateway's (its tokenizer, gateway/round_view.py).
"""

from __future__ import annotations

import asyncio
import collections
import hashlib
import json
import logging
import threading
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from dspark.profiling.sps import SPSProfile
    from dspark.scheduling.prefix_scheduler import ScheduleTrace

__all__ = ["Dropped", "RequestRound", "RoundDetail", "RoundEvent", "RoundFeed", "RoundSubscription", "ScheduleView",
           "SpsProfile", "message_from_wire"]

log = logging.getLogger(__name__)

DEFAULT_MAXSIZE = 256  # undelivered messages a subscriber may hold before it is dropped (~10 s of rounds)


class Dropped(Exception):
    """The subscriber fell `maxsize` messages behind and was dropped; subscribe again."""


def _check(condition: bool, what: str, value: object) -> None:
    if not condition:
        raise ValueError(f"round event: {what}, got {value!r}")


# ---- the messages --------------------------------------------------------------------------


@dataclass(frozen=True)
class SpsProfile:
    """The verifier's SPS(B) curve the rounds were scheduled on (dspark/profiling/sps.py)."""

    key: str  # content hash: rounds name their profile by it
    batch_sizes: list[int]  # [num_points] measured B, ascending
    step_seconds: list[float]  # [num_points] seconds per verifier step at each B

    @classmethod
    def of(cls, profile: SPSProfile) -> SpsProfile:
        sizes, seconds = [int(b) for b in profile.batch_sizes], [float(t) for t in profile.step_seconds]
        key = hashlib.sha256(json.dumps([sizes, seconds]).encode()).hexdigest()[:12]
        return cls(key=key, batch_sizes=sizes, step_seconds=seconds)

    def to_wire(self) -> dict[str, Any]:
        return {"type": "sps", **asdict(self)}

    @classmethod
    def from_wire(cls, d: dict[str, Any]) -> SpsProfile:
        try:
            sizes, seconds = [int(b) for b in d["batch_sizes"]], [float(t) for t in d["step_seconds"]]
            key = str(d["key"])
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"malformed SPS profile message: {e!r}") from None
        _check(len(sizes) == len(seconds) and len(sizes) > 0, "batch_sizes and step_seconds must be equally long, not empty",
               (len(sizes), len(seconds)))
        return cls(key=key, batch_sizes=sizes, step_seconds=seconds)


@dataclass(frozen=True)
class RequestRound:
    """One request's part of a round."""

    request_id: str
    prefill: bool  # the round prefilled it (its first round, or a rebuild): no drafts, `emitted` is its next token
    drafted: list[int]  # [num_drafted] the drafter's proposal before the policy cut it (at most γ)
    confidences: list[float]  # [num_drafted] calibrated c_k of each draft; [] when the drafter gives none
    admitted: int  # ℓ_r: drafted[:admitted] were verified
    accepted: int  # a_r <= ℓ_r: drafted[:accepted] were accepted
    # tokens appended to the output: drafted[:a_r], then the correction (a_r < ℓ_r) or the bonus
    # token (a_r = ℓ_r); fewer when a stop token or max_tokens ends the request
    emitted: list[int]
    finish_reason: str | None  # "stop" | "length" when this round finished the request

    @classmethod
    def from_wire(cls, d: dict[str, Any]) -> RequestRound:
        try:
            r = cls(request_id=str(d["request_id"]), prefill=bool(d["prefill"]), drafted=[int(t) for t in d["drafted"]],
                    confidences=[float(c) for c in d["confidences"]], admitted=int(d["admitted"]),
                    accepted=int(d["accepted"]), emitted=[int(t) for t in d["emitted"]],
                    finish_reason=None if d["finish_reason"] is None else str(d["finish_reason"]))
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"malformed request round: {e!r}") from None
        _check(0 <= r.accepted <= r.admitted <= len(r.drafted), "need 0 <= accepted <= admitted <= drafted",
               (r.accepted, r.admitted, len(r.drafted)))
        _check(not r.confidences or len(r.confidences) == len(r.drafted), "one confidence per draft or none",
               (len(r.confidences), len(r.drafted)))
        _check(len(r.emitted) <= r.accepted + 1, "at most accepted + 1 emitted tokens", (len(r.emitted), r.accepted))
        return r


@dataclass(frozen=True)
class ScheduleView:
    """Algorithm 1's trace of the round (dspark/scheduling/prefix_scheduler.py ScheduleTrace), with
    the break's candidate named by request id."""

    thetas: list[float]  # [admitted + 1], + 1 after a break: Θ with the k best candidates admitted, B = base_batch + k
    base_batch: int  # P + R: B before any draft is admitted
    admitted: int  # Σ ℓ_r
    stop: str  # "break" | "candidates" | "table"
    break_request: str | None  # the request whose draft the break declined ...
    break_position: int | None  # ... and its position j (1-based); None unless stop == "break"

    @property
    def theta(self) -> float:
        return self.thetas[self.admitted]

    @classmethod
    def of(cls, trace: ScheduleTrace, scheduled_ids: Sequence[str]) -> ScheduleView:
        """`trace` of a policy that scheduled `scheduled_ids` (its rows, in order)."""
        r, j = trace.break_candidate if trace.break_candidate is not None else (None, None)
        return cls(thetas=[float(t) for t in trace.thetas], base_batch=trace.base_batch, admitted=trace.admitted,
                   stop=trace.stop, break_request=None if r is None else scheduled_ids[r], break_position=j)

    @classmethod
    def from_wire(cls, d: dict[str, Any]) -> ScheduleView:
        try:
            v = cls(thetas=[float(t) for t in d["thetas"]], base_batch=int(d["base_batch"]), admitted=int(d["admitted"]),
                    stop=str(d["stop"]), break_request=d["break_request"], break_position=d["break_position"])
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"malformed schedule trace: {e!r}") from None
        _check(0 <= v.admitted < len(v.thetas), "need 0 <= admitted < len(thetas)", (v.admitted, len(v.thetas)))
        _check(v.stop in ("break", "candidates", "table"), "stop must be break, candidates or table", v.stop)
        return v


@dataclass(frozen=True)
class RoundEvent:
    """What one engine round did."""

    round_id: int  # the engine's step counter (the round span's dspark.round_id)
    time: float  # time.time() when the round finished
    requests: list[RequestRound]  # [batch] every request of the verifier's forward, in batch order
    batch_tokens: int  # B: tokens in the forward (prefills + anchors + admitted drafts), as the metrics count it
    draft_s: float  # seconds of the round's phases
    schedule_s: float
    verify_s: float
    running: int  # requests still running after the round
    drafting: bool  # False when the draft gate skipped the drafter's model (dspark/scheduling/draft_gate.py)
    policy: str | None  # the policy's spec; None: every draft is verified
    schedule: ScheduleView | None  # Algorithm 1's trace; None when the policy computes no Θ or nothing decoded
    sps_key: str | None  # the SpsProfile the round was scheduled on; None without a profile

    def to_wire(self) -> dict[str, Any]:
        return {"type": "round", **asdict(self)}

    @classmethod
    def from_wire(cls, d: dict[str, Any]) -> RoundEvent:
        try:
            requests = d["requests"]
            _check(isinstance(requests, list), "requests must be a list", type(requests).__name__)
            return cls(
                round_id=int(d["round_id"]), time=float(d["time"]), requests=[RequestRound.from_wire(r) for r in requests],
                batch_tokens=int(d["batch_tokens"]), draft_s=float(d["draft_s"]), schedule_s=float(d["schedule_s"]),
                verify_s=float(d["verify_s"]), running=int(d["running"]), drafting=bool(d["drafting"]),
                policy=None if d["policy"] is None else str(d["policy"]),
                schedule=None if d["schedule"] is None else ScheduleView.from_wire(d["schedule"]),
                sps_key=None if d["sps_key"] is None else str(d["sps_key"]),
            )
        except (KeyError, TypeError) as e:
            raise ValueError(f"malformed round event: {e!r}") from None


def message_from_wire(d: dict[str, Any]) -> SpsProfile | RoundEvent:
    """A feed message from its wire form (ValueError when malformed)."""
    kind = d.get("type") if isinstance(d, dict) else None
    if kind == "round":
        return RoundEvent.from_wire(d)
    if kind == "sps":
        return SpsProfile.from_wire(d)
    raise ValueError(f"a round feed message has type 'round' or 'sps', got {kind!r}")


@dataclass(frozen=True)
class RoundDetail:
    """What the engine adds to a round's RoundRecord for the feed (built only while it is watched)."""

    requests: list[RequestRound]  # [batch] in batch order
    schedule: ScheduleTrace | None  # the policy's trace of this round (rows: the decoding requests in batch order)
    sps_profile: SPSProfile | None
    running: int
    drafting: bool
    policy: str | None


# ---- fan-out ---------------------------------------------------------------------------------


class RoundSubscription:
    """One subscriber's bounded queue, filled by the engine thread, read on one event loop."""

    def __init__(self, feed: RoundFeed, maxsize: int, loop: asyncio.AbstractEventLoop):
        self._feed, self.maxsize, self._loop = feed, maxsize, loop
        self._items: collections.deque = collections.deque()
        self._lock = threading.Lock()
        self._waiter: asyncio.Future | None = None
        self.dropped = False  # it fell maxsize messages behind
        self.closed = False

    def _offer(self, message) -> None:
        """Called by the producer: append, or drop the subscriber once it is full. Never blocks."""
        with self._lock:
            if self.closed:
                return
            if len(self._items) >= self.maxsize:
                self.dropped = self.closed = True
                self._items.clear()
            else:
                self._items.append(message)
            waiter, self._waiter = self._waiter, None
        if self.dropped:
            self._feed._unsubscribe(self)
        if waiter is not None:
            try:
                self._loop.call_soon_threadsafe(_resolve, waiter)
            except RuntimeError:  # its loop is closed: nobody reads any more
                self.close()

    async def get(self, timeout: float | None = None):
        """The next message (SpsProfile | RoundEvent), or None after `timeout` seconds without one.
        Raises Dropped once dropped."""
        while True:
            with self._lock:
                if self.dropped:
                    raise Dropped(f"the subscriber fell {self.maxsize} messages behind")
                if self._items:
                    return self._items.popleft()
                if self.closed:
                    return None
                self._waiter = waiter = self._loop.create_future()
            try:
                done, _ = await asyncio.wait({waiter}, timeout=timeout)
            finally:
                if not waiter.done():
                    waiter.cancel()
            if not done:
                return None

    def get_nowait(self) -> list:
        """Every message waiting now (raises Dropped once dropped)."""
        with self._lock:
            if self.dropped:
                raise Dropped(f"the subscriber fell {self.maxsize} messages behind")
            items = list(self._items)
            self._items.clear()
            return items

    def close(self) -> None:
        with self._lock:
            self.closed = True
            waiter, self._waiter = self._waiter, None
        self._feed._unsubscribe(self)
        if waiter is not None:
            try:
                self._loop.call_soon_threadsafe(_resolve, waiter)
            except RuntimeError:
                pass


def _resolve(fut: asyncio.Future) -> None:
    if not fut.done():
        fut.set_result(None)


class RoundFeed:
    """Fan-out of round events to the subscribers attached now (see the module docstring)."""

    def __init__(self) -> None:
        self._subscribers: tuple[RoundSubscription, ...] = ()  # replaced whole: the producer iterates without a lock
        self._lock = threading.Lock()
        self._profile: SpsProfile | None = None
        self._profile_of: object | None = None  # the SPSProfile object `_profile` was made from
        self.published = 0  # round events published (a test's and a curious reader's counter)

    @property
    def watched(self) -> bool:
        """True while at least one subscriber is attached: the only thing a round reads otherwise."""
        return bool(self._subscribers)

    def subscribe(self, *, maxsize: int = DEFAULT_MAXSIZE) -> RoundSubscription:
        """A new subscriber on the running event loop; its first message is the current SPS profile, if any."""
        if maxsize < 1:
            raise ValueError(f"maxsize must be >= 1, got {maxsize}")
        sub = RoundSubscription(self, maxsize, asyncio.get_running_loop())
        with self._lock:
            if self._profile is not None:
                sub._offer(self._profile)
            self._subscribers = (*self._subscribers, sub)
        return sub

    def _unsubscribe(self, sub: RoundSubscription) -> None:
        with self._lock:
            self._subscribers = tuple(s for s in self._subscribers if s is not sub)

    def publish(self, event: RoundEvent, profile: SPSProfile | None = None) -> None:
        """Hand `event` (and first `profile`, when it is new) to every subscriber; never blocks."""
        if profile is not None and profile is not self._profile_of:
            message = SpsProfile.of(profile)
            self._profile_of = profile
            if self._profile is None or message.key != self._profile.key:
                self._profile = message
                for sub in self._subscribers:
                    sub._offer(message)
        self.published += 1
        for sub in self._subscribers:
            sub._offer(event)

    def profile_key(self, profile: SPSProfile | None) -> str | None:
        """The key of `profile` as published (computed once per profile object)."""
        if profile is None:
            return None
        if profile is self._profile_of and self._profile is not None:
            return self._profile.key
        return SpsProfile.of(profile).key


def build_event(*, round_id: int, finished_at: float, batch_tokens: int, phase_seconds: dict[str, float],
                detail: RoundDetail, feed: RoundFeed) -> RoundEvent:
    """The RoundEvent of a round from its record's numbers and the engine's detail."""
    schedule = None
    if detail.schedule is not None:
        scheduled = [r.request_id for r in detail.requests if not r.prefill]  # the policy's rows (batch order)
        schedule = ScheduleView.of(detail.schedule, scheduled)
    return RoundEvent(
        round_id=round_id, time=finished_at, requests=detail.requests, batch_tokens=batch_tokens,
        draft_s=phase_seconds.get("draft", 0.0), schedule_s=phase_seconds.get("schedule", 0.0),
        verify_s=phase_seconds.get("verify", 0.0), running=detail.running, drafting=detail.drafting, policy=detail.policy,
        schedule=schedule, sps_key=feed.profile_key(detail.sps_profile),
    )

