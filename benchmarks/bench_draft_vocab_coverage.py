"""How much of the target a draft vocabulary of N tokens can reach (the coverage columns of the
draft-vocabulary table in docs/results/training.md), for several N in one pass over held-out positions.

    python benchmarks/bench_draft_vocab_coverage.py --cache runs/default-drafter/cache-train \
        --eval-cache runs/default-drafter/cache-heldout --per-sequence 10

D = the N most frequent response tokens of --cache's train split (draft_vocab.token_counts, ties
by id, as frequent_tokens). On `--per-sequence` random response positions of every held-out
sequence (seed 0): share of response tokens in D, mean Σ_{v∈D} p_t(v) (the ceiling of c* at
T = 1) and share of target argmaxes in D (the ceiling at T = 0). bench_draft_vocab.py adds τ and
timings per N.
"""

from __future__ import annotations

import argparse
import json

import numpy as np
import torch

from common import print_table
from dspark.model.model_store import resolve_model_dir
from dspark.model.transformer import Transformer
from dspark.training.draft_vocab import token_counts
from dspark.training.target_cache import TargetCache


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cache", required=True)
    ap.add_argument("--eval-cache", required=True)
    ap.add_argument("--sizes", default="2048,4096,8192,16384,32768,49152")
    ap.add_argument("--per-sequence", type=int, default=10)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    train, held = TargetCache(args.cache), TargetCache(args.eval_cache)
    counts = token_counts(train)
    order = np.lexsort((np.arange(counts.size), -counts))  # most frequent first
    lm_head = Transformer.from_dir(resolve_model_dir(train.meta["model"])).lm_head_weight.detach().float()  # [V, d]
    rng = np.random.default_rng(0)
    hidden, responses = [], []
    for i in held.indices("heldout"):
        s = held.sequences[i]
        rows = np.arange(s.prompt_len - 1, s.length - 1)  # row p predicts token p + 1: the response tokens
        hidden.append(held.hidden_rows(i, np.sort(rng.choice(rows, size=min(args.per_sequence, rows.size), replace=False))).float())
        responses.append(held.tokens(i)[s.prompt_len :])
    p_t = torch.softmax(torch.cat(hidden) @ lm_head.t(), dim=-1)  # [positions, V]
    argmax, tokens = p_t.argmax(-1), torch.cat(responses)
    results, rows = [], []
    for n in [int(x) for x in args.sizes.split(",")]:
        inside = torch.zeros(train.vocab_size, dtype=torch.bool)
        inside[torch.from_numpy(order[:n])] = True
        r = {"N": n, "token_share": float(inside[tokens].float().mean()), "target_mass": float(p_t[:, inside].sum(-1).mean()),
             "argmax_share": float(inside[argmax].float().mean()), "positions": int(p_t.shape[0])}
        results.append(r)
        rows.append([n, r["token_share"], r["target_mass"], r["argmax_share"]])
    print(f"draft vocabulary coverage on {p_t.shape[0]} held-out response positions of {args.eval_cache}")
    print_table(["N", "response tokens in D", "Σ_D p_t", "argmax in D"], rows)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
