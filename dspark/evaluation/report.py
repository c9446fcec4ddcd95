"""Markdown tables of an offline evaluation's results (offline_eval.build_results), like the paper's.

    table 1: rows drafter x temperature (at the main γ), columns the benchmarks + their mean τ
    gains:   the first drafter's mean τ over each other's, overall and per domain
    block:   rows drafter x temperature, columns γ, cells mean τ (Fig. 4), when several γ ran

    print(render_report(json.load(open("docs/results/offline_eval.json"))))
"""

from __future__ import annotations

from dspark.evaluation.offline_eval import DOMAINS


def _cell(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def render_table(results: dict) -> str:
    """Table 1: mean accepted length per round (bonus included) per benchmark."""
    benches = results["config"]["benchmarks"]
    gamma = results["config"]["gamma"]
    lines = [
        "| drafter | T | γ | " + " | ".join(benches) + " | mean |",
        "|---|---:|---:|" + "---:|" * (len(benches) + 1),
    ]
    for run in _main_runs(results):
        taus = [run["benchmarks"].get(b, {}).get("tau") for b in benches]
        gamma_cell = str(run["gamma"]) if run["gamma"] == gamma else f"{run['gamma']} (of {gamma})"
        lines.append(f"| {run['label']} | {run['temperature']:g} | {gamma_cell} | "
                     + " | ".join(_cell(t) for t in taus) + f" | {_cell(run['domains']['all']['tau'])} |")
    return "\n".join(lines)


def render_gains(results: dict) -> str:
    """The first drafter's mean τ divided by each other drafter's, per temperature (overall and per domain)."""
    runs = _main_runs(results)
    labels = list(dict.fromkeys(r["label"] for r in runs))
    if len(labels) < 2:
        return ""
    lines = []
    for t in dict.fromkeys(r["temperature"] for r in runs):
        by_label = {r["label"]: r for r in runs if r["temperature"] == t}
        ref = by_label.get(labels[0])
        if ref is None:
            continue
        for other in labels[1:]:
            run = by_label.get(other)
            if run is None:
                continue
            parts = [f"{name} {_ratio(ref['domains'].get(name), run['domains'].get(name))}"
                     for name in (*DOMAINS, "all") if name in ref["domains"]]
            lines.append(f"T={t:g}: {labels[0]} / {other}: " + ", ".join(parts))
    return "\n".join(lines)


def render_block_sizes(results: dict) -> str:
    """Mean τ against γ (Fig. 4), when more than one γ ran."""
    gammas = sorted({r["gamma"] for r in results["runs"]})
    if len(gammas) < 2:
        return ""
    lines = ["| drafter | T | " + " | ".join(f"γ={g}" for g in gammas) + " |", "|---|---:|" + "---:|" * len(gammas)]
    rows: dict[tuple[str, float], dict[int, float | None]] = {}
    for r in results["runs"]:
        rows.setdefault((r["label"], r["temperature"]), {})[r["gamma"]] = r["domains"]["all"]["tau"]
    for (label, t), cells in rows.items():
        lines.append(f"| {label} | {t:g} | " + " | ".join(_cell(cells.get(g)) if g in cells else "n/a" for g in gammas) + " |")
    return "\n".join(lines)


def render_report(results: dict) -> str:
    parts = [
        (f"Offline accepted length τ per round (bonus included), target {results['target']}, "
         f"{results['prompts_per_benchmark']} prompts per benchmark, chain drafts, scheduler off"),
        "", render_table(results),
    ]
    gains = render_gains(results)
    if gains:
        parts += ["", gains]
    block = render_block_sizes(results)
    if block:
        parts += ["", "Mean τ against block size γ", "", block]
    if results.get("unsupported"):
        skipped = {(u["label"], u["gamma"]): u["reason"] for u in results["unsupported"]}  # same at every temperature
        parts += ["", "Not run: " + "; ".join(f"{label} γ={g} ({why})" for (label, g), why in skipped.items())]
    disagree = [b for b, ok in results.get("greedy_outputs_agree", {}).items() if not ok]
    if disagree:
        against = results.get("greedy_reference") or "each other"
        parts += ["", f"WARNING: greedy outputs differ from {against} on {disagree} (expected identical: lossless)"]
    return "\n".join(parts)


def _main_runs(results: dict) -> list[dict]:
    return [r for r in results["runs"] if r["requested_gamma"] == results["config"]["gamma"]]


def _ratio(a: dict | None, b: dict | None) -> str:
    if not a or not b or a.get("tau") is None or not b.get("tau"):
        return "-"
    return f"{a['tau'] / b['tau']:.3f}"


__all__ = ["render_block_sizes", "render_gains", "render_report", "render_table"]
