"""dspark/observability/metrics.py: what a round and a request add to the Prometheus metrics.

Specification: a round adds its drafts, accepted tokens, per-position drafted and accepted
counts (position p counts the requests whose block reached p), one verification budget (ℓ + 1)
and one accepted length per decoding request, its B and phase times; a request's first emission
gives its time to first token, each later one its seconds per token, its last its end-to-end
latency and finish reason; the exposition is Prometheus text; the metrics server answers
scrapes and a busy port does not stop its caller.
"""

from __future__ import annotations

import socket
import urllib.request

import numpy as np
import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from dspark.observability.metrics import (
    EngineMetrics,
    GatewayMetrics,
    RequestTiming,
    RoundRecord,
    exposition,
    start_metrics_server,
)


@pytest.fixture
def registry() -> CollectorRegistry:
    return CollectorRegistry()


def value(registry: CollectorRegistry, name: str, **labels) -> float:
    return registry.get_sample_value(name, labels) or 0.0


def round_record(drafts, accepted, emitted, *, prefill_tokens=0, verify_s=0.02) -> RoundRecord:
    return RoundRecord(num_draft_tokens=np.array(drafts), num_accepted=np.array(accepted), num_emitted=np.array(emitted),
                       prefill_tokens=prefill_tokens, generated_tokens=int(sum(emitted)),
                       phase_seconds={"draft": 0.001, "schedule": 0.0001, "verify": verify_s})


def test_a_round_counts_drafts_and_acceptance_per_position(registry):
    metrics = EngineMetrics(registry)
    # three decoding requests: ℓ = 3, 0, 2 drafts; a = 2, 0, 0 accepted; a prefill of 5 tokens
    metrics.record_round(round_record([3, 0, 2], [2, 0, 0], [3, 1, 1], prefill_tokens=5, verify_s=0.02))
    assert value(registry, "dspark_rounds_total") == 1
    assert value(registry, "dspark_drafts_total") == 2  # the request with no draft is not a draft
    assert value(registry, "dspark_draft_tokens_total") == 5
    assert value(registry, "dspark_accepted_tokens_total") == 2
    drafted = [value(registry, "dspark_draft_tokens_per_position_total", position=str(p)) for p in (1, 2, 3)]
    accepted = [value(registry, "dspark_accepted_tokens_per_position_total", position=str(p)) for p in (1, 2, 3)]
    assert drafted == [2, 2, 1] and accepted == [1, 1, 0]
    assert sum(drafted) == value(registry, "dspark_draft_tokens_total")
    assert sum(accepted) == value(registry, "dspark_accepted_tokens_total")
    # one verification budget per decoding request: ℓ + 1 = 4, 1, 3
    assert value(registry, "dspark_verify_tokens_per_request_count") == 3
    assert value(registry, "dspark_verify_tokens_per_request_sum") == 8
    assert value(registry, "dspark_verify_tokens_per_request_bucket", le="1.0") == 1
    assert value(registry, "dspark_accepted_length_sum") == 5
    assert value(registry, "dspark_verify_batch_tokens_sum") == 5 + 8  # prefill + anchors and drafts
    assert value(registry, "dspark_prompt_tokens_total") == 5 and value(registry, "dspark_generation_tokens_total") == 5
    assert value(registry, "dspark_verifier_sps") == pytest.approx(50.0)
    assert value(registry, "dspark_round_phase_seconds_count", phase="verify") == 1


def test_rounds_add_up_and_a_prefill_only_round_counts_no_drafts(registry):
    metrics = EngineMetrics(registry)
    metrics.record_round(round_record([], [], [], prefill_tokens=7))
    metrics.record_round(round_record([1], [1], [2]))
    assert value(registry, "dspark_rounds_total") == 2
    assert value(registry, "dspark_draft_tokens_per_position_total", position="1") == 1
    assert value(registry, "dspark_accepted_tokens_per_position_total", position="1") == 1
    assert value(registry, "dspark_verify_batch_tokens_count") == 2


