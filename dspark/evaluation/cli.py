"""`dspark eval`: the paper's offline evaluation (accepted length per benchmark, Figs. 2-6).

    dspark eval --drafter dspark=runs/dspark/final --drafter dflash=runs/dflash/final \\
        --drafter eagle3=runs/eagle3/final --limit 20 --temperature 1,0 --gamma 7 \\
        --max-new-tokens 256 --out docs/results/offline_eval.json --plots docs/results/
    dspark eval --drafter d1@dspark=runs/d1 --drafter d2@dspark=runs/d2 ...   # depth (Fig. 3): labelled rows
    dspark eval --drafter ngram --block-sizes 4,8,12,16 ...                    # block size (Fig. 4)

Writes the results JSON, PNG figures, and prints the Table 1 markdown to stdout. Finished
(drafter, temperature, γ, benchmark) results are cached in --work-dir, so an interrupted run
resumes and a rerun with more drafters only runs the new ones.
`add_eval_parser(subparsers)` registers the command on dspark/cli.py's parser.
"""

from __future__ import annotations

import sys
from pathlib import Path

from dspark.cli_args import comma_floats, comma_ints, comma_names


def add_eval_parser(subparsers) -> None:
    from dspark.evaluation.acceptance import DEFAULT_THRESHOLDS
    from dspark.evaluation.prompts import BENCHMARKS
    from dspark.model import target_runtime

    e = subparsers.add_parser("eval", help="offline evaluation: accepted length per benchmark (paper Table 1, Figs. 2-6)")
    e.add_argument("--drafter", action="append", required=True, metavar="[LABEL@]NAME[=PATH]",
                   help="a drafter to evaluate (repeat for several); the first is the reference of the printed gains")
    e.add_argument("--benchmarks", type=comma_names, default=BENCHMARKS, help=f"comma-separated subset of {','.join(BENCHMARKS)}")
    e.add_argument("--limit", type=int, default=10, help="prompts per benchmark (every turn of each is generated)")
    e.add_argument("--temperature", type=comma_floats, default=(1.0, 0.0), help="comma-separated temperatures, e.g. 0,1")
    e.add_argument("--gamma", type=int, default=7, help="draft tokens per round (block size) of Table 1")
    e.add_argument("--block-sizes", type=comma_ints, default=(), help="extra γ values for the block-size sweep, e.g. 4,8,12,16")
    e.add_argument("--max-new-tokens", type=int, default=256)
    e.add_argument("--seed", type=int, default=0, help="base seed; every request's seed derives from it")
    e.add_argument("--batch-size", type=int, default=8, help="requests per engine step (results do not depend on it)")
    e.add_argument("--thresholds", type=comma_floats, default=DEFAULT_THRESHOLDS, help="static confidence thresholds (Fig. 5)")
    e.add_argument("--out", default="docs/results/offline_eval.json", help="results JSON")
    e.add_argument("--plots", default=None, help="directory for the PNG figures (default: the --out directory)")
    e.add_argument("--no-plots", action="store_true")
    e.add_argument("--work-dir", default="runs/eval", help="cache of finished benchmark results (resume)")
    e.add_argument("--no-cache", action="store_true", help="recompute everything; do not read or write --work-dir")
    e.add_argument("--no-progress", action="store_true")
    e.add_argument("--model", default="smollm2-135m-instruct", help="target: the default model's name or a local HF directory")
    dtypes = [d for d in getattr(target_runtime, "DTYPE_CHOICES", ("bfloat16", "float32")) if d != "float16"]
    e.add_argument("--dtype", default=dtypes[0], choices=dtypes,
                   help="compute dtype of the target's linear layers (auto, where offered: bf16 where the hardware has it)")
    e.add_argument("--kv-budget-mb", type=int, default=4096)
    e.set_defaults(func=cmd_eval)


def cmd_eval(args) -> int:
    from dspark.evaluation.offline_eval import DrafterSpec, EvalConfig, run_offline_eval, write_results
    from dspark.evaluation.report import render_report
    from dspark.model import target_runtime
    from dspark.model.model_store import resolve_model_dir
    from dspark.model.target_runtime import TargetConfig, TargetRuntime
    from dspark.model.tokenizer import Tokenizer

    # the dtype that really runs ("auto" resolves per machine), recorded in the results and the cache key
    dtype = getattr(target_runtime, "resolve_dtype", lambda d: d)(args.dtype)
    try:
        config = EvalConfig(
            drafters=tuple(DrafterSpec.parse(d) for d in args.drafter), benchmarks=tuple(args.benchmarks), limit=args.limit,
            temperatures=tuple(args.temperature), gamma=args.gamma, block_sizes=tuple(args.block_sizes),
            max_new_tokens=args.max_new_tokens, seed=args.seed, batch_size=args.batch_size, thresholds=tuple(args.thresholds),
            target=args.model, target_dtype=dtype,
        )
        tokenizer = Tokenizer(resolve_model_dir(args.model))

        def load_runtime(capture_layers):
            return TargetRuntime.load(TargetConfig(model=args.model, dtype=dtype, kv_budget_mb=args.kv_budget_mb,
                                                   capture_layers=capture_layers))

        results = run_offline_eval(config, load_runtime=load_runtime, tokenizer=tokenizer,
                                   work_dir=None if args.no_cache else Path(args.work_dir), progress=not args.no_progress)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    out = write_results(results, args.out)
    print(render_report(results))
    print(f"\nresults: {out}", file=sys.stderr)
    if not args.no_plots:
        try:
            from dspark.evaluation.plots import write_plots

            for png in write_plots(results, args.plots or out.parent):
                print(f"figure: {png}", file=sys.stderr)
        except ImportError as e:  # matplotlib is an optional dependency (pip install -e '.[bench]')
            print(f"no figures: {e}", file=sys.stderr)
    return 0


__all__ = ["add_eval_parser", "cmd_eval"]
