"""Prometheus metrics of the serving system, named in the style of serving engines (vLLM's, `dspark_` prefix).

    metrics = engine_metrics()                     # the process's engine metrics (created on first use)
    metrics.record_round(RoundRecord(...))         # once per engine round (dspark/observability/rounds.py)
    body, content_type = exposition()              # what GET /metrics answers
    start_metrics_server(9464, host="0.0.0.0")     # the scheduler process's own /metrics

Engine (the process that runs the rounds: `dspark serve`, the scheduler):
  dspark_rounds_total                            verification rounds (prefills included)
  dspark_drafts_total                            request-rounds that verified at least one draft
  dspark_draft_tokens_total                      drafts verified
  dspark_accepted_tokens_total                   drafts accepted
  dspark_draft_tokens_per_position_total{position}     drafts verified at position p = 1..γ of a block
  dspark_accepted_tokens_per_position_total{position}  of those, accepted (acceptance at p = accepted / drafted)
  dspark_verify_tokens_per_request               histogram of ℓ_r + 1: the verification budget the
                                                 policy gave a request in a decode round (anchor + drafts)
  dspark_accepted_length                         histogram of tokens a decode round emitted for a request (τ)
  dspark_verify_batch_tokens                     histogram of B: tokens in one verifier forward
  dspark_round_phase_seconds{phase}              histogram: draft | schedule | verify seconds per round
  dspark_verifier_sps                            verifier steps per second measured on the last round,
                                                 SPS(B) at that round's B (1 / its verify seconds)
  dspark_prompt_tokens_total, dspark_generation_tokens_total    prefilled and emitted tokens
  dspark_queue_depth, dspark_running_requests    requests waiting for admission (KV) / in the batch
  dspark_time_to_first_token_seconds             submission to the first token (queueing + prefill)
  dspark_inter_token_latency_seconds             per emission after the first: seconds since the
                                                 previous one / tokens it carried
  dspark_e2e_request_latency_seconds             submission to the last token
  dspark_requests_finished_total{reason}         stop | length | abort | error
Gateway (every gateway process):
  dspark_http_requests_total{method,route,status}, dspark_http_request_duration_seconds{method,route}
  dspark_bus_queue_depth                         requests on the bus not yet acknowledged (read at scrape)

All live in prometheus_client's default registry, created on first use: a gateway-only process
shows no engine metrics, and the embedded server (`dspark serve`: gateway and engine in one
process) shows both at the gateway's /metrics. Counters and histograms are process totals: with
several engines in one process (tests) they add up.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from dataclasses import dataclass, field

import numpy as np
import prometheus_client
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.metrics_core import CounterMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

__all__ = [
    "BatchHistogram", "EngineMetrics", "GatewayMetrics", "PositionCounters", "RequestTiming", "RoundRecord", "engine_metrics",
    "exposition", "gateway_metrics",
    "start_metrics_server",
]

log = logging.getLogger(__name__)

REGISTRY: CollectorRegistry = prometheus_client.REGISTRY
PHASES = ("draft", "schedule", "verify")
FINISH_REASONS = ("stop", "length", "abort", "error")
# Small-integer histograms (token counts per request-round): one bucket per count up to 16.
TOKEN_COUNT_BUCKETS = (1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 12, 14, 16, 24, 32)
BATCH_TOKEN_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
                160.0, 640.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
               1.0, 2.5, 5.0, 10.0)
E2E_BUCKETS = (0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0)
PHASE_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
HTTP_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


@dataclass(frozen=True)
class RoundRecord:
    """What one engine round did: the engine fills it where the round's statistics are computed."""

    num_draft_tokens: np.ndarray  # [num_decoding] int64: ℓ_r, drafts verified per decoding request
    num_accepted: np.ndarray  # [num_decoding] int64: a_r <= ℓ_r, drafts accepted
    num_emitted: np.ndarray  # [num_decoding] int64: tokens the round emitted per decoding request (a_r + 1 before a stop)
    prefill_tokens: int  # prompt tokens of the requests prefilled in this round
    generated_tokens: int  # tokens appended to outputs by the round (prefills' first tokens included)
    phase_seconds: dict[str, float]  # PHASES -> seconds spent in each phase of the round

    @property
    def batch_tokens(self) -> int:
        """B: tokens in the verifier's forward (each decoding request: anchor + drafts)."""
        return self.prefill_tokens + int(self.num_draft_tokens.sum()) + len(self.num_draft_tokens)


@dataclass
class RequestTiming:
    """When a request arrived and last emitted (the engine's per-request latency clock)."""

    arrival: float = field(default_factory=time.perf_counter)
    first_token: float | None = None
    last_token: float | None = None


def _at_least(values: np.ndarray, n: int) -> np.ndarray:
    """[n]: entry p-1 counts the values >= p, for p = 1..n (requests that reached block position p)."""
    counts = np.bincount(values, minlength=n + 1)  # [max(values, n) + 1]
    return counts[::-1].cumsum()[::-1][1 : n + 1]


