"""The serving benchmark's report, from docs/results/serving.csv alone: Figs. 7 and 8 and a summary.

    dspark bench plot --csv docs/results/serving.csv --out docs/results/

    serving_frontier.png  Fig. 7: aggregate output tokens/s against per-user tokens/s, one line
                          per policy per temperature (points in order of concurrency)
    serving_budget.png    Fig. 8: verification budget per request, and aggregate throughput,
                          against concurrency
    serving_summary.md    per-user speedup against `fixed:1` at matched aggregate throughput,
                          aggregate throughput at per-user SLAs, where each policy falls below
                          `none`, and the verification budget per request by concurrency

Frontier: the points of a (policy, temperature) that no other of its points beats on both axes
(more throughput and more speed per user), sorted by throughput; between two of them per-user
speed is interpolated linearly in throughput. "Matched throughput" compares two frontiers at
every throughput where both exist (each frontier's own points inside the overlap), as the paper
reads Fig. 7. Per-user speed is the CSV's per_user_tok_s, 1 / mean time per output token (serve_stats.py).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from dspark.bench.serve_csv import SERVING_COLUMNS, read_rows

REFERENCE_POLICY = "fixed:1"  # MTP-1, the paper's production baseline
BASELINE_POLICY = "none"  # plain decoding
DEFAULT_SLAS = (10.0, 20.0)  # per-user tokens/s; the paper's 80 / 120 tok/s are for its GPUs, this is a CPU


@dataclass(frozen=True)
class ServingPoint:
    """One row of serving.csv."""

    policy: str
    temperature: float
    concurrency: float
    throughput_tok_s: float
    per_user_tok_s: float | None
    p90_per_user_tok_s: float | None
    ttft_s: float | None
    verify_tokens_per_request: float | None
    accepted_length: float | None


def _num(text: str) -> float | None:
    return float(text) if text.strip() else None


def load_points(csv_path: str | Path) -> list[ServingPoint]:
    rows = read_rows(csv_path, SERVING_COLUMNS)
    if not rows:
        raise FileNotFoundError(f"{csv_path} does not exist or has no rows")
    points = []
    for i, row in enumerate(rows, start=2):
        try:
            points.append(ServingPoint(
                policy=row["policy"], temperature=float(row["temperature"]), concurrency=float(row["concurrency"]),
                throughput_tok_s=float(row["throughput_tok_s"]),
                **{c: _num(row[c]) for c in SERVING_COLUMNS[4:]},
            ))
        except ValueError as e:
            raise ValueError(f"{csv_path}, line {i}: {e}") from None
    return points


def series(points: Sequence[ServingPoint]) -> dict[tuple[str, float], list[ServingPoint]]:
    """(policy, temperature) -> its points by concurrency; keys in order of first appearance."""
    out: dict[tuple[str, float], list[ServingPoint]] = {}
    for p in points:
        out.setdefault((p.policy, p.temperature), []).append(p)
    return {k: sorted(v, key=lambda p: p.concurrency) for k, v in out.items()}


# ---- frontier arithmetic (pure) --------------------------------------------------------------


def pareto_frontier(points: Sequence[ServingPoint]) -> list[tuple[float, float]]:
    """(throughput, per-user) of the points no other point beats on both, throughput ascending
    (so per-user speed descending); points without a per-user speed are left out."""
    xy = sorted({(p.throughput_tok_s, p.per_user_tok_s) for p in points if p.per_user_tok_s is not None})
    frontier: list[tuple[float, float]] = []
    for x, y in reversed(xy):  # throughput descending: keep a point only if it is faster per user than all kept
        if not frontier or y > frontier[-1][1]:
            frontier.append((x, y))
    return frontier[::-1]


def per_user_at(frontier: Sequence[tuple[float, float]], throughput: float) -> float | None:
    """Per-user speed on the frontier at `throughput` (linear between its points); None outside it."""
    if not frontier or not frontier[0][0] <= throughput <= frontier[-1][0]:
        return None
    for (x0, y0), (x1, y1) in itertools.pairwise(frontier):
        if x0 <= throughput <= x1:
            return y0 if x1 == x0 else y0 + (y1 - y0) * (throughput - x0) / (x1 - x0)
    return frontier[-1][1]


def matched_speedups(frontier: Sequence[tuple[float, float]], reference: Sequence[tuple[float, float]]) -> list[tuple[float, float]]:
    """(throughput, per-user speedup of `frontier` over `reference`) at every point of either
    frontier inside the throughput range both cover; [] when they do not overlap."""
    if not frontier or not reference:
        return []
    lo, hi = max(frontier[0][0], reference[0][0]), min(frontier[-1][0], reference[-1][0])
    if lo > hi:
        return []
    grid = sorted({x for x, _ in [*frontier, *reference] if lo <= x <= hi} | {lo, hi})
    out = []
    for x in grid:
        a, b = per_user_at(frontier, x), per_user_at(reference, x)
        if a is not None and b:
            out.append((x, a / b))
    return out


def throughput_at_sla(frontier: Sequence[tuple[float, float]], sla: float) -> float | None:
    """The most aggregate throughput at which per-user speed is still >= `sla`, along the
    frontier (interpolated between its points); None when no point reaches the SLA."""
    if not frontier or frontier[0][1] < sla:
        return None
    best = frontier[0][0]
    for (x0, y0), (x1, y1) in itertools.pairwise(frontier):
        if y1 >= sla:
            best = x1
            continue
        best = x0 + (x1 - x0) * (y0 - sla) / (y0 - y1)  # y0 >= sla > y1: where the segment crosses the SLA
        break
    return best


def first_concurrency_below(points: Sequence[ServingPoint], baseline: Sequence[ServingPoint]) -> float | None:
    """The lowest concurrency, among those both measured, where `points` has less aggregate
    throughput than `baseline`; None if it never does."""
    base = {p.concurrency: p.throughput_tok_s for p in baseline}
    below = [p.concurrency for p in points if p.concurrency in base and p.throughput_tok_s < base[p.concurrency]]
    return min(below) if below else None


# ---- the markdown summary --------------------------------------------------------------------


def _fmt(x: float | None, spec: str = ".1f") -> str:
    return "—" if x is None else format(x, spec)


def _table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    out = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" if i == 0 else "---:" for i in range(len(headers))) + "|"]
    return out + ["| " + " | ".join(r) + " |" for r in rows]


def summary_markdown(points: Sequence[ServingPoint], *, reference: str = REFERENCE_POLICY, baseline: str = BASELINE_POLICY,
                     slas: Sequence[float] = DEFAULT_SLAS) -> str:
    by = series(points)
    temps = sorted({t for _, t in by})
    policies = list(dict.fromkeys(p for p, _ in by))
    frontiers = {k: pareto_frontier(v) for k, v in by.items()}
    lines = ["## Serving benchmark summary", ""]

    lines += [f"### Per-user tokens/s at matched aggregate throughput, against `{reference}`", ""]
    rows = []
    for policy in policies:
        for t in temps:
            if (policy, t) not in by or policy == reference:
                continue
            ref = frontiers.get((reference, t))
            sp = matched_speedups(frontiers[(policy, t)], ref) if ref else []
            if not sp:
                rows.append([f"`{policy}`", f"{t:g}", "—", "—", "—", "—", "no overlap" if ref else f"no `{reference}` rows"])
                continue
            ratios = [r for _, r in sp]
            rows.append([f"`{policy}`", f"{t:g}", f"{sp[0][0]:.0f}–{sp[-1][0]:.0f}", f"{min(ratios):.2f}x",
                         f"{sum(ratios) / len(ratios):.2f}x", f"{max(ratios):.2f}x", f"{len(sp)} throughputs"])
    lines += _table(["policy", "T", "matched range (tok/s)", "min", "mean", "max", "over"], rows) + [""]

    lines += ["### Aggregate throughput (tok/s) at per-user SLAs", ""]
    rows = []
    for policy in policies:
        for t in temps:
            if (policy, t) not in by:
                continue
            cells = []
            for sla in slas:
                x = throughput_at_sla(frontiers[(policy, t)], sla)
                ref_x = throughput_at_sla(frontiers.get((reference, t), []), sla)
                ratio = f" ({x / ref_x:.2f}x)" if x is not None and ref_x and policy != reference else ""
                cells.append(_fmt(x, ".0f") + ratio)
            rows.append([f"`{policy}`", f"{t:g}", *cells])
    lines += _table(["policy", "T", *(f"≥ {s:g} tok/s/user" for s in slas)], rows)
    lines += ["", f"— : no measured load reaches the SLA; (x) : against `{reference}` at the same SLA.", ""]

    lines += [f"### Where each policy falls below `{baseline}` (aggregate throughput)", ""]
    rows = []
    for policy in policies:
        for t in temps:
            if (policy, t) not in by or policy == baseline:
                continue
            base = by.get((baseline, t))
            if not base:
                rows.append([f"`{policy}`", f"{t:g}", f"no `{baseline}` rows", "—"])
                continue
            c = first_concurrency_below(by[(policy, t)], base)
            shared = {p.concurrency: p for p in base}
            ratios = [p.throughput_tok_s / shared[p.concurrency].throughput_tok_s for p in by[(policy, t)]
                      if p.concurrency in shared and shared[p.concurrency].throughput_tok_s > 0]
            rows.append([f"`{policy}`", f"{t:g}", "never" if c is None else f"C = {c:g}",
                         f"{min(ratios):.2f}x" if ratios else "—"])
    lines += _table(["policy", "T", "first concurrency below", f"min throughput / `{baseline}`"], rows) + [""]

    lines += ["### Verification budget per request (draft tokens verified per round) by concurrency", ""]
    concurrencies = sorted({p.concurrency for p in points})
    rows = []
    for policy in policies:
        for t in temps:
            at = {p.concurrency: p.verify_tokens_per_request for p in by.get((policy, t), [])}
            if at:
                rows.append([f"`{policy}`", f"{t:g}", *(_fmt(at.get(c), ".2f") for c in concurrencies)])
    lines += _table(["policy", "T", *(f"C={c:g}" for c in concurrencies)], rows) + [""]
    return "\n".join(lines)


# ---- figures ---------------------------------------------------------------------------------


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


_LINESTYLES = ("-", "--", ":", "-.")


def _styles(points: Sequence[ServingPoint]) -> tuple[dict[str, str], dict[float, str]]:
    plt = _pyplot()
    policies = list(dict.fromkeys(p.policy for p in points))
    colors = plt.get_cmap("tab10").colors
    temps = sorted({p.temperature for p in points})
    return ({p: colors[i % len(colors)] for i, p in enumerate(policies)},
            {t: _LINESTYLES[i % len(_LINESTYLES)] for i, t in enumerate(temps)})


def plot_frontier(points: Sequence[ServingPoint], path: str | Path) -> Path:
    """Fig. 7: aggregate throughput (y) against per-user tokens/s (x), concurrency labelled."""
    plt = _pyplot()
    color, style = _styles(points)
    fig, ax = plt.subplots(figsize=(7.5, 5.5))
    for (policy, t), pts in series(points).items():
        pts = [p for p in pts if p.per_user_tok_s is not None]
        if not pts:
            continue
        ax.plot([p.per_user_tok_s for p in pts], [p.throughput_tok_s for p in pts], style[t], marker="o", ms=4,
                color=color[policy], label=f"{policy}, T={t:g}")
        for p in pts:
            ax.annotate(f"{p.concurrency:g}", (p.per_user_tok_s, p.throughput_tok_s), textcoords="offset points",
                        xytext=(3, 3), fontsize=7, color=color[policy])
    ax.set_xlabel("tokens/s per user (1 / mean time per output token)")
    ax.set_ylabel("aggregate output tokens/s")
    ax.set_title("Throughput-interactivity frontier (labels: concurrency)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_budget(points: Sequence[ServingPoint], path: str | Path) -> Path:
    """Fig. 8: verification budget per request, and aggregate throughput, against concurrency."""
    plt = _pyplot()
    color, style = _styles(points)
    fig, (ax_budget, ax_tp) = plt.subplots(1, 2, figsize=(12, 4.8))
    for (policy, t), pts in series(points).items():
        kw = {"color": color[policy], "marker": "o", "ms": 4, "label": f"{policy}, T={t:g}"}
        budget = [p for p in pts if p.verify_tokens_per_request is not None]
        if budget:
            ax_budget.plot([p.concurrency for p in budget], [p.verify_tokens_per_request for p in budget], style[t], **kw)
        ax_tp.plot([p.concurrency for p in pts], [p.throughput_tok_s for p in pts], style[t], **kw)
    concurrencies = sorted({p.concurrency for p in points})
    for ax, ylabel in ((ax_budget, "draft tokens verified per round per request"), (ax_tp, "aggregate output tokens/s")):
        if concurrencies and concurrencies[0] > 0:
            ax.set_xscale("log", base=2)
        ax.set_xticks(concurrencies, [f"{c:g}" for c in concurrencies])
        ax.set_xlabel("concurrent requests")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
    ax_budget.set_title("Verification budget per request")
    ax_tp.set_title("Aggregate throughput")
    ax_tp.legend(fontsize=8)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def write_report(csv_path: str | Path, out_dir: str | Path, *, reference: str = REFERENCE_POLICY,
                 baseline: str = BASELINE_POLICY, slas: Sequence[float] = DEFAULT_SLAS) -> tuple[list[Path], str]:
    """Both figures and the summary markdown into `out_dir`; returns (files written, the markdown)."""
    points = load_points(csv_path)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    markdown = summary_markdown(points, reference=reference, baseline=baseline, slas=slas)
    summary = out / "serving_summary.md"
    summary.write_text(markdown + "\n")
    return [plot_frontier(points, out / "serving_frontier.png"), plot_budget(points, out / "serving_budget.png"), summary], markdown
