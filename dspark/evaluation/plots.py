"""PNG figures of an offline evaluation, drawn from its results file alone (matplotlib, Agg).

    fig2_position_acceptance.png  P(accept k | accepted k-1) against k, one panel per domain
    fig4_block_size.png           mean τ against γ (runs of one label at several γ, or labels
                                  of one drafter checkpointed at several blocks)
    fig5_threshold_sweep.png      acceptance rate and τ against a static confidence threshold
    fig6_reliability.png          conditional c_k against acceptance, and a_k against prefix
                                  survival per position
Each figure is drawn only when the results hold its data; all at the primary temperature.

    write_plots(json.load(open("docs/results/offline_eval.json")), "docs/results/")
"""

from __future__ import annotations

from pathlib import Path


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _primary_runs(results: dict, *, main_gamma_only: bool = True) -> list[dict]:
    return [r for r in results["runs"] if r["temperature"] == results["temperature"]
            and (not main_gamma_only or r["requested_gamma"] == results["block_size"])]


def _panels(runs: list[dict]) -> list[str]:
    domains = list(dict.fromkeys(d for r in runs for d in r["domains"] if d != "all"))
    return domains + ["all"] if len(domains) != 1 else ["all"]


def _xy(xs, ys):
    pairs = [(x, y) for x, y in zip(xs, ys) if y is not None and x is not None]
    return [p[0] for p in pairs], [p[1] for p in pairs]


def plot_position_acceptance(results: dict, path: Path) -> Path | None:
    runs = _primary_runs(results)
    if not runs:
        return None
    plt = _pyplot()
    panels = _panels(runs)
    fig, axes = plt.subplots(1, len(panels), figsize=(3.6 * len(panels), 3.2), squeeze=False)
    for ax, domain in zip(axes[0], panels):
        for r in runs:
            rate = r["domains"].get(domain, {}).get("position_acceptance", {}).get("rate", [])
            xs, ys = _xy(range(1, len(rate) + 1), rate)
            if ys:
                ax.plot(xs, ys, marker="o", markersize=3, label=r["label"])
        ax.set(title=domain, xlabel="draft position k", ylabel="P(accept k | accepted k-1)", ylim=(0, 1.02))
        ax.xaxis.set_major_locator(_integer_ticks())
        ax.legend(fontsize=7)
    fig.suptitle(f"Position-wise acceptance, T={results['temperature']:g}")
    return _save(fig, plt, path)


def plot_block_size(results: dict, path: Path) -> Path | None:
    runs = _primary_runs(results, main_gamma_only=False)
    series: dict[str, dict[int, float]] = {}
    for r in runs:  # one label at several γ (--block-sizes)
        series.setdefault(r["label"], {})[r["gamma"]] = r["domains"]["all"]["tau"]
    by_name: dict[str, dict[int, float]] = {}
    for r in _primary_runs(results):  # several checkpoints of one drafter, each at its own block
        by_name.setdefault(r["drafter"], {})[r["gamma"]] = r["domains"]["all"]["tau"]
    series.update({f"{name} (checkpoints)": points for name, points in by_name.items() if len(points) > 1})
    series = {k: v for k, v in series.items() if len([t for t in v.values() if t is not None]) > 1}
    if not series:
        return None
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(4.2, 3.4))
    for label, points in series.items():
        xs, ys = _xy(sorted(points), [points[g] for g in sorted(points)])
        ax.plot(xs, ys, marker="o", label=label)
    ax.set(xlabel="block size γ", ylabel="mean accepted length τ", title=f"τ against block size, T={results['temperature']:g}")
    ax.xaxis.set_major_locator(_integer_ticks())
    ax.legend(fontsize=7)
    return _save(fig, plt, path)


def plot_threshold_sweep(results: dict, path: Path) -> Path | None:
    runs = [r for r in _primary_runs(results) if "threshold_sweep" in r["domains"]["all"]]
    if not runs:
        return None
    plt = _pyplot()
    panels = _panels(runs)
    fig, axes = plt.subplots(2, len(panels), figsize=(3.6 * len(panels), 6.0), squeeze=False)
    for col, domain in enumerate(panels):
        for r in runs:
            sweep = r["domains"].get(domain, {}).get("threshold_sweep", {}).get("conditional")
            if not sweep:
                continue
            for row, field in enumerate(("acceptance_rate", "accepted_length")):
                xs, ys = _xy(sweep["thresholds"], sweep[field])
                axes[row][col].plot(xs, ys, marker="o", markersize=3, label=r["label"])
        axes[0][col].set(title=domain, ylabel="acceptance rate of verified drafts", ylim=(0, 1.02))
        axes[1][col].set(xlabel="static threshold C on c_k", ylabel="accepted length τ_C")
        axes[0][col].legend(fontsize=7)
    fig.suptitle(f"Static confidence threshold, T={results['temperature']:g}")
    return _save(fig, plt, path)


def plot_reliability(results: dict, path: Path) -> Path | None:
    runs = [r for r in _primary_runs(results) if "reliability" in r["domains"]["all"]]
    if not runs:
        return None
    plt = _pyplot()
    num_positions = max(len(r["domains"]["all"]["reliability"]["positions"]) for r in runs)
    panels = 1 + num_positions
    cols = min(panels, 4)
    rows = -(-panels // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(3.2 * cols, 3.2 * rows), squeeze=False)
    for i in range(rows * cols):
        ax = axes[i // cols][i % cols]
        if i >= panels:
            ax.axis("off")
            continue
        ax.plot([0, 1], [0, 1], color="0.7", linestyle="--", linewidth=1)
        for r in runs:
            rel = r["domains"]["all"]["reliability"]
            diagram = rel["conditional"] if i == 0 else (rel["positions"][i - 1] if i - 1 < len(rel["positions"]) else None)
            if not diagram or not diagram["n"]:
                continue
            xs, ys = _xy(diagram["mean_confidence"], diagram["observed_rate"])
            ece = f"{100 * diagram['ece']:.1f}%" if diagram["ece"] is not None else "-"
            ax.plot(xs, ys, marker="o", markersize=3, label=f"{r['label']} (ECE {ece})")
        if i == 0:
            ax.set(title="all positions: c_k", xlabel="conditional confidence c_k", ylabel="accepted | prefix accepted")
        else:
            ax.set(title=f"position {i}: a_k", xlabel="predicted a_k = Π c_i", ylabel="observed prefix survival")
        ax.set(xlim=(0, 1), ylim=(0, 1))
        ax.legend(fontsize=7, loc="upper left")
    fig.suptitle(f"Reliability, T={results['temperature']:g}")
    return _save(fig, plt, path)


def write_plots(results: dict, out_dir: str | Path) -> list[Path]:
    """Every figure the results have data for, as PNG files in `out_dir`."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    figures = [
        (plot_position_acceptance, "fig2_position_acceptance.png"),
        (plot_block_size, "fig4_block_size.png"),
        (plot_threshold_sweep, "fig5_threshold_sweep.png"),
        (plot_reliability, "fig6_reliability.png"),
    ]
    return [p for fn, name in figures if (p := fn(results, out / name)) is not None]


def _integer_ticks():
    from matplotlib.ticker import MaxNLocator

    return MaxNLocator(integer=True)


def _save(fig, plt, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return Path(path)


__all__ = ["plot_block_size", "plot_position_acceptance", "plot_reliability", "plot_threshold_sweep", "write_plots"]
