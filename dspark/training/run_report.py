"""Compare training runs by what they logged: held-out acceptance at the end and along the way.

    dspark runs dspark-1L=runs/sweep/dspark-l1 dflash-1L=runs/sweep/dflash-l1 eagle3=runs/sweep/eagle3 \\
        --reference dflash-1L --out docs/results/training_runs.json --plot docs/results/training_runs.png

Reads each run directory's train_config.json and metrics.jsonl (trainer.py): the "end" line's
held-out τ and c*_k (heldout.py, the analytic acceptance at temperature 1 on sequences no run
trained on), its wall time and label tokens, and the "eval" lines as a curve of τ over steps.
Prints a markdown table with each run's τ relative to the reference, writes JSON, and plots
the curves: the figure that says whether a margin comes from the method or from the budget.

Runs at several block sizes (the paper's Fig. 4) are each divided by the reference's kind of run
(its algorithm, depth and head rank) at their own block size, since τ grows with γ by itself,
and the plot gains τ and that ratio against γ.
"""

from __future__ import annotations

import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from dspark.training.trainer import CONFIG_FILE, read_metrics


@dataclass(frozen=True)
class RunSummary:
    label: str
    run_dir: str
    algo: str
    layers: int
    block_size: int
    markov_rank: int | None  # DSpark's head rank; None for the other algorithms
    steps: int
    wall_s: float | None
    label_tokens: int | None
    heldout_tau: float | None
    heldout_acc_per_pos: list[float] | None
    curve: list[tuple[int, float]]  # (step, held-out τ) of the "eval" lines


def read_run(label: str, run_dir: str | Path) -> RunSummary:
    run = Path(run_dir)
    config = json.loads((run / CONFIG_FILE).read_text())
    log = read_metrics(run)
    end = next((e for e in reversed(log) if e.get("event") == "end"), None)
    if end is None:
        raise ValueError(f"{run}: training has not finished (no 'end' line in metrics.jsonl)")
    curve = [(e["step"], e["tau"]) for e in log if e.get("event") == "eval"]
    heldout = end.get("heldout") or {}
    return RunSummary(label=label, run_dir=str(run), algo=config["algo"], layers=config["layers"], block_size=config["block_size"],
                      markov_rank=config.get("markov_rank") if config["algo"] == "dspark" else None,
                      steps=end["steps"], wall_s=end.get("wall_s"), label_tokens=end.get("label_tokens"),
                      heldout_tau=heldout.get("tau"), heldout_acc_per_pos=heldout.get("acc_per_pos"), curve=curve)


def _kind(r: RunSummary) -> tuple[str, int, int | None]:
    return r.algo, r.layers, r.markov_rank


def reference_for(run: RunSummary, runs: list[RunSummary], reference: str | None) -> RunSummary | None:
    """The run `run` is compared with: the reference's kind of run at `run`'s block size."""
    ref = next((r for r in runs if r.label == reference), None)
    if ref is None or ref.block_size == run.block_size:
        return ref
    return next((r for r in runs if _kind(r) == _kind(ref) and r.block_size == run.block_size), None)


def tau_ratio(run: RunSummary, runs: list[RunSummary], reference: str | None) -> float | None:
    ref = reference_for(run, runs, reference)
    return run.heldout_tau / ref.heldout_tau if ref and run.heldout_tau and ref.heldout_tau else None


