"""Forward time of the target for B = 1..256 tokens against the roofline.

    python benchmarks/bench_forward.py --max-batch 256 [--plot forward.png]

Roofline (ARCHITECTURE.md): a step must at least stream the weights once (bf16 linear layers +
the fp32 LM head) at the measured memory bandwidth, and do 2·params FLOPs per token at the bf16
peak; the bound is the larger of the two. The batch is shaped like verification (requests of
8 query tokens over a 128-token context).
"""

from __future__ import annotations

import argparse
import time

import torch

from common import print_table
from dspark.model.target_runtime import TargetConfig, TargetRuntime
from dspark.profiling.sps import profile_sps


def measure_bandwidth_gbs() -> float:
    x = torch.ones(2**27)  # 512 MB
    x.sum()
    t0 = time.perf_counter()
    for _ in range(3):
        x.sum()
    return 3 * x.numel() * 4 / (time.perf_counter() - t0) / 1e9


def measure_bf16_gflops() -> float:
    a = torch.randn(64, 4096).bfloat16()
    b = torch.randn(4096, 4096).bfloat16()
    a @ b
    t0 = time.perf_counter()
    for _ in range(5):
        a @ b
    return 5 * 2 * 64 * 4096 * 4096 / (time.perf_counter() - t0) / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--max-batch", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--plot", default=None, help="write a PNG of step time vs B with the roofline")
    args = ap.parse_args()

    runtime = TargetRuntime.load(TargetConfig(dtype=args.dtype))
    model = runtime.model
    layer_bytes = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if n.startswith("layers."))
    head_bytes = model.lm_head_weight.numel() * 4
    flops_per_token = 2 * (sum(p.numel() for n, p in model.named_parameters() if n.startswith("layers.")) + model.lm_head_weight.numel())
    bw, peak = measure_bandwidth_gbs(), measure_bf16_gflops()
    prof = profile_sps(runtime, max_batch=args.max_batch, repeats=args.repeats)
    rows = []
    for b, t in zip(prof.batch_sizes, prof.step_seconds):
        bound = max((layer_bytes + head_bytes) / (bw * 1e9), b * flops_per_token / (peak * 1e9))
        rows.append([b, t * 1e3, bound * 1e3, t / bound, b / t])
    print(f"weights streamed per step: {(layer_bytes + head_bytes) / 1e6:.0f} MB, {flops_per_token / 1e9:.2f} GFLOP/token, "
          f"measured bandwidth {bw:.1f} GB/s, bf16 peak {peak:.0f} GFLOP/s")
    print_table(["B", "ms/step", "roofline ms", "x roofline", "tokens/s"], rows)
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        bs = [r[0] for r in rows]
        plt.figure(figsize=(6, 4))
        plt.plot(bs, [r[1] for r in rows], "o-", label="measured")
        plt.plot(bs, [r[2] for r in rows], "--", label="roofline")
        plt.xscale("log", base=2)
        plt.yscale("log")
        plt.xlabel("tokens per forward (B)")
        plt.ylabel("ms per step")
        plt.legend()
        plt.title("SmolLM2-135M forward on this CPU")
        plt.tight_layout()
        plt.savefig(args.plot, dpi=120)
        print(f"wrote {args.plot}")


if __name__ == "__main__":
    main()
