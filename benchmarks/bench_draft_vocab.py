"""What a draft vocabulary of N tokens covers, costs in acceptance, and saves (issue #15 item 3).

    python benchmarks/bench_draft_vocab.py --cache runs/greedy-cache-train --eval-cache runs/greedy-cache-heldout \
        --drafter dspark/drafters/checkpoints/dspark-smollm2-135m-instruct --sizes 4096,8192,16384,32768,49152

For every N (the N most frequent response tokens of --cache's train split, draft_vocab.py):
  * coverage on --eval-cache's held-out responses: share of response tokens in D, mean target
    mass Σ_D p_t (the ceiling of c* at T = 1), share of target argmaxes in D (the ceiling at T = 0);
  * what it costs: held-out τ (T = 1, analytic) and greedy τ of --drafter restricted to D (its
    weights carried over by `transfer_weights`, no retraining: the cost before training adapts);
  * what it saves: a drafting round (`DSparkServingDrafter.propose`, γ = 7, 200-token contexts,
    1 and 8 requests, T = 0 and 1) and a training step (forward + backward of the DSpark loss on
    one recipe batch: 4 sequences x 16 anchors), medians of --repeats.
Prints a table and writes --out (JSON).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

import torch

from bench_drafter import median_ms
from common import print_table
from dspark.drafters.base import DraftRequest
from dspark.drafters.dspark.checkpoint import load_checkpoint, transfer_weights
from dspark.drafters.dspark.model import DSparkDrafter
from dspark.drafters.dspark.serving import DSparkServingDrafter
from dspark.drafters.registry import family
from dspark.drafters.shared import SharedWeights
from dspark.model.target_runtime import TargetConfig, TargetRuntime
from dspark.sampling.params import SamplingParams
from dspark.training.anchors import plan_batches, sample_batch
from dspark.training.draft_vocab import coverage, frequent_tokens
from dspark.training.heldout import evaluate_heldout
from dspark.training.target_cache import TargetCache


def drafting_ms(model: DSparkDrafter, *, requests: int, temperature: float, context: int, repeats: int) -> float:
    drafter = DSparkServingDrafter(model)  # its own N-row LM head slice (the full head's packed GEMM is a runtime detail)
    m, d, gamma = model.config.num_context_layers, model.config.hidden_size, model.config.block_size
    ids = [f"bench-{i}" for i in range(requests)]
    for rid in ids:
        drafter.observe(rid, torch.randn(context, m, d))
    reqs = [DraftRequest(rid, list(range(context + 1)), context, SamplingParams(temperature=temperature), gamma,
                         torch.Generator().manual_seed(i)) for i, rid in enumerate(ids)]
    return median_ms(lambda: drafter.propose(reqs), repeats)


def train_step_ms(model: DSparkDrafter, cache: TargetCache, *, repeats: int) -> float:
    seqs = plan_batches(cache, cache.indices("train"), batch_seqs=4, seed=0, epoch=0)[0]
    batch = sample_batch(cache, seqs, anchors_per_seq=16, block_size=model.config.block_size, seed=0, epoch=0)
    objective = family("dspark").objective
    model.train()

    def step():
        model.zero_grad(set_to_none=True)
        objective.loss(model, batch).total.backward()

    out = median_ms(step, repeats)
    model.eval()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cache", required=True, help="target cache whose train split chooses the vocabulary")
    ap.add_argument("--eval-cache", default=None, help="cache with the held-out split (default: --cache)")
    ap.add_argument("--drafter", required=True, help="a full-vocabulary DSpark checkpoint")
    ap.add_argument("--sizes", default="4096,8192,16384,32768,49152")
    ap.add_argument("--max-sequences", type=int, default=200, help="held-out sequences for τ")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default=None)
    ap.add_argument("--no-timing", action="store_true", help="coverage and τ only (timings need a quiet machine)")
    args = ap.parse_args()

    cache = TargetCache(args.cache, require_complete=False)
    eval_cache = TargetCache(args.eval_cache) if args.eval_cache else cache
    runtime = TargetRuntime.load(TargetConfig())
    shared = SharedWeights.from_target(runtime.model)
    source = load_checkpoint(args.drafter, shared=shared).drafter.eval()
    rows, results = [], []
    for n in [int(x) for x in args.sizes.split(",")]:
        t0 = time.perf_counter()
        d2t = frequent_tokens(cache, size=n)
        cov = coverage(eval_cache, d2t, runtime.model.lm_head_weight, split="heldout")
        cfg = dataclasses.replace(source.config, draft_vocab_size=None if n == source.config.vocab_size else n)
        model = DSparkDrafter(cfg, shared=shared, draft_to_target=None if cfg.draft_vocab_size is None else d2t).eval()
        transfer_weights(source, model)
        held = evaluate_heldout(family("dspark").objective, model, eval_cache, split="heldout", block_size=cfg.block_size,
                                anchors_per_seq=16, batch_seqs=4, max_sequences=args.max_sequences)
        nan = float("nan")
        draft = {f"draft_ms_r{r}_t{t:g}": nan if args.no_timing else
                 drafting_ms(model, requests=r, temperature=t, context=200, repeats=args.repeats * 2)
                 for r in (1, 8) for t in (0.0, 1.0)}
        step = nan if args.no_timing else train_step_ms(model, cache, repeats=args.repeats)
        result = {"N": n, "token_share": cov.token_share, "target_mass": cov.target_mass, "argmax_share": cov.argmax_share,
                  "tau_t1": held.tau, "greedy_tau": held.greedy_tau, **draft, "train_step_ms": step,
                  "seconds": time.perf_counter() - t0}
        results.append(result)
        rows.append([n, cov.token_share, cov.target_mass, cov.argmax_share, held.tau, held.greedy_tau,
                     draft["draft_ms_r1_t0"], draft["draft_ms_r1_t1"], draft["draft_ms_r8_t1"], step])
        print(json.dumps(result), flush=True)
    print(f"draft vocabulary of N tokens: coverage on {args.eval_cache or args.cache} held-out responses; "
          f"{args.drafter} restricted to it (no retraining); medians of {args.repeats}")
    print_table(["N", "token share", "Σ_D p_t", "argmax in D", "τ T=1", "greedy τ", "draft ms r1 T0", "draft ms r1 T1",
                 "draft ms r8 T1", "train step ms"], rows)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