def test_a_request_gives_ttft_then_per_token_latency_then_its_end(registry):
    metrics = EngineMetrics(registry)
    timing = RequestTiming(arrival=100.0)
    metrics.record_output(timing, 0, None, 100.1)  # nothing emitted yet: nothing observed
    assert value(registry, "dspark_time_to_first_token_seconds_count") == 0
    metrics.record_output(timing, 1, None, 100.5)
    assert value(registry, "dspark_time_to_first_token_seconds_sum") == pytest.approx(0.5)
    metrics.record_output(timing, 4, None, 100.9)  # 0.4 s for 4 tokens
    metrics.record_output(timing, 2, "stop", 101.1)  # 0.2 s for 2 tokens
    assert value(registry, "dspark_inter_token_latency_seconds_count") == 2
    assert value(registry, "dspark_inter_token_latency_seconds_sum") == pytest.approx(0.2)
    assert value(registry, "dspark_e2e_request_latency_seconds_sum") == pytest.approx(1.1)
    assert value(registry, "dspark_requests_finished_total", reason="stop") == 1
    metrics.record_end("abort")
    metrics.record_end("something else")
    assert value(registry, "dspark_requests_finished_total", reason="abort") == 1
    assert value(registry, "dspark_requests_finished_total", reason="error") == 1


def test_queue_depth_and_running_are_gauges(registry):
    metrics = EngineMetrics(registry)
    metrics.set_counts(waiting=3, running=5)
    metrics.set_counts(waiting=1, running=2)
    assert (value(registry, "dspark_queue_depth"), value(registry, "dspark_running_requests")) == (1, 2)


def test_the_exposition_is_prometheus_text(registry):
    GatewayMetrics(registry).record_request(method="POST", route="/v1/completions", status=200, seconds=0.3)
    body, content_type = exposition(registry)
    assert content_type.startswith("text/plain")
    families = {f.name: f for f in text_string_to_metric_families(body.decode())}
    (sample,) = [s for s in families["dspark_http_requests"].samples if s.name == "dspark_http_requests_total"]
    assert sample.labels == {"method": "POST", "route": "/v1/completions", "status": "200"} and sample.value == 1


def test_the_metrics_server_answers_scrapes_and_a_busy_port_is_not_fatal(registry):
    EngineMetrics(registry).set_counts(waiting=4, running=1)
    server = start_metrics_server(0, host="127.0.0.1", registry=registry)
    try:
        port = server.server_port
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
            text = response.read().decode()
        assert "dspark_queue_depth 4.0" in text
        with socket.socket() as other:
            other.bind(("127.0.0.1", 0))
            other.listen()
            assert start_metrics_server(other.getsockname()[1], host="127.0.0.1", registry=registry) is None
    finally:
        server.shutdown()
        server.server_close()


def test_a_batch_histogram_equals_prometheus_own_histogram_observed_value_by_value():
    from prometheus_client import Histogram

    from dspark.observability.metrics import TOKEN_COUNT_BUCKETS, BatchHistogram

    values = np.random.default_rng(0).integers(0, 40, size=500)  # [500], on and between the bounds, past the last
    batch_registry, reference_registry = CollectorRegistry(), CollectorRegistry()
    batch = BatchHistogram("h", "doc", TOKEN_COUNT_BUCKETS, batch_registry)
    batch.observe_many(values[:200])
    batch.observe_many(values[200:])
    reference = Histogram("h", "doc", buckets=TOKEN_COUNT_BUCKETS, registry=reference_registry)
    for v in values.tolist():
        reference.observe(v)

    def samples(registry):
        return {(s.name, tuple(sorted(s.labels.items()))): s.value for f in registry.collect() for s in f.samples
                if not s.name.endswith("_created")}

    assert samples(batch_registry) == samples(reference_registry)


def test_position_counters_grow_with_the_longest_block_seen(registry):
    from dspark.observability.metrics import PositionCounters

    counters = PositionCounters("c", "doc", registry)
    counters.add(np.array([3, 1]))
    counters.add(np.array([2, 2, 1]))
    assert [value(registry, "c_total", position=str(p)) for p in (1, 2, 3)] == [5, 3, 1]
