"""`dspark cache`, `dspark train`, `dspark calibrate`: the drafter training pipeline's commands.

    dspark cache --data-dir D --out C [--split all] [--dtype float16]           # target features, once
    dspark train --cache C --out RUN --steps 2000 [--batch-seqs 8] [--resume]   # RUN/final
    dspark train --algo dflash|eagle3 --cache C --out RUN ...                   # the baselines, same cache
    dspark calibrate --drafter RUN/final --cache C --out RUN/final              # STS -> sts.json + PNG
    dspark heldout --drafter RUN/final --algo dspark --cache C                  # held-out τ, c*_k (no target run)
    dspark runs A=RUN_A B=RUN_B --reference B --plot runs.png                   # compare finished runs

`add_train_parsers(subparsers)` registers the subcommands on dspark/cli.py's parser.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from dspark.serving_config import WEIGHT_CHOICES


def _add_model_args(p: argparse.ArgumentParser, *, default_model: str | None) -> None:
    p.add_argument("--model", default=default_model,
                   help="target: the default model's name or a local HF directory" + ("" if default_model else " (default: the one the cache was built with)"))
    p.add_argument("--target-dtype", default="auto", choices=["auto", "bfloat16", "float32"], help="compute dtype of the target's linear layers")
    p.add_argument("--kv-budget-mb", type=int, default=4096)
    p.add_argument("--target-weights", default="auto", choices=WEIGHT_CHOICES,
                   help="how the target holds its linear layers (TargetConfig.weights); `dspark cache` defaults to "
                        "dense: its whole-sequence prefills run 2x faster on oneDNN's dense GEMM than on the compact "
                        "kernel, whose strength is few rows (the features differ from compact ones only in rounding)")


def _resolve_device(name: str) -> str:
    import torch

    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return name


def _load_runtime(model: str, dtype: str, kv_budget_mb: int, capture_layers=None, weights: str = "auto"):
    from dspark.model.target_runtime import TargetConfig, TargetRuntime

    return TargetRuntime.load(TargetConfig(model=model, dtype=dtype, kv_budget_mb=kv_budget_mb, weights=weights,
                                           capture_layers=tuple(capture_layers) if capture_layers else None))


def cmd_cache(args) -> int:
    from dspark.training.target_cache import build_cache, read_responses

    records = read_responses(args.data_dir, split=args.split)
    if args.shortest_prompts_first:  # ties by id: the order (and so the shard plan) is a function of the data
        records = sorted(records, key=lambda r: (len(r.prompt_ids), r.id))
    records = records[args.skip_sequences:]
    if args.max_sequences is not None:
        records = records[: args.max_sequences]
    if not records:
        print(f"error: no {args.split!r} sequences in {args.data_dir}", file=sys.stderr)
        return 2
    layers = [int(x) for x in args.capture_layers.split(",")] if args.capture_layers else None
    runtime = _load_runtime(args.model, args.target_dtype, args.kv_budget_mb, layers, weights=args.target_weights)
    stats = build_cache(runtime, records, args.out, dtype=args.dtype, shard_tokens=args.shard_tokens,
                        batch_tokens=args.batch_tokens, model_name=args.model, progress=not args.no_progress,
                        lm_head_weight=runtime.model.lm_head_weight)
    rate = stats.written_tokens / stats.seconds if stats.seconds > 0 else float("nan")
    print(json.dumps({"sequences": stats.sequences, "tokens": stats.tokens, "written_tokens": stats.written_tokens,
                      "bytes_per_token": stats.bytes_per_token, "seconds": round(stats.seconds, 2),
                      "tokens_per_s": round(rate, 1)}))
    return 0


def _target_for_cache(cache, model: str | None, dtype: str):
    """The target model whose embedding / LM head the drafter shares (named by the cache by default)."""
    from dspark.model.model_store import resolve_model_dir
    from dspark.model.transformer import Transformer

    name = model or cache.meta.get("model")
    if not name:
        raise ValueError("the cache does not name its model; pass --model")
    import torch

    return Transformer.from_dir(resolve_model_dir(name), compute_dtype=torch.bfloat16 if dtype == "bfloat16" else torch.float32)


def _resolve_precision(precision: str) -> str:
    if precision != "auto":
        return precision
    from dspark.model.target_runtime import resolve_dtype

    return "bf16" if resolve_dtype("auto") == "bfloat16" else "fp32"


def cmd_train(args) -> int:
    from dspark.drafters.registry import family
    from dspark.drafters.shared import SharedWeights
    from dspark.training.target_cache import TargetCache
    from dspark.training.trainer import TrainConfig, train

    try:
        config = TrainConfig(
            algo=args.algo, steps=args.steps, epochs=args.epochs, batch_seqs=args.batch_seqs, anchors_per_seq=args.anchors_per_seq,
            max_batch_tokens=args.max_batch_tokens, lr=args.lr, warmup=args.warmup, weight_decay=args.weight_decay,
            grad_clip=args.grad_clip, layers=args.layers if args.layers is not None else family(args.algo).objective.default_layers,
            block_size=args.block_size, markov_rank=args.markov_rank,
            head=args.head, seed=args.seed, split=args.split, checkpoint_every=args.checkpoint_every,
            eval_every=args.eval_every, precision=_resolve_precision(args.precision),
            draft_vocab_size=args.draft_vocab_size, init_from=args.init_from, eval_sequences=args.eval_sequences,
        )
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    cache = TargetCache(args.cache)
    eval_cache = TargetCache(args.eval_cache) if args.eval_cache else None
    target = _target_for_cache(cache, args.model, args.target_dtype)
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    result = train(config, cache=cache, target_config=target.config, shared=SharedWeights.from_target(target),
                   run_dir=args.out, resume=args.resume, device=_resolve_device(args.device), progress=not args.no_progress,
                   eval_cache=eval_cache)
    print(json.dumps({**result.summary, "final": str(result.final_dir)}))
    return 0


def cmd_heldout(args) -> int:
    """Evaluate a trained drafter checkpoint on a cache's held-out split (what training logs at its end)."""
    from dspark.drafters.shared import SharedWeights
    from dspark.training.heldout import evaluate_heldout
    from dspark.training.target_cache import TargetCache
    from dspark.drafters.registry import family

    cache = TargetCache(args.cache)
    target = _target_for_cache(cache, args.model, args.target_dtype)
    device = _resolve_device(args.device)
    algo = family(args.algo)
    try:
        model = algo.load(Path(args.drafter), shared=SharedWeights.from_target(target), device=device)
    except (FileNotFoundError, ValueError, KeyError) as e:
        print(f"error: cannot load a {args.algo} drafter from {args.drafter}: {e}", file=sys.stderr)
        return 2
    block_size = model.config.block_size
    result = evaluate_heldout(algo.objective, model, cache, split=args.split, block_size=block_size, anchors_per_seq=args.anchors_per_seq,
                              batch_seqs=args.batch_seqs, seed=args.seed, max_sequences=args.max_sequences, device=device,
                              precision=_resolve_precision(args.precision))
    if result is None:
        print(f"error: no {args.split!r} sequences with an anchor in {args.cache}", file=sys.stderr)
        return 2
    print(json.dumps({"drafter": args.drafter, "algo": args.algo, "block_size": block_size, **result.to_dict()}))
    return 0