def markdown_table(runs: list[RunSummary], reference: str | None) -> str:
    ref = next((r for r in runs if r.label == reference), None)
    several_gammas = len({r.block_size for r in runs}) > 1
    gamma = max(r.block_size for r in runs)
    ratio_head = "τ / ref"
    if ref:
        ratio_head = f"τ / {ref.algo} {ref.layers}L, same γ" if several_gammas else f"τ / {ref.label}"
    head = ["run", "algo", "layers", "γ", "steps", "wall min", "held-out τ", ratio_head]
    head += [f"c*_{k}" for k in range(1, gamma + 1)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * 2 + "---:|" * (len(head) - 2)]
    for r in runs:
        acc = (r.heldout_acc_per_pos or []) + [None] * (gamma - len(r.heldout_acc_per_pos or []))
        cells = [r.label, r.algo, str(r.layers), str(r.block_size), str(r.steps), _fmt(r.wall_s / 60 if r.wall_s else None, 1),
                 _fmt(r.heldout_tau, 3), _fmt(tau_ratio(r, runs, reference), 3)] + [_fmt(a, 3) for a in acc]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _fmt(x: float | None, digits: int) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def plot_curves(runs: list[RunSummary], path: str | Path, reference: str | None = None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    several_gammas = len({r.block_size for r in runs}) > 1
    fig, axes = plt.subplots(1, 3 if several_gammas else 1, figsize=(16, 4.2) if several_gammas else (6.4, 4.0), squeeze=False)
    if several_gammas:
        _plot_against_block_size(runs, reference, axes[0][0], axes[0][1])
    ax = axes[0][-1]
    for r in runs:
        if r.curve:
            steps, taus = zip(*r.curve)
            ax.plot(steps, taus, marker="o", markersize=3, label=r.label)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("held-out τ (analytic, T = 1)")
    ax.set_title("Held-out accepted length during training")
    ax.grid(alpha=0.3)
    if ax.lines:  # runs trained without --eval-every have no curve
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _plot_against_block_size(runs: list[RunSummary], reference: str | None, tau_ax, ratio_ax) -> None:
    """Fig. 4: held-out τ and τ / reference at each block size, one line per kind of run."""
    kinds: dict[tuple[str, int, int | None], list[RunSummary]] = {}
    for r in runs:
        kinds.setdefault(_kind(r), []).append(r)
    for (algo, layers, rank), group in kinds.items():
        group = sorted((r for r in group if r.heldout_tau is not None), key=lambda r: r.block_size)
        name = f"{algo} {layers}L" + (f" r{rank}" if rank is not None else "")
        tau_ax.plot([r.block_size for r in group], [r.heldout_tau for r in group], marker="o", label=name)
        ratios = [(r.block_size, tau_ratio(r, runs, reference)) for r in group]
        ratios = [(g, x) for g, x in ratios if x is not None]
        if ratios:
            ratio_ax.plot(*zip(*ratios), marker="o", label=name)
    ref = next((r for r in runs if r.label == reference), None)
    for ax, ylabel in ((tau_ax, "held-out τ (analytic, T = 1)"),
                       (ratio_ax, f"τ / {ref.algo} {ref.layers}L at the same γ" if ref else "τ / reference")):
        ax.set_xlabel("block size γ")
        ax.set_ylabel(ylabel)
        ax.set_xticks(sorted({r.block_size for r in runs}))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    tau_ax.set_title("Accepted length against block size")
    ratio_ax.set_title("Margin against block size")


def cmd_runs(args) -> int:
    runs = []
    for item in args.runs:
        label, _, path = item.rpartition("=")
        path = path or item
        try:
            runs.append(read_run(label or Path(path).name, path))
        except (FileNotFoundError, ValueError, KeyError) as e:
            print(f"error: {item}: {e}", file=sys.stderr)
            return 2
    if args.reference and args.reference not in {r.label for r in runs}:
        print(f"error: --reference {args.reference!r} is not one of the runs' labels", file=sys.stderr)
        return 2
    print(markdown_table(runs, args.reference))
    if args.out:
        payload: dict[str, Any] = {"reference": args.reference, "runs": [asdict(r) | {"tau_over_reference": tau_ratio(r, runs, args.reference)} for r in runs]}
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(payload, indent=1) + "\n")
    if args.plot:
        plot_curves(runs, args.plot, args.reference)
    return 0


__all__ = ["RunSummary", "cmd_runs", "markdown_table", "plot_curves", "read_run", "reference_for", "tau_ratio"]
