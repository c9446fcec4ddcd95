"""Forward time of the target for B = 1..256 tokens against the roofline.

    python benchmarks/bench_forward.py --max-batch 256 [--plot forward.png]
    python benchmarks/bench_forward.py --compare-attention [--context 200 --repeats 7]
    python benchmarks/bench_forward.py --compare-fused [--context 200 --repeats 7]
    python benchmarks/bench_forward.py --compare-old-gemm [--context 200 --repeats 7]
    python benchmarks/bench_forward.py --device cuda --max-batch 64      # on a GPU (scripts/gpu_check.sh)

Roofline (docs/architecture.md §8): a step must at least stream the weights once (bf16 linear layers +
the fp32 LM head) at the measured memory bandwidth, and do 2·params FLOPs per token at the bf16
peak; the bound is the larger of the two. The batch is shaped like verification (requests of
8 query tokens over a 128-token context).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from common import print_table
from dspark.model.target_runtime import TargetConfig, TargetRuntime
from dspark.profiling.sps import profile_sps, synchronize


def measure_bandwidth_gbs(device: torch.device) -> float:
    x = torch.ones(2**27, device=device)  # 512 MB
    x.sum()
    synchronize(device)
    t0 = time.perf_counter()
    for _ in range(3):
        x.sum()
    synchronize(device)
    return 3 * x.numel() * 4 / (time.perf_counter() - t0) / 1e9


def measure_bf16_gflops(device: torch.device) -> float:
    a = torch.randn(64, 4096, device=device).bfloat16()
    b = torch.randn(4096, 4096, device=device).bfloat16()
    a @ b
    synchronize(device)
    t0 = time.perf_counter()
    for _ in range(5):
        a @ b
    synchronize(device)
    return 5 * 2 * 64 * 4096 * 4096 / (time.perf_counter() - t0) / 1e9


ATTENTION_MODES = {"per-row": lambda m: m.set_attention("per-row"), "batched": lambda m: m.set_attention("batched")}
FUSED_MODES = {"torch ops": lambda m: (m.set_attention("batched"), m.set_fused(False)),
               "fused": lambda m: (m.set_attention("batched"), m.set_fused(True))}


def old_gemm_modes(model) -> dict:
    """The step before the fused kernels and the batch-1 packing (bf16 weights packed for
    batch 8, which is not batch-invariant past 32 rows on an AMX Xeon, and the torch ops between
    the GEMMs) vs now: both weight packings are kept in memory and swapped per sample."""
    from dspark.model import transformer

    linears = [m for m in model.modules() if isinstance(m, transformer.SplitKLinear)]
    linears += [model.__dict__["lm_head_packed"]]
    packs = {}
    for hint in (8, transformer.PACK_HINT_BF16):
        saved, transformer.PACK_HINT_BF16 = transformer.PACK_HINT_BF16, hint
        for m in linears:
            m.prepack()
        packs[hint] = [m.packed for m in linears]
        transformer.PACK_HINT_BF16 = saved

    def use(hint: int, fused: bool):
        def apply(m):
            for linear, packed in zip(linears, packs[hint]):
                linear.packed = packed
            m.set_attention("batched")
            m.set_fused(fused)
        return apply

    return {"old (pack 8, torch ops)": use(8, False), "new": use(transformer.PACK_HINT_BF16, True)}


def compare_attention(runtime: TargetRuntime, *, context_len: int, repeats: int, blocks: list[int], decodes: list[int],
                      modes: dict = ATTENTION_MODES) -> None:
    """Forward ms per step (logits of one row included) in two modes (the batched attention
    kernel vs the per-row SDPA path, or `modes`), in the same process and interleaved (sample i
    of both modes back to back), on two shapes: one request verifying B tokens over
    `context_len` cached ones, and C requests decoding one token each over `context_len`
    cached tokens. Medians of `repeats`."""
    model = runtime.model
    (name_a, set_a), (name_b, set_b) = modes.items()
    gen = torch.Generator().manual_seed(0)
    vocab = runtime.vocab_size
    shapes = [("verify", b, [b]) for b in blocks] + [("decode", c, [1] * c) for c in decodes]
    num_requests = max([1, *decodes])
    ids = [f"__bench_{i}" for i in range(num_requests)]
    for rid in ids:
        runtime.add_request(rid, context_len + max([1, *blocks]))
    model.set_attention("per-row")  # the same prefill either way
    runtime.forward(ids, torch.randint(0, vocab, (num_requests * context_len,), generator=gen), [context_len] * num_requests,
                    logits_indices=torch.empty(0, dtype=torch.long))
    rows = []
    try:
        for kind, size, lens in shapes:
            batch_ids = ids[: len(lens)]
            tokens = torch.randint(0, vocab, (sum(lens),), generator=gen)
            samples = {name_a: [], name_b: []}
            for i in range(repeats + 1):  # the first round warms caches and allocator
                for mode in samples:
                    modes[mode](model)
                    t0 = time.perf_counter()
                    runtime.forward(batch_ids, tokens, lens, logits_indices=torch.tensor([len(lens) - 1]))
                    if i:
                        samples[mode].append(time.perf_counter() - t0)
                    for rid in batch_ids:
                        runtime.truncate(rid, context_len)
            a, b = (statistics.median(samples[m]) * 1e3 for m in (name_a, name_b))
            rows.append([kind, size, a, b, a / b, sum(lens) / b * 1e3])
    finally:
        model.set_attention("batched")
        model.set_fused(True)
        for rid in ids:
            runtime.free_request(rid)
    print(f"context {context_len} tokens, {torch.get_num_threads()} threads, medians of {repeats}")
    print_table(["shape", "B or C", f"{name_a} ms", f"{name_b} ms", "speed-up", f"{name_b} tokens/s"], rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--max-batch", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--weights", default="dense", choices=["auto", "compact", "dense"])
    ap.add_argument("--device", default="cpu", help="auto | cpu | cuda | cuda:N (model.device)")
    ap.add_argument("--plot", default=None, help="write a PNG of step time vs B with the roofline")
    ap.add_argument("--compare-attention", action="store_true",
                    help="batched attention kernel vs per-row SDPA: one request verifying B tokens, C requests decoding")
    ap.add_argument("--compare-fused", action="store_true",
                    help="fused layer kernels vs the torch ops between the GEMMs, same shapes as --compare-attention")
    ap.add_argument("--compare-old-gemm", action="store_true",
                    help="bf16 weights packed for batch 8 + torch ops (the old step) vs now, same shapes as --compare-attention")
    ap.add_argument("--context", type=int, default=200, help="cached tokens per request (--compare-attention)")
    ap.add_argument("--blocks", type=int, nargs="+", default=[1, 8, 32, 64], help="B values (--compare-attention)")
    ap.add_argument("--decodes", type=int, nargs="+", default=[8, 32, 64], help="C values (--compare-attention)")
    args = ap.parse_args()

    runtime = TargetRuntime.load(TargetConfig(dtype=args.dtype, weights=args.weights, device=args.device))
    if args.compare_attention or args.compare_fused or args.compare_old_gemm:
        modes = (FUSED_MODES if args.compare_fused else old_gemm_modes(runtime.model) if args.compare_old_gemm
                 else ATTENTION_MODES)
        compare_attention(runtime, context_len=args.context, repeats=args.repeats, blocks=args.blocks, decodes=args.decodes,
                          modes=modes)
        return
    model = runtime.model
    layer_bytes = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if n.startswith("layers."))
    head_bytes = model.lm_head_weight.numel() * 4
    flops_per_token = 2 * (sum(p.numel() for n, p in model.named_parameters() if n.startswith("layers.")) + model.lm_head_weight.numel())
    bw, peak = measure_bandwidth_gbs(runtime.device), measure_bf16_gflops(runtime.device)
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