def _cmd_runs(args) -> int:
    from dspark.training.run_report import cmd_runs

    return cmd_runs(args)


def cmd_calibrate(args) -> int:
    from dspark.calibration.collect import calibrate, collect_acceptance
    from dspark.drafters.dspark.checkpoint import load_checkpoint
    from dspark.drafters.shared import SharedWeights
    from dspark.training.target_cache import TargetCache

    cache = TargetCache(args.cache)
    model = args.model or cache.meta.get("model")
    if not model:
        print("error: the cache does not name its model; pass --model", file=sys.stderr)
        return 2
    runtime = _load_runtime(model, args.target_dtype, args.kv_budget_mb, weights=args.target_weights)
    device = _resolve_device(args.device)
    drafter = load_checkpoint(args.drafter, shared=SharedWeights.from_target(runtime.model), device=device).drafter
    if device != "cpu":
        embed = runtime.model.embed.weight.detach().to(device)
        drafter.attach_shared(SharedWeights(embed=embed, lm_head=runtime.model.lm_head_weight.detach().to(device)))
    data = collect_acceptance(drafter, runtime, cache, split=args.split, anchors_per_seq=args.anchors_per_seq,
                              batch_seqs=args.batch_seqs, temperature=args.temperature, seed=args.seed,
                              max_sequences=args.max_sequences, progress=not args.no_progress)
    out = Path(args.out or args.drafter)
    regime = "greedy" if args.temperature == 0 else "sampled"  # greedy requests get their own fit
    report = calibrate(data, out_dir=out, block_size=drafter.config.block_size, regime=regime,
                       title=f"STS on {data.num_blocks} held-out blocks, temperature {args.temperature}")
    print(report.table)
    print(f"temperatures -> {out / 'sts.json'}, reliability diagram -> {report.png}")
    return 0


