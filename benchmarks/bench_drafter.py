"""Per-round cost of the DSpark drafter in serving mode against one target step.

    python benchmarks/bench_drafter.py --layers 1 --markov-rank 64 --context 200 --requests 1 4
    python benchmarks/bench_drafter.py ... --draft-vocab-size 8192    # LM head / Markov head over N tokens
    python benchmarks/bench_drafter.py ... --fp32-weights             # drafter weights that are not bf16 values

Times a drafting round of `DSparkServingDrafter` (projecting the last verified position's
features into the context cache, then `propose`: backbone over cached context K/V, LM head,
sequential head sampling, calibrated confidences) for a drafter of the given shape on the default target's
shared embedding/LM head (weights random, rounded to bf16 values as the shipped checkpoint is
stored, so the serving GEMMs pick the compact kernel as they do for it: dspark/drafters/serving_gemms.py;
--fp32-weights keeps fp32 values, which go to oneDNN's packed fp32 path), next to the target's
verify forward of the same requests (1 + γ tokens each), median of repeats.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from common import print_table
from dspark.drafters.base import DraftRequest
from dspark.drafters.dspark.config import DSparkConfig
from dspark.drafters.dspark.model import DSparkDrafter
from dspark.drafters.dspark.serving import DSparkServingDrafter
from dspark.drafters.shared import SharedWeights
from dspark.model.target_runtime import TargetConfig, TargetRuntime
from dspark.sampling.params import SamplingParams


def median_ms(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=1)
    ap.add_argument("--markov-rank", type=int, default=64)
    ap.add_argument("--block-size", type=int, default=7)
    ap.add_argument("--context", type=int, default=200, help="verified tokens per request")
    ap.add_argument("--requests", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--draft-vocab-size", type=int, default=None, help="N (the first N token ids: cost does not depend on which)")
    ap.add_argument("--fp32-weights", action="store_true", help="keep the random weights' fp32 values (default: bf16 values)")
    args = ap.parse_args()

    runtime = TargetRuntime.load(TargetConfig())
    config = DSparkConfig.from_target(runtime.config, num_layers=args.layers, markov_rank=args.markov_rank,
                                      block_size=args.block_size, target_layer_ids=runtime.capture_layers,
                                      draft_vocab_size=args.draft_vocab_size)
    torch.manual_seed(0)
    model = DSparkDrafter(config, shared=SharedWeights.from_target(runtime.model))
    if not args.fp32_weights:  # as a checkpoint stored in bf16 loads (load_weights upcasts it)
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(p.bfloat16().float())
    # as DSparkServingDrafter.load wires it: the target's packed LM head only for the full vocabulary
    drafter = DSparkServingDrafter(model, logits_fn=runtime.model.compute_logits if args.draft_vocab_size is None else None)
    m, d, gamma = len(runtime.capture_layers), runtime.config.hidden_size, args.block_size
    rows = []
    for r in args.requests:
        ids = [f"bench-{r}-{i}" for i in range(r)]
        for rid in ids:
            drafter.observe(rid, torch.randn(args.context, m, d))
            runtime.add_request(rid, args.context + gamma + 1)
        runtime.forward(ids, torch.randint(0, runtime.vocab_size, (r * args.context,)), [args.context] * r,
                        logits_indices=torch.empty(0, dtype=torch.long))
        for temperature in (0.0, 1.0):
            reqs = [DraftRequest(rid, list(range(drafter.context_len(rid) + 1)), args.context, SamplingParams(temperature=temperature),
                                 gamma, torch.Generator().manual_seed(i)) for i, rid in enumerate(ids)]
            def draft():  # a round as serving runs it: the features of the last verified position, then the proposal
                for req in reqs:
                    drafter.observe(req.request_id, torch.randn(1, m, d))
                    req.token_ids.append(0)
                drafter.propose(reqs)

            draft_ms = median_ms(draft, args.repeats)

            def verify():
                runtime.forward(ids, torch.randint(0, runtime.vocab_size, (r * (gamma + 1),)), [gamma + 1] * r)
                for rid in ids:
                    runtime.truncate(rid, args.context)

            verify_ms = median_ms(verify, args.repeats)
            rows.append([r, temperature, draft_ms, verify_ms, draft_ms / verify_ms])
        for rid in ids:
            drafter.remove_request(rid)
            runtime.free_request(rid)
    print(f"DSpark drafter: {args.layers} layer(s), rank {args.markov_rank}, γ = {gamma}, context {args.context} tokens, "
          f"draft vocabulary {config.output_vocab_size}, {'fp32' if args.fp32_weights else 'bf16'} weight values; "
          f"median of {args.repeats}")
    print_table(["requests", "temperature", "draft ms", "verify ms (1+γ each)", "draft / verify"], rows)


if __name__ == "__main__":
    main()
