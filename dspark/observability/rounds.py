"""One engine round, observed: its span tree (round > draft, schedule, verify), its metrics, its round event.

    with RoundObserver(round_id, [s.span_context for s in states], feed=engine.round_feed) as observed:
        with observed.phase("draft"):
            proposals = ...
        ...
        observed.finish(num_draft_tokens=..., num_accepted=..., num_emitted=..., prefill_tokens=..., generated_tokens=...,
                        detail=(lambda: RoundDetail(...)) if observed.watched else None)

The engine (dspark/engine/speculative.py) opens one per `step()`: the round span is parented and
linked as dspark/observability/tracing.py explains (`batch_span`); each phase is a child span and
a duration; `finish` hands the round's statistics to the metrics in one RoundRecord and, while
someone watches the round feed (dspark/observability/round_feed.py), publishes a RoundEvent built
from that record and the engine's detail. While tracing is off the spans cost nothing, the
metrics are a few counter updates per round, and an unwatched feed is one bool read.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator, Sequence

import numpy as np
from opentelemetry.trace import SpanContext

from dspark.observability import tracing
from dspark.observability.metrics import PHASES, EngineMetrics, RoundRecord, engine_metrics
from dspark.observability.round_feed import RoundDetail, RoundFeed, build_event

__all__ = ["RoundObserver"]

log = logging.getLogger(__name__)


class RoundObserver:
    def __init__(self, round_id: int, span_contexts: Sequence[SpanContext | None], *, metrics: EngineMetrics | None = None,
                 feed: RoundFeed | None = None):
        self.metrics = metrics if metrics is not None else engine_metrics()
        self.round_id = round_id
        self.feed = feed
        self.watched = feed is not None and feed.watched  # read once per round: all an unwatched feed costs
        self.phase_seconds: dict[str, float] = {}
        self._span_cm = tracing.batch_span("round", span_contexts,
                                           attributes={"dspark.round_id": round_id, "dspark.batch_size": len(span_contexts)})
        self._span = None

    def __enter__(self) -> RoundObserver:
        self._span = self._span_cm.__enter__()
        return self

    def __exit__(self, *exc) -> bool | None:
        return self._span_cm.__exit__(*exc)

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Time the block as phase `name` (one of PHASES) and trace it as a child of the round."""
        if name not in PHASES:
            raise ValueError(f"phase must be one of {PHASES}, got {name!r}")
        t0 = time.perf_counter()
        try:
            with tracing.span(name):
                yield
        finally:
            self.phase_seconds[name] = time.perf_counter() - t0

    def finish(self, *, num_draft_tokens: Sequence[int], num_accepted: Sequence[int], num_emitted: Sequence[int],
               prefill_tokens: int, generated_tokens: int,
               detail: Callable[[], RoundDetail] | None = None) -> RoundRecord:
        """Record the round's statistics (per decoding request, in batch order) in the metrics and on
        the span, and publish its RoundEvent when `detail` is given (the engine gives it while watched)."""
        record = RoundRecord(
            num_draft_tokens=np.asarray(num_draft_tokens, dtype=np.int64),  # [num_decoding]
            num_accepted=np.asarray(num_accepted, dtype=np.int64),  # [num_decoding]
            num_emitted=np.asarray(num_emitted, dtype=np.int64),  # [num_decoding]
            prefill_tokens=prefill_tokens,
            generated_tokens=generated_tokens,
            phase_seconds=dict(self.phase_seconds),
        )
        self.metrics.record_round(record)
        if self._span is not None and self._span.is_recording():
            self._span.set_attributes({
                "dspark.batch_tokens": record.batch_tokens,
                "dspark.draft_tokens": int(record.num_draft_tokens.sum()),
                "dspark.accepted_tokens": int(record.num_accepted.sum()),
                "dspark.generated_tokens": generated_tokens,
            })
        if detail is not None and self.feed is not None:
            self._publish(record, detail)
        return record

    def _publish(self, record: RoundRecord, make_detail: Callable[[], RoundDetail]) -> None:
        """The round event, from the record's numbers: a failure is logged, never raised into the round."""
        try:
            detail = make_detail()
            event = build_event(round_id=self.round_id, finished_at=time.time(), batch_tokens=record.batch_tokens,
                                phase_seconds=record.phase_seconds, detail=detail, feed=self.feed)
            self.feed.publish(event, detail.sps_profile)
        except Exception:
            log.exception("publishing round %d to the round feed failed (the round itself is unaffected)", self.round_id)