def cmd_export(args) -> int:
    """Re-store a DSpark checkpoint (e.g. bf16 to ship it in half the bytes), STS temperatures included."""
    from dspark.drafters.dspark.checkpoint import export_checkpoint
    from dspark.drafters.dspark.config import DSparkConfig
    from dspark.drafters.shared import SharedWeights
    from dspark.model.model_store import resolve_model_dir
    from dspark.model.transformer import Transformer

    from dspark.drafters import deepspec_format

    try:
        if not deepspec_format.is_deepspec_checkpoint(args.drafter):  # a DeepSpec one is translated on load
            DSparkConfig.from_json((Path(args.drafter) / "config.json").read_text())
        target = Transformer.from_dir(resolve_model_dir(args.model))
        out = export_checkpoint(args.drafter, args.out, storage_dtype=args.dtype, shared=SharedWeights.from_target(target))
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    size = sum(f.stat().st_size for f in out.iterdir())
    print(f"{args.drafter} -> {out} ({args.dtype}, {size / 2**20:.1f} MiB)")
    return 0


def add_train_parsers(subparsers) -> None:
    from dspark.drafters.registry import families

    algos = [f.name for f in families()]
    c = subparsers.add_parser("cache", help="run the target once over generated data and store its features")
    c.add_argument("--data-dir", required=True, help="directory with responses.jsonl (or the file itself)")
    c.add_argument("--out", required=True, help="cache directory (resumable: rerun to finish)")
    c.add_argument("--split", default="all", choices=["train", "heldout", "all"])
    c.add_argument("--dtype", default="float16", choices=["float16", "bfloat16"], help="storage dtype of the features")
    c.add_argument("--capture-layers", default=None, help="comma-separated target layers (default: 5 spread evenly)")
    c.add_argument("--shard-tokens", type=int, default=1 << 16, help="tokens per shard (the unit of resume)")
    c.add_argument("--batch-tokens", type=int, default=4096, help="tokens per target forward")
    c.add_argument("--max-sequences", type=int, default=None)
    c.add_argument("--shortest-prompts-first", action="store_true",
                   help="cache sequences by ascending prompt length: with --max-sequences, the most response tokens "
                        "(anchors) per target forward on a CPU budget")
    c.add_argument("--skip-sequences", type=int, default=0,
                   help="leave out the first N sequences of that order: a warm-started run caches the next slice of "
                        "the data instead of the one its starting checkpoint was trained on")
    c.add_argument("--no-progress", action="store_true")
    _add_model_args(c, default_model="smollm2-135m-instruct")
    c.set_defaults(target_weights="dense")
    c.set_defaults(func=cmd_cache)

    t = subparsers.add_parser("train", help="train a drafter on a target cache")
    t.add_argument("--cache", required=True)
    t.add_argument("--out", required=True, help="run directory (checkpoints/, metrics.jsonl, final/)")
    t.add_argument("--algo", default="dspark", choices=algos,
                   help="drafter family: dspark, the DFlash baseline (parallel, CE), the EAGLE-3 baseline (1 layer, TTT)")
    t.add_argument("--steps", type=int, default=None, help="optimizer steps (overrides --epochs)")
    t.add_argument("--epochs", type=float, default=1.0)
    t.add_argument("--batch-seqs", type=int, default=8)
    t.add_argument("--anchors-per-seq", type=int, default=64)
    t.add_argument("--max-batch-tokens", type=int, default=None)
    t.add_argument("--lr", type=float, default=6e-4)
    t.add_argument("--warmup", type=float, default=0.04)
    t.add_argument("--weight-decay", type=float, default=0.0)
    t.add_argument("--grad-clip", type=float, default=1.0)
    t.add_argument("--layers", type=int, default=None, help="draft layers (default: 2; eagle3: 1, its only depth)")
    t.add_argument("--block-size", type=int, default=7)
    t.add_argument("--markov-rank", type=int, default=256)
    t.add_argument("--head", default="markov", choices=["markov", "rnn"])
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--split", default="train", choices=["train", "heldout", "all"])
    t.add_argument("--checkpoint-every", type=int, default=500)
    t.add_argument("--eval-every", type=int, default=0,
                   help="evaluate on the cache's held-out split every N steps (0: only at the end); 'eval' lines in metrics.jsonl")
    t.add_argument("--precision", default="fp32", choices=["fp32", "bf16", "auto"],
                   help="bf16: autocast the drafter's matmuls (labels stay fp32); auto: bf16 on CUDA or a CPU with native bf16")
    t.add_argument("--draft-vocab-size", type=int, default=None,
                   help="DSpark: propose only the N most frequent response tokens of the train split (FR-Spec); default: all")
    t.add_argument("--init-from", default=None, help="DSpark: start from this drafter checkpoint (same shape) instead of scratch")
    t.add_argument("--eval-cache", default=None, help="held-out evaluation on this cache's held-out split (default: --cache's)")
    t.add_argument("--eval-sequences", type=int, default=None, help="evaluate on the first N held-out sequences (default: all)")
    t.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    t.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    t.add_argument("--resume", action="store_true", help="continue from OUT's latest checkpoint")
    t.add_argument("--no-progress", action="store_true")
    _add_model_args(t, default_model=None)
    t.set_defaults(func=cmd_train)

    h = subparsers.add_parser("heldout", help="analytic acceptance of a trained drafter on the cache's held-out split")
    h.add_argument("--drafter", required=True, help="drafter checkpoint directory (RUN/final)")
    h.add_argument("--algo", default="dspark", choices=algos, help="the drafter's family")
    h.add_argument("--cache", required=True)
    h.add_argument("--split", default="heldout", choices=["train", "heldout", "all"])
    h.add_argument("--anchors-per-seq", type=int, default=16, help="as the training recipe, so the numbers match its log")
    h.add_argument("--batch-seqs", type=int, default=4)
    h.add_argument("--max-sequences", type=int, default=None)
    h.add_argument("--seed", type=int, default=0, help="the anchors' seed (the training run's seed gives its logged numbers)")
    h.add_argument("--precision", default="auto", choices=["fp32", "bf16", "auto"])
    h.add_argument("--device", default="cpu")
    _add_model_args(h, default_model=None)
    h.set_defaults(func=cmd_heldout)

    r = subparsers.add_parser("runs", help="compare finished training runs by their held-out acceptance")
    r.add_argument("runs", nargs="+", metavar="[LABEL=]RUN_DIR")
    r.add_argument("--reference", default=None, help="label whose τ the others are divided by")
    r.add_argument("--out", default=None, help="results JSON")
    r.add_argument("--plot", default=None, help="PNG of held-out τ over steps (needs the runs' --eval-every)")
    r.set_defaults(func=_cmd_runs)

    k = subparsers.add_parser("calibrate", help="fit STS temperatures on held-out acceptance")
    k.add_argument("--drafter", required=True, help="drafter checkpoint directory (RUN/final)")
    k.add_argument("--cache", required=True)
    k.add_argument("--out", default=None, help="where sts.json, reliability.png, calibration.json go (default: --drafter)")
    k.add_argument("--split", default="heldout", choices=["train", "heldout", "all"])
    k.add_argument("--temperature", type=float, default=1.0,
                   help="sampling temperature of drafter and target; 0 fits the greedy regime's temperatures (sts.json keeps both)")
    k.add_argument("--anchors-per-seq", type=int, default=32)
    k.add_argument("--batch-seqs", type=int, default=4)
    k.add_argument("--max-sequences", type=int, default=None)
    k.add_argument("--seed", type=int, default=0)
    k.add_argument("--device", default="cpu")
    k.add_argument("--no-progress", action="store_true")
    _add_model_args(k, default_model=None)
    k.set_defaults(func=cmd_calibrate)

    e = subparsers.add_parser("export", help="copy a drafter checkpoint with its weights stored in another dtype")
    e.add_argument("--drafter", required=True, help="source checkpoint directory")
    e.add_argument("--out", required=True, help="destination directory")
    e.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"], help="storage dtype of the weights")
    e.add_argument("--model", default="smollm2-135m-instruct", help="the target whose embedding / LM head the drafter shares")
    e.set_defaults(func=cmd_export)


__all__ = ["add_train_parsers", "cmd_cache", "cmd_calibrate", "cmd_export", "cmd_heldout", "cmd_train"]
