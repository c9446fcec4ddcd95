"""docs/results/serving.csv: the issue's columns exactly, and runs that merge into one file.

Specification: the file has exactly the issue's header; a row replaces the row of equal
(policy, temperature, concurrency), numbers compared as numbers; rows stay grouped by policy in
order of first appearance and sorted numerically within; the details file carries every
summary field (the verifier batch size empty when unknown); open-loop points go to their own
file keyed by rate; a file with another header is refused, not overwritten.
"""

from __future__ import annotations

import csv
import dataclasses

import pytest

from dspark.bench.serve_csv import (
    DETAIL_COLUMNS,
    SERVING_COLUMNS,
    SERVING_KEY,
    details_path,
    format_value,
    merge_rows,
    open_loop_path,
    read_rows,
    record_points,
)
from dspark.bench.serve_stats import PointSummary


def point(policy="dspark", temperature=0.0, concurrency=1.0, throughput=100.0, *, rate=None, batch=None) -> PointSummary:
    return PointSummary(policy=policy, temperature=temperature, concurrency=concurrency, rate_req_s=rate, num_requests=8,
                        num_errors=0, duration_s=2.0, output_tokens=200, throughput_tok_s=throughput, per_user_tok_s=30.0,
                        p50_per_user_tok_s=29.0, p90_per_user_tok_s=20.0, ttft_s=0.25, p90_ttft_s=0.5,
                        verify_tokens_per_request=3.5, accepted_length=2.75, verifier_batch_tokens=batch)


def read_csv(path) -> tuple[list[str], list[dict]]:
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        return list(reader.fieldnames), list(reader)


def test_the_header_is_exactly_the_issues_columns(tmp_path):
    path = tmp_path / "serving.csv"
    record_points(path, [point()])
    header, rows = read_csv(path)
    assert header == ["policy", "temperature", "concurrency", "throughput_tok_s", "per_user_tok_s", "p90_per_user_tok_s",
                      "ttft_s", "verify_tokens_per_request", "accepted_length"]
    assert rows == [{"policy": "dspark", "temperature": "0", "concurrency": "1", "throughput_tok_s": "100",
                     "per_user_tok_s": "30", "p90_per_user_tok_s": "20", "ttft_s": "0.25",
                     "verify_tokens_per_request": "3.5", "accepted_length": "2.75"}]


def test_values_are_written_compactly_and_missing_ones_empty():
    assert format_value(None) == ""
    assert format_value(1.0) == "1"
    assert format_value(0.123456) == "0.1235"
    assert format_value(-0.00001) == "0"
    assert format_value(float("nan")) == ""
    assert format_value(16) == "16"
    assert format_value("fixed:1") == "fixed:1"


def test_runs_for_several_policies_build_one_file_and_a_rerun_replaces_its_rows(tmp_path):
    path = tmp_path / "serving.csv"
    record_points(path, [point("none", 0.0, c, 10.0 * c) for c in (1, 2, 16)])
    record_points(path, [point("dspark", t, c, 20.0 * c) for t in (1.0, 0.0) for c in (16, 2)])
    record_points(path, [point("none", 0.0, 2, 999.0)])  # rerun of one point
    _, rows = read_csv(path)
    keys = [(r["policy"], r["temperature"], r["concurrency"]) for r in rows]
    assert keys == [("none", "0", "1"), ("none", "0", "2"), ("none", "0", "16"),
                    ("dspark", "0", "2"), ("dspark", "0", "16"), ("dspark", "1", "2"), ("dspark", "1", "16")]
    assert rows[1]["throughput_tok_s"] == "999"


def test_keys_compare_as_numbers():
    old = [{"policy": "fixed:1", "temperature": "1.0", "concurrency": "4", "throughput_tok_s": "1"}]
    new = [{"policy": "fixed:1", "temperature": "1", "concurrency": "4.0", "throughput_tok_s": "2"}]
    assert merge_rows(old, new, SERVING_KEY) == new


def test_the_details_file_keeps_every_field_and_leaves_an_unknown_batch_size_empty(tmp_path):
    path = tmp_path / "serving.csv"
    written = record_points(path, [point(batch=None), point(concurrency=4.0, batch=17.25)])
    assert written == [path, details_path(path)]
    header, rows = read_csv(details_path(path))
    assert header == [f.name for f in dataclasses.fields(PointSummary)]
    assert [r["verifier_batch_tokens"] for r in rows] == ["", "17.25"]
    assert rows[0]["p50_per_user_tok_s"] == "29" and rows[0]["num_requests"] == "8"


def test_open_loop_points_go_to_their_own_file_keyed_by_rate(tmp_path):
    path = tmp_path / "serving.csv"
    written = record_points(path, [point(concurrency=1.7, rate=0.5), point(concurrency=3.1, rate=1.0)])
    assert written == [open_loop_path(path)]
    assert not path.exists()
    record_points(path, [point(concurrency=1.9, rate=0.5)])  # same rate: replaces, whatever the measured concurrency
    rows = read_rows(open_loop_path(path), DETAIL_COLUMNS)
    assert [(r["rate_req_s"], r["concurrency"]) for r in rows] == [("0.5", "1.9"), ("1", "3.1")]


def test_a_file_with_other_columns_is_refused_and_left_alone(tmp_path):
    path = tmp_path / "serving.csv"
    path.write_text("policy,tokens\nnone,3\n")
    with pytest.raises(ValueError, match="expected"):
        record_points(path, [point()])
    assert path.read_text() == "policy,tokens\nnone,3\n"
    assert read_rows(tmp_path / "missing.csv", SERVING_COLUMNS) == []