# A round reports one value per request; prometheus_client's metrics take one Python call per
# value (a lock, a bucket search). These two collectors take a round's values in one numpy call.


class BatchHistogram(Collector):
    """A Prometheus histogram observed a whole array at a time."""

    def __init__(self, name: str, documentation: str, buckets: tuple[float, ...], registry: CollectorRegistry):
        self.name, self.documentation = name, documentation
        self._bounds = np.asarray(buckets, dtype=np.float64)  # [num_buckets] upper bounds (le), increasing
        self._counts = np.zeros(len(buckets) + 1, dtype=np.int64)  # [num_buckets + 1] per bucket, the last one +Inf
        self._sum = 0.0
        self._lock = threading.Lock()
        registry.register(self)

    def observe_many(self, values: np.ndarray) -> None:
        """Observe each entry of `values` ([n] numbers) once."""
        bucket = np.searchsorted(self._bounds, values, side="left")  # [n]: first bound >= value, i.e. value <= le
        counts = np.bincount(bucket, minlength=len(self._counts))  # [num_buckets + 1]
        with self._lock:
            self._counts += counts
            self._sum += float(np.sum(values))

    def collect(self):
        with self._lock:
            cumulative, total = np.cumsum(self._counts).tolist(), self._sum
        les = [floatToGoString(b) for b in self._bounds] + ["+Inf"]
        yield HistogramMetricFamily(self.name, self.documentation, buckets=list(zip(les, cumulative)), sum_value=total)


class PositionCounters(Collector):
    """Counters labelled by block position p = 1, 2, ... (γ bounds the labels), added a round at a time."""

    def __init__(self, name: str, documentation: str, registry: CollectorRegistry):
        self.name, self.documentation = name, documentation
        self._counts = np.zeros(0, dtype=np.int64)  # [max position seen]
        self._lock = threading.Lock()
        registry.register(self)

    def add(self, per_position: np.ndarray) -> None:
        """Add per_position[p - 1] ([n] counts) to position p."""
        with self._lock:
            if len(per_position) > len(self._counts):
                self._counts = np.pad(self._counts, (0, len(per_position) - len(self._counts)))
            self._counts[: len(per_position)] += per_position

    def collect(self):
        family = CounterMetricFamily(self.name, self.documentation, labels=["position"])
        with self._lock:
            counts = self._counts.tolist()
        for p, count in enumerate(counts, start=1):
            family.add_metric([str(p)], count)
        yield family


