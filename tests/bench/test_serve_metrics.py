"""Reading the verifier batch size from a server's Prometheus /metrics.

Specification: samples of one name are summed over their labels (quoted label values may hold
spaces and braces); a histogram's mean over the point is Δsum / Δcount between two scrapes; a
gauge is read after the point; no such metric (or no /metrics at all) gives None.
"""

from __future__ import annotations

import pytest

from dspark.bench.serve_metrics import parse_prometheus, verifier_batch_tokens

BEFORE = """\
# HELP dspark_verifier_batch_tokens Tokens per verification forward.
# TYPE dspark_verifier_batch_tokens histogram
dspark_verifier_batch_tokens_bucket{le="8",replica="a"} 3
dspark_verifier_batch_tokens_sum{replica="a"} 100
dspark_verifier_batch_tokens_count{replica="a"} 10
dspark_verifier_batch_tokens_sum{replica="b b}"} 20
dspark_verifier_batch_tokens_count{replica="b b}"} 2
dspark_requests_running 3 1700000000000
malformed line
"""
AFTER = BEFORE.replace("_sum{replica=\"a\"} 100", "_sum{replica=\"a\"} 400").replace("_count{replica=\"a\"} 10", "_count{replica=\"a\"} 40")


def test_samples_are_summed_over_labels_and_comments_skipped():
    samples = parse_prometheus(BEFORE)
    assert samples["dspark_verifier_batch_tokens_sum"] == 120.0
    assert samples["dspark_verifier_batch_tokens_count"] == 12.0
    assert samples["dspark_requests_running"] == 3.0  # the timestamp is not the value
    assert "malformed" not in samples and "#" not in "".join(samples)


def test_a_histograms_mean_over_the_point_is_its_delta_sum_over_delta_count():
    assert verifier_batch_tokens(parse_prometheus(BEFORE), parse_prometheus(AFTER)) == pytest.approx(300 / 30)
    assert verifier_batch_tokens(parse_prometheus(BEFORE), parse_prometheus(BEFORE)) is None  # nothing verified in between


def test_a_gauge_is_read_after_the_point_and_a_name_can_be_given():
    after = parse_prometheus("dspark_verify_batch_size 24\nother_batch_gauge 7\n")
    assert verifier_batch_tokens(None, after) == 24.0
    assert verifier_batch_tokens(None, after, metric="other_batch_gauge") == 7.0


def test_no_such_metric_or_no_metrics_endpoint_gives_none():
    assert verifier_batch_tokens(None, None) is None
    assert verifier_batch_tokens({}, parse_prometheus("dspark_requests_running 3\n")) is None
