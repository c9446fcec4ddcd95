"""`dspark data`: prepare drafter training data in two resumable steps.

    dspark data prompts  --out data/ --sources sharegpt,champ --max-prompts 20000 --heldout-fraction 0.05
    dspark data generate --data-dir data/ --batch-size 32 --max-new-tokens 256 --temperature 1.0
    dspark data datastore --responses data/responses.jsonl --out CHECKPOINT_DIR/ngram_datastore.npz

`prompts` writes DIR/prompts.jsonl (+ DIR/prompts_stats.json); `generate` reads it and appends
to DIR/responses.jsonl, skipping ids already there; `datastore` turns the train split's responses
into the n-gram datastore that `<family>-lookup` drafters read beside their checkpoint
(dspark/drafters/datastore.py). `add_data_parser(subparsers)` registers the
command on the main `dspark` parser.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path

from dspark.serving_config import WEIGHT_CHOICES

PROMPTS_FILE = "prompts.jsonl"
RESPONSES_FILE = "responses.jsonl"
DEFAULT_MODEL = "smollm2-135m-instruct"


def cmd_prompts(args) -> int:
    from dspark.data.prompt_sources import (
        SOURCES,
        Decontaminator,
        build_prompts,
        write_prompts,
    )

    names = [s.strip() for s in args.sources.split(",") if s.strip()]
    unknown = [n for n in names if n not in SOURCES]
    if not names or unknown:
        print(f"error: unknown sources {unknown or names}; available: {sorted(SOURCES)}", file=sys.stderr)
        return 2
    count_tokens = None
    if args.max_prompt_tokens:
        from dspark.model.model_store import resolve_model_dir
        from dspark.model.tokenizer import Tokenizer

        tokenizer = Tokenizer(resolve_model_dir(args.model))
        count_tokens = lambda messages: len(tokenizer.encode_chat(messages))
    try:
        sources = {n: list(SOURCES[n]()) for n in names}
        decontaminator = Decontaminator.from_benchmarks(n=args.ngram)
        records, stats = build_prompts(
            sources,
            decontaminator=decontaminator,
            heldout_fraction=args.heldout_fraction,
            max_prompts=args.max_prompts,
            seed=args.seed,
            count_tokens=count_tokens,
            max_prompt_tokens=args.max_prompt_tokens or None,
        )
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    out = Path(args.out)
    write_prompts(out / PROMPTS_FILE, records)
    (out / "prompts_stats.json").write_text(json.dumps(asdict(stats) | {"args": vars(args) | {"func": None}}, indent=2) + "\n")
    print(
        f"{stats.kept} prompts ({stats.heldout} heldout) -> {out / PROMPTS_FILE}; read per source {stats.per_source}, "
        f"dropped {stats.duplicates} duplicates, {stats.contaminated} contaminated, {stats.too_long} too long",
        file=sys.stderr,
    )
    return 0


def cmd_generate(args) -> int:
    from dspark.data.prompt_sources import read_prompts
    from dspark.data.regenerate import RegenConfig, regenerate
    from dspark.model.target_runtime import TargetConfig, TargetRuntime
    from dspark.model.tokenizer import Tokenizer

    data_dir = Path(args.data_dir)
    prompts_path = data_dir / PROMPTS_FILE
    if not prompts_path.exists():
        print(f"error: {prompts_path} not found; run `dspark data prompts --out {data_dir}` first", file=sys.stderr)
        return 2
    try:
        config = RegenConfig(batch_size=args.batch_size, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                             top_p=args.top_p, seed=args.seed)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    prompts = read_prompts(prompts_path)
    if args.split != "all":
        prompts = [p for p in prompts if p.split == args.split]
    if args.limit is not None:
        prompts = prompts[: args.limit]
    runtime = TargetRuntime.load(TargetConfig(model=args.model, dtype=args.dtype, weights=args.weights,
                                              kv_budget_mb=args.kv_budget_mb))
    tokenizer = Tokenizer(runtime.model_dir)
    try:
        stats = regenerate(runtime, tokenizer, prompts, data_dir / RESPONSES_FILE, config=config, target=args.model,
                           progress=not args.no_progress)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(stats.summary(), file=sys.stderr)
    return 130 if stats.interrupted else 0


def cmd_datastore(args) -> int:
    from dspark.drafters.datastore import NgramDatastore, read_responses
    from dspark.model.model_store import resolve_model_dir
    from dspark.model.tokenizer import Tokenizer

    try:
        sequences = read_responses(args.responses, split=args.split)
        if not sequences:
            raise ValueError(f"no {args.split} responses in {args.responses}")
        vocab_size = Tokenizer(resolve_model_dir(args.model)).vocab_size
        store = NgramDatastore.build(sequences, vocab_size=vocab_size, min_n=args.min_n, max_n=args.max_n)
    except (FileNotFoundError, KeyError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    store.save(args.out)
    print(f"{len(sequences)} responses, {sum(map(len, sequences))} tokens -> {store.entries} n-grams "
          f"(n = {args.min_n}..{args.max_n}) -> {args.out}", file=sys.stderr)
    return 0


def add_data_parser(subparsers) -> argparse.ArgumentParser:
    d = subparsers.add_parser("data", help="prepare drafter training data: prompts, then target-regenerated responses")
    sub = d.add_subparsers(dest="data_command", required=True)

    p = sub.add_parser("prompts", help="collect offline prompts, decontaminate, split -> DIR/prompts.jsonl")
    p.add_argument("--out", required=True, help="data directory")
    p.add_argument("--sources", default="sharegpt,champ", help="comma-separated: sharegpt, champ, pycode, pypkgs, mathword")
    p.add_argument("--max-prompts", type=int, default=None)
    p.add_argument("--heldout-fraction", type=float, default=0.05, help="share of prompts held out for calibration")
    p.add_argument("--seed", type=int, default=0, help="shuffle seed (the split does not depend on it)")
    p.add_argument("--max-prompt-tokens", type=int, default=1024, help="skip longer prompts (chat template included; 0: no limit)")
    p.add_argument("--ngram", type=int, default=13, help="decontamination n-gram length in words")
    p.add_argument("--model", default=DEFAULT_MODEL, help="whose tokenizer counts prompt tokens")
    p.set_defaults(func=cmd_prompts)

    g = sub.add_parser("generate", help="regenerate responses with the target -> DIR/responses.jsonl (resumable)")
    g.add_argument("--data-dir", required=True)
    g.add_argument("--model", default=DEFAULT_MODEL, help="default model name or a local HF Llama/Qwen directory")
    g.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"])
    # batched regeneration runs 32-64 rows a forward, where bf16 GEMMs do twice the work per
    # instruction of compact weights' exact fp32 ones (docs/results/compact_weights.md)
    g.add_argument("--weights", default="dense", choices=WEIGHT_CHOICES,
                   help="the target's linear weights (dense: fastest at batch 32+; compact: exact fp32, fastest at 1-8 rows)")
    g.add_argument("--kv-budget-mb", type=int, default=4096)
    g.add_argument("--batch-size", type=int, default=32)
    g.add_argument("--max-new-tokens", type=int, default=256)
    g.add_argument("--temperature", type=float, default=1.0, help="0 = greedy; default samples the target at T=1")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=0, help="base of the per-record sampling seeds")
    g.add_argument("--split", choices=["all", "train", "heldout"], default="all")
    g.add_argument("--limit", type=int, default=None, help="only the first N prompts of prompts.jsonl")
    g.add_argument("--no-progress", action="store_true")
    g.set_defaults(func=cmd_generate)

    s = sub.add_parser("datastore", help="responses.jsonl files -> the n-gram datastore of lookup drafters (.npz)")
    s.add_argument("--responses", nargs="+", required=True, help="responses.jsonl files of dspark data generate")
    s.add_argument("--out", required=True, help="e.g. CHECKPOINT_DIR/ngram_datastore.npz, where <family>-lookup reads it")
    s.add_argument("--split", choices=["train", "heldout"], default="train", help="which records (held-out ones stay out)")
    s.add_argument("--min-n", type=int, default=2)
    s.add_argument("--max-n", type=int, default=4)
    s.add_argument("--model", default=DEFAULT_MODEL, help="whose vocabulary size sets the key packing")
    s.set_defaults(func=cmd_datastore)
    return d