class EngineMetrics:
    """The engine's metrics (module docstring) in `registry`; one instance per process (engine_metrics)."""

    def __init__(self, registry: CollectorRegistry = REGISTRY):
        def counter(name, doc, labels=()):
            return Counter(name, doc, labels, registry=registry)

        def histogram(name, doc, buckets, labels=()):
            return Histogram(name, doc, labels, buckets=buckets, registry=registry)

        self.rounds = counter("dspark_rounds", "Verification rounds run (prefills included).")
        self.drafts = counter("dspark_drafts", "Request-rounds that verified at least one draft token.")
        self.draft_tokens = counter("dspark_draft_tokens", "Draft tokens verified.")
        self.accepted_tokens = counter("dspark_accepted_tokens", "Draft tokens accepted.")
        self.draft_tokens_per_position = PositionCounters(
            "dspark_draft_tokens_per_position", "Draft tokens verified at each position of a block (1 = first draft).", registry)
        self.accepted_tokens_per_position = PositionCounters(
            "dspark_accepted_tokens_per_position", "Draft tokens accepted at each position of a block.", registry)
        self.verify_tokens_per_request = BatchHistogram(
            "dspark_verify_tokens_per_request", "Verification budget of a request in a decode round: anchor + drafts verified.",
            TOKEN_COUNT_BUCKETS, registry)
        self.accepted_length = BatchHistogram("dspark_accepted_length", "Tokens a decode round emitted for a request.",
                                              TOKEN_COUNT_BUCKETS, registry)
        self.verify_batch_tokens = histogram("dspark_verify_batch_tokens", "Tokens in one verifier forward (B).",
                                             BATCH_TOKEN_BUCKETS)
        self.phase_seconds = histogram("dspark_round_phase_seconds", "Seconds per round in each phase.", PHASE_BUCKETS,
                                       ("phase",))
        self.verifier_sps = Gauge("dspark_verifier_sps",
                                  "Verifier steps per second measured on the last round (1 / verify seconds).", registry=registry)
        self.prompt_tokens = counter("dspark_prompt_tokens", "Prompt tokens prefilled.")
        self.generation_tokens = counter("dspark_generation_tokens", "Tokens generated.")
        self.queue_depth = Gauge("dspark_queue_depth", "Requests waiting for admission to the batch.", registry=registry)
        self.running_requests = Gauge("dspark_running_requests", "Requests in the running batch.", registry=registry)
        self.time_to_first_token = histogram("dspark_time_to_first_token_seconds",
                                             "Seconds from submission to the first token.", TTFT_BUCKETS)
        self.inter_token_latency = histogram("dspark_inter_token_latency_seconds",
                                             "Seconds per token between a request's emissions.", ITL_BUCKETS)
        self.e2e_latency = histogram("dspark_e2e_request_latency_seconds", "Seconds from submission to the last token.",
                                     E2E_BUCKETS)
        self.requests_finished = counter("dspark_requests_finished", "Requests that left the engine, by reason.", ("reason",))
        self._phase = {p: self.phase_seconds.labels(phase=p) for p in PHASES}
        self._finished = {r: self.requests_finished.labels(reason=r) for r in FINISH_REASONS}

    def record_round(self, record: RoundRecord) -> None:
        """Everything a round contributes (called once per round, by the engine thread)."""
        self.rounds.inc()
        self.prompt_tokens.inc(record.prefill_tokens)
        self.generation_tokens.inc(record.generated_tokens)
        for phase, seconds in record.phase_seconds.items():
            self._phase[phase].observe(seconds)
        verify_s = record.phase_seconds.get("verify", 0.0)
        if verify_s > 0:
            self.verifier_sps.set(1.0 / verify_s)
        self.verify_batch_tokens.observe(record.batch_tokens)
        drafted, accepted = record.num_draft_tokens, record.num_accepted
        if len(drafted) == 0:
            return
        self.drafts.inc(int((drafted > 0).sum()))
        self.draft_tokens.inc(int(drafted.sum()))
        self.accepted_tokens.inc(int(accepted.sum()))
        width = int(drafted.max())
        if width > 0:
            self.draft_tokens_per_position.add(_at_least(drafted, width))
            self.accepted_tokens_per_position.add(_at_least(accepted, width))
        self.verify_tokens_per_request.observe_many(drafted + 1)
        self.accepted_length.observe_many(record.num_emitted)

    def record_output(self, timing: RequestTiming, num_new_tokens: int, finish_reason: str | None, now: float) -> None:
        """A request's emission at `now` (perf_counter): TTFT, inter-token latency, and its end."""
        if num_new_tokens:
            if timing.first_token is None:
                timing.first_token = now
                self.time_to_first_token.observe(now - timing.arrival)
            else:
                self.inter_token_latency.observe((now - timing.last_token) / num_new_tokens)
            timing.last_token = now
        if finish_reason is not None:
            self.e2e_latency.observe(now - timing.arrival)
            self.record_end(finish_reason)

    def record_end(self, reason: str) -> None:
        """A request left the engine: stop | length (finished), abort (cancelled), error (failed)."""
        self._finished[reason if reason in self._finished else "error"].inc()

    def set_counts(self, *, waiting: int, running: int) -> None:
        self.queue_depth.set(waiting)
        self.running_requests.set(running)


class GatewayMetrics:
    """The gateway's HTTP metrics in `registry`; one instance per process (gateway_metrics)."""

    def __init__(self, registry: CollectorRegistry = REGISTRY):
        self.requests = Counter("dspark_http_requests", "HTTP requests answered, by route and status.",
                                ("method", "route", "status"), registry=registry)
        self.duration = Histogram("dspark_http_request_duration_seconds", "Seconds to answer an HTTP request (whole body).",
                                  ("method", "route"), buckets=HTTP_BUCKETS, registry=registry)
        self.bus_queue_depth = Gauge("dspark_bus_queue_depth", "Requests on the bus not yet acknowledged.", registry=registry)

    def record_request(self, *, method: str, route: str, status: int, seconds: float) -> None:
        self.requests.labels(method=method, route=route, status=str(status)).inc()
        self.duration.labels(method=method, route=route).observe(seconds)


@functools.cache
def engine_metrics() -> EngineMetrics:
    """This process's engine metrics, registered in the default registry on first use."""
    return EngineMetrics(REGISTRY)


@functools.cache
def gateway_metrics() -> GatewayMetrics:
    """This process's gateway metrics, registered in the default registry on first use."""
    return GatewayMetrics(REGISTRY)


def exposition(registry: CollectorRegistry = REGISTRY) -> tuple[bytes, str]:
    """(body, content type) of the Prometheus text format for every metric of `registry`."""
    return prometheus_client.generate_latest(registry), CONTENT_TYPE_LATEST


def start_metrics_server(port: int, *, host: str = "127.0.0.1", registry: CollectorRegistry = REGISTRY):
    """Serve `registry` over HTTP on host:port (any path; Prometheus scrapes /metrics) on a daemon
    thread; returns the server (`.shutdown()` stops it), or None if the port cannot be bound: the
    metrics are an aid, their port must not keep a scheduler from serving."""
    try:
        server, _thread = prometheus_client.start_http_server(port, addr=host, registry=registry)
    except OSError as e:
        log.error("cannot serve metrics on %s:%d: %s; continuing without", host, port, e)
        return None
    log.info("Prometheus metrics on http://%s:%d/metrics", host, server.server_port)
    return server
