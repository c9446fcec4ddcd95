"""The serving benchmark's CSV files: row format, and merging a run into what earlier runs wrote.

    docs/results/serving.csv           the issue's columns (SERVING_COLUMNS), closed-loop points
    docs/results/serving_details.csv   every PointSummary field of the same points (p50, errors,
                                       verifier batch size, ...), same key
    docs/results/serving_open_loop.csv every field of the open-loop (Poisson) points, keyed by rate

Runs append: a row whose key (policy, temperature, concurrency) -- or (policy, temperature,
rate) for open loop -- is already in the file replaces it, so a run per policy builds one file
and a rerun overwrites its own points. Rows stay grouped by policy in order of first
appearance, sorted by temperature then load within a policy. Writes go to a temporary file
renamed into place (an interrupted run never leaves half a file).
"""

from __future__ import annotations

import csv
import dataclasses
import math
import os
from collections.abc import Iterable, Sequence
from pathlib import Path

from dspark.bench.serve_stats import PointSummary

SERVING_COLUMNS = ("policy", "temperature", "concurrency", "throughput_tok_s", "per_user_tok_s", "p90_per_user_tok_s",
                   "ttft_s", "verify_tokens_per_request", "accepted_length")
SERVING_KEY = ("policy", "temperature", "concurrency")
DETAIL_COLUMNS = tuple(f.name for f in dataclasses.fields(PointSummary))
OPEN_LOOP_KEY = ("policy", "temperature", "rate_req_s")

Row = dict[str, str]


def details_path(csv_path: str | Path) -> Path:
    p = Path(csv_path)
    return p.with_name(f"{p.stem}_details{p.suffix}")


def open_loop_path(csv_path: str | Path) -> Path:
    p = Path(csv_path)
    return p.with_name(f"{p.stem}_open_loop{p.suffix}")


def format_value(value: object) -> str:
    """CSV text of a value: "" for None, floats to 4 decimals without trailing zeros (1.0 -> "1")."""
    if value is None:
        return ""
    if isinstance(value, float):
        if not math.isfinite(value):  # NaN or inf: not a measurement
            return ""
        text = f"{value:.4f}".rstrip("0").rstrip(".")
        return "0" if text in ("-0", "") else text
    return str(value)


def summary_row(summary: PointSummary, columns: Sequence[str] = SERVING_COLUMNS) -> Row:
    values = dataclasses.asdict(summary)
    return {c: format_value(values[c]) for c in columns}


def _key(row: Row, key: Sequence[str]) -> tuple:
    """The row's identity: the policy as written, numbers compared as numbers ("1" == "1.0")."""
    out = []
    for k in key:
        v = row.get(k, "")
        try:
            out.append(float(v) if k != "policy" else v)
        except ValueError:
            out.append(v)
    return tuple(out)


def read_rows(path: str | Path, columns: Sequence[str]) -> list[Row]:
    """The rows of an existing file ([] if there is none); ValueError if its header differs."""
    path = Path(path)
    if not path.exists():
        return []
    with path.open(newline="") as f:
        reader = csv.DictReader(f)
        if tuple(reader.fieldnames or ()) != tuple(columns):
            raise ValueError(f"{path} has columns {reader.fieldnames}, expected {list(columns)}; "
                             "move it away or write to another file")
        return [dict(r) for r in reader]


def merge_rows(existing: Iterable[Row], new: Iterable[Row], key: Sequence[str]) -> list[Row]:
    """`existing` with `new` merged in: a new row replaces the row of equal key (the last of
    several new rows of one key wins). Grouped by policy (order of first appearance), then
    sorted by the other key fields."""
    by_key: dict[tuple, Row] = {}
    for row in [*existing, *new]:
        by_key[_key(row, key)] = row
    policy_order = {p: i for i, p in enumerate(dict.fromkeys(k[0] for k in by_key))}

    def order(k: tuple) -> tuple:
        rest = tuple((0, v, "") if isinstance(v, float) else (1, 0.0, v) for v in k[1:])
        return (policy_order[k[0]], *rest)

    return [by_key[k] for k in sorted(by_key, key=order)]


def write_rows(path: str | Path, rows: Sequence[Row], columns: Sequence[str]) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(columns), lineterminator="\n")
        writer.writeheader()
        writer.writerows(rows)
    os.replace(tmp, path)


def merge_into(path: str | Path, new: Iterable[Row], *, columns: Sequence[str], key: Sequence[str]) -> list[Row]:
    """Merge `new` rows into the file at `path` (created if missing); returns the file's rows."""
    rows = merge_rows(read_rows(path, columns), new, key)
    write_rows(path, rows, columns)
    return rows


def record_points(csv_path: str | Path, summaries: Sequence[PointSummary]) -> list[Path]:
    """Write load points where they belong: closed-loop ones into `csv_path` (the issue's
    columns) and its _details file, open-loop ones into its _open_loop file. Returns the files written."""
    closed = [s for s in summaries if s.rate_req_s is None]
    opened = [s for s in summaries if s.rate_req_s is not None]
    written = []
    if closed:
        merge_into(csv_path, [summary_row(s) for s in closed], columns=SERVING_COLUMNS, key=SERVING_KEY)
        merge_into(details_path(csv_path), [summary_row(s, DETAIL_COLUMNS) for s in closed],
                   columns=DETAIL_COLUMNS, key=SERVING_KEY)
        written += [Path(csv_path), details_path(csv_path)]
    if opened:
        merge_into(open_loop_path(csv_path), [summary_row(s, DETAIL_COLUMNS) for s in opened],
                   columns=DETAIL_COLUMNS, key=OPEN_LOOP_KEY)
        written.append(open_loop_path(csv_path))
    return written
