"""The serving report: frontier arithmetic, the markdown summary and the figures, on a synthetic CSV.

Specification: the frontier keeps the points no other beats on both throughput and per-user
speed; per-user speed is interpolated linearly in throughput along it; speedups are compared
only where both frontiers exist; the throughput at an SLA is where the frontier crosses it; the
"falls below none" concurrency is the first one with less aggregate throughput than `none`;
both figures are written as PNG files.
"""

from __future__ import annotations

import pytest

from dspark.bench.serve_csv import SERVING_COLUMNS, write_rows
from dspark.bench.serve_plots import (
    ServingPoint,
    first_concurrency_below,
    load_points,
    matched_speedups,
    pareto_frontier,
    per_user_at,
    plot_budget,
    plot_frontier,
    summary_markdown,
    throughput_at_sla,
    write_report,
)

# (policy, concurrency, throughput, per-user, budget) at T = 0; fixed:7 collapses at C = 4
ROWS = [
    ("none", 1, 15, 15, 0), ("none", 2, 28, 14, 0), ("none", 4, 40, 10, 0),
    ("fixed:1", 1, 10, 10, 1), ("fixed:1", 2, 18, 9, 1), ("fixed:1", 4, 32, 8, 1),
    ("dspark", 1, 20, 20, 5), ("dspark", 2, 36, 18, 4), ("dspark", 4, 48, 12, 2.5),
    ("fixed:7", 1, 25, 25, 7), ("fixed:7", 2, 30, 15, 7), ("fixed:7", 4, 30, 7.5, 7),
]


def pt(policy, c, tp, pu, budget=None, t=0.0) -> ServingPoint:
    return ServingPoint(policy=policy, temperature=t, concurrency=float(c), throughput_tok_s=float(tp), per_user_tok_s=pu,
                        p90_per_user_tok_s=None, ttft_s=0.1, verify_tokens_per_request=budget, accepted_length=None)


POINTS = [pt(*r) for r in ROWS]


def of(policy):
    return [p for p in POINTS if p.policy == policy]


@pytest.fixture
def csv_path(tmp_path):
    path = tmp_path / "serving.csv"
    rows = [{"policy": p, "temperature": "0", "concurrency": str(c), "throughput_tok_s": str(tp), "per_user_tok_s": str(pu),
             "p90_per_user_tok_s": "", "ttft_s": "0.1", "verify_tokens_per_request": str(b), "accepted_length": "2"}
            for p, c, tp, pu, b in ROWS]
    rows.append({**rows[6], "temperature": "1", "throughput_tok_s": "30"})  # one dspark point at T = 1
    write_rows(path, rows, SERVING_COLUMNS)
    return path


def test_the_frontier_drops_dominated_points_and_sorts_by_throughput():
    assert pareto_frontier(of("fixed:1")) == [(10, 10), (18, 9), (32, 8)]
    # fixed:7 at C=4 (30 tok/s, 7.5/user) is beaten by C=2 (30 tok/s, 15/user)
    assert pareto_frontier(of("fixed:7")) == [(25, 25), (30, 15)]
    assert pareto_frontier([pt("x", 1, 5, None)]) == []


def test_per_user_speed_is_interpolated_along_the_frontier_and_undefined_outside():
    f = pareto_frontier(of("fixed:1"))
    assert per_user_at(f, 18) == 9
    assert per_user_at(f, 25) == pytest.approx(9 - 7 / 14)
    assert per_user_at(f, 9.9) is None and per_user_at(f, 32.1) is None


def test_speedups_are_taken_where_both_frontiers_exist():
    sp = matched_speedups(pareto_frontier(of("dspark")), pareto_frontier(of("fixed:1")))
    # overlap 20..32 tok/s; at 20: 20 / (9 - 2/14); at 32: (20 - 2 * 12/16) / 8
    assert [x for x, _ in sp] == [20, 32]
    assert sp[0][1] == pytest.approx(20 / (9 - 2 / 14))
    assert sp[1][1] == pytest.approx(18.5 / 8)
    assert matched_speedups([(100, 1)], [(10, 5), (20, 4)]) == []


def test_throughput_at_an_sla_is_where_the_frontier_crosses_it():
    assert throughput_at_sla(pareto_frontier(of("dspark")), 10) == 48  # every point is fast enough
    assert throughput_at_sla(pareto_frontier(of("dspark")), 15) == pytest.approx(36 + 12 * (18 - 15) / 6)
    assert throughput_at_sla(pareto_frontier(of("fixed:1")), 10) == 10
    assert throughput_at_sla(pareto_frontier(of("fixed:1")), 20) is None


def test_the_first_concurrency_below_plain_decoding():
    assert first_concurrency_below(of("fixed:1"), of("none")) == 1
    assert first_concurrency_below(of("fixed:7"), of("none")) == 4
    assert first_concurrency_below(of("dspark"), of("none")) is None


def test_the_summary_reports_speedup_sla_throughput_collapse_and_budget(csv_path):
    md = summary_markdown(load_points(csv_path), slas=(10, 20))
    lines = md.splitlines()
    dspark_speedup = next(line for line in lines if line.startswith("| `dspark` | 0 | 20–32"))
    assert f"{20 / (9 - 2 / 14):.2f}x" in dspark_speedup and f"{18.5 / 8:.2f}x" in dspark_speedup
    assert "| `dspark` | 1 | — | — | — | — | no `fixed:1` rows |" in lines
    assert "| `dspark` | 0 | 48 (4.80x) | 20 |" in lines  # fixed:1 meets 20 tok/s/user nowhere
    assert "| `fixed:1` | 0 | 10 | — |" in lines
    assert "| `fixed:7` | 0 | C = 4 | 0.75x |" in lines
    assert "| `dspark` | 0 | never | 1.20x |" in lines
    assert "| `dspark` | 0 | 5.00 | 4.00 | 2.50 |" in lines  # the budget falls as concurrency rises


def test_the_figures_are_written_as_png(tmp_path, csv_path):
    points = load_points(csv_path)
    for path in (plot_frontier(points, tmp_path / "f7.png"), plot_budget(points, tmp_path / "sub" / "f8.png")):
        data = path.read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


def test_write_report_writes_both_figures_and_the_summary(tmp_path, csv_path):
    files, md = write_report(csv_path, tmp_path / "out")
    assert sorted(f.name for f in files) == ["serving_budget.png", "serving_frontier.png", "serving_summary.md"]
    assert (tmp_path / "out" / "serving_summary.md").read_text().startswith(md)


def test_a_missing_or_empty_csv_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="no rows"):
        load_points(tmp_path / "nothing.csv")
