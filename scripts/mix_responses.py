"""One responses.jsonl from greedy and sampled regenerations and further whole data sets, for
`dspark cache` (the data of scripts/train_default_drafter.sh when the drafter trains on more than
one regime or prompt source).

    python scripts/mix_responses.py --greedy ../shared/data/regenerated --sampled runs/sampled07 \
        --greedy-train 2000 --out runs/mix-data
    python scripts/mix_responses.py --greedy ../shared/data/regenerated --extra runs/code \
        --greedy-train 2500 --out runs/codemix-data

Order of the output (what `dspark cache --split ...` sees):
  1. every greedy held-out record, in its file's order: the first HELDOUT of them are the held-out
     sequences earlier drafters were evaluated on, so τ stays comparable across runs;
  2. every sampled held-out record, then every held-out record of each --extra set;
  3. the --greedy-train greedy train records with the shortest prompts (the most response
     tokens per target forward when caching; ties by id), then every sampled train record, then
     every train record of each --extra set (any regime: e.g. greedy answers to code prompts).
A record keeps its own `temperature` / `top_p` (records from before top_p was written get 1.0),
so the cache and the training log can tell the regimes apart. Writes stats.json beside it.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def load(path: Path) -> list[dict]:
    with path.open(encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    for rec in rows:
        rec.setdefault("top_p", 1.0)
    return rows


def tokens(records: list[dict]) -> int:
    return sum(len(r["response_ids"]) for r in records)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--greedy", type=Path, required=True, help="data dir with the greedy responses.jsonl")
    ap.add_argument("--sampled", type=Path, default=None, help="data dir with the sampled responses.jsonl")
    ap.add_argument("--extra", type=Path, action="append", default=[],
                    help="a further data dir taken whole, any regime (repeatable)")
    ap.add_argument("--greedy-train", type=int, required=True, help="greedy train records to keep (shortest prompts)")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()

    greedy = load(args.greedy / "responses.jsonl")
    sampled = load(args.sampled / "responses.jsonl") if args.sampled is not None else []
    extras = {str(d): load(d / "responses.jsonl") for d in args.extra}
    if {r["temperature"] for r in greedy} != {0.0}:
        raise SystemExit(f"{args.greedy}: expected greedy (temperature 0) records only")
    if 0.0 in {r["temperature"] for r in sampled}:
        raise SystemExit(f"{args.sampled}: expected sampled (temperature > 0) records only")
    sets = [sampled, *extras.values()]
    heldout = [r for r in greedy if r["split"] == "heldout"] + [r for s in sets for r in s if r["split"] == "heldout"]
    greedy_train = sorted((r for r in greedy if r["split"] == "train"), key=lambda r: (len(r["prompt_ids"]), r["id"]))
    greedy_train = greedy_train[: args.greedy_train]
    train = greedy_train + [r for s in sets for r in s if r["split"] == "train"]
    rows = heldout + train
    if len({r["id"] for r in rows}) != len(rows):
        raise SystemExit("a prompt id occurs in both inputs: mix regenerations of disjoint prompts")
    args.out.mkdir(parents=True, exist_ok=True)
    with (args.out / "responses.jsonl").open("w", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")

    sampled_train = [r for r in sampled if r["split"] == "train"]
    stats = {
        "responses": len(rows),
        "heldout_responses": len(heldout),
        "train_greedy": len(greedy_train),
        "train_sampled": len(sampled_train),
        "train_response_tokens_greedy": tokens(greedy_train),
        "train_response_tokens_sampled": tokens(sampled_train),
        "sampled_settings": sorted({(r["temperature"], r["top_p"]) for r in sampled}),
        "extra": {
            name: {
                "train": sum(r["split"] == "train" for r in recs),
                "heldout": sum(r["split"] == "heldout" for r in recs),
                "train_response_tokens": tokens([r for r in recs if r["split"] == "train"]),
                "settings": sorted({(r["temperature"], r["top_p"]) for r in recs}),
            }
            for name, recs in extras.items()
        },
    }
    (args.out / "stats.json").write_text(json.dumps(stats, indent=1) + "\n")
    print(json.dumps(stats))


if __name__ == "__main__":
    main()
