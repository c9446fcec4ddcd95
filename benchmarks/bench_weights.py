"""The target's forward step by how its linear layers hold their weights, in one run.

    python benchmarks/bench_weights.py [--batches 1 2 4 8 16 32 64] [--repeats 5] [--plot weights.png]

Modes (TargetConfig.weights / dtype): "compact" = the exact fp32 weights in the block format
they came in (Q4_1 layers, Q8_0 LM head for the default model; dspark/model/compact_weights.py),
"compact-int8" = the same weights with int8 activations into the Q4_1 layers and the Q8_0 LM head
(llama.cpp's numerics; dspark/model/int8_activations.py), "compact-int8-exact-head" = compact-int8
with the LM head back on the exact fp32 kernel (what the mode was before its head took int8: the
head's share of the difference), "bf16" = dense bf16 layers + packed fp32 LM head (the serving default before compact weights on
CPUs with native bf16), "fp32" = dense fp32 (oneDNN). Each step is one request verifying B query
tokens over a --context-token prefix, shaped as a verify forward; B = 1 is plain decoding. Modes
are interleaved at each B, round after round, so machine noise hits them alike; each cell is the
median over rounds of each round's median step.
Also printed: the bytes of GEMM weights each mode streams per step, and the effective GB/s at B = 1.
`--agreement N` also compares each mode's model with the exact one ("compact") on the exact
model's greedy answers to N prompts per benchmark of ../shared/data/eval (teacher-forced): the
share of positions whose argmax is the exact model's, and the mean total variation of the
next-token distributions.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from common import cpu_name, print_table
from dspark.model.target_runtime import TargetConfig, TargetRuntime

MODES = {
    "compact": TargetConfig(weights="compact"),
    "compact-int8": TargetConfig(weights="compact-int8"),
    "compact-int8-exact-head": TargetConfig(weights="compact-int8"),  # load_mode swaps its head
    "bf16": TargetConfig(dtype="bfloat16", weights="dense"),
    "fp32": TargetConfig(dtype="float32", weights="dense"),
}


def load_mode(mode: str) -> TargetRuntime:
    runtime = TargetRuntime.load(MODES[mode])
    if mode == "compact-int8-exact-head":
        from dspark.model import compact_weights

        model = runtime.model
        exact = compact_weights.compact(model.lm_head_weight.detach(), ("q4_1", "q8_0"))
        model.__dict__["lm_head_packed"] = compact_weights.CompactLinear(exact)
    return runtime


def gemm_weight_bytes(runtime: TargetRuntime) -> int:
    """Bytes of linear-layer weights plus the LM head one step reads (the roofline's numerator)."""
    from dspark.model.compact_weights import CompactLinear
    from dspark.model.transformer import SplitKLinear

    model = runtime.model
    total = 0
    for module in [*model.modules(), model.__dict__["lm_head_packed"]]:
        if isinstance(module, CompactLinear):
            total += module.weight.nbytes
        elif isinstance(module, SplitKLinear):
            total += sum(w.numel() * w.element_size() for w in module.weight_chunks)
    return total


def step_ms(runtime: TargetRuntime, prefix: torch.Tensor, block: torch.Tensor, steps: int) -> float:
    """Median ms of a forward of `block` (one request) after `prefix`, KV truncated back each time."""
    rid = "bench-weights"
    runtime.add_request(rid, len(prefix) + len(block))
    try:
        runtime.forward([rid], prefix, [len(prefix)], logits_indices=torch.empty(0, dtype=torch.long))
        times = []
        for step in range(steps + 2):  # the first two warm the caches after the prefill: untimed
            t = time.perf_counter()
            runtime.forward([rid], block, [len(block)])
            if step >= 2:
                times.append(time.perf_counter() - t)
            runtime.truncate(rid, len(prefix))
        return statistics.median(times) * 1e3
    finally:
        runtime.free_request(rid)


def gemm_ms(runtime: TargetRuntime, rows: int, repeats: int) -> tuple[float, float]:
    """Median ms of every linear layer's GEMM in a forward's order, then of the LM head, at `rows`
    rows of random input (the GEMMs alone: no attention, norms or Python between layers)."""
    model = runtime.model
    linears = [getattr(layer, name) for layer in model.layers for name in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")]
    head = model.__dict__["lm_head_packed"]
    inputs = [torch.randn(rows, lin.in_features).to(lin.dtype) for lin in linears]
    head_input = torch.randn(rows, head.in_features).to(head.dtype)

    def layers() -> None:
        for lin, x in zip(linears, inputs):
            for j, (lo, hi) in enumerate(zip(lin.bounds, lin.bounds[1:])):
                lin.partial(x[:, lo:hi].contiguous() if len(lin.bounds) > 2 else x, j)

    def timed(fn) -> float:
        fn()
        samples = []
        for _ in range(repeats):
            t = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - t)
        return statistics.median(samples) * 1e3

    return timed(layers), timed(lambda: head.partial(head_input, 0))


def agreement(exact: TargetRuntime, other: TargetRuntime, prompts: list[list[int]], max_tokens: int) -> tuple[float, float]:
    """(argmax agreement, mean total variation) of `other` against `exact` on `exact`'s greedy answers."""
    from dspark.engine.speculative import GenerationRequest, SpeculativeEngine
    from dspark.sampling.params import SamplingParams

    answers = SpeculativeEngine(exact, None).generate([GenerationRequest(f"a{i}", p, max_tokens, SamplingParams(temperature=0.0))
                                                       for i, p in enumerate(prompts)])
    same, tv, n = 0, 0.0, 0
    for i, (prompt, state) in enumerate(zip(prompts, answers)):
        ids = torch.tensor(prompt + state.output_ids[:-1])
        rows = torch.arange(len(prompt) - 1, len(ids))  # the positions that predicted the answer
        probs = []
        for r in (exact, other):
            r.add_request(f"t{i}", len(ids) + 1)
            try:
                logits = r.forward([f"t{i}"], ids, [len(ids)], logits_indices=rows).logits  # [answer, vocab]
            finally:
                r.free_request(f"t{i}")
            probs.append(torch.softmax(logits.double(), dim=-1))
        same += int((probs[0].argmax(-1) == probs[1].argmax(-1)).sum())
        tv += float(0.5 * (probs[0] - probs[1]).abs().sum(-1).sum())
        n += len(rows)
    return same / n, tv / n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    ap.add_argument("--context", type=int, default=200, help="cached tokens before each step")
    ap.add_argument("--repeats", type=int, default=5, help="rounds over all modes; each cell is the median")
    ap.add_argument("--steps", type=int, default=7, help="forwards per cell per round")
    ap.add_argument("--plot", default=None, help="write a PNG of ms/step against B per mode")
    ap.add_argument("--gemms", action="store_true", help="also time the GEMMs alone (layers, LM head) at 1 and 8 rows")
    ap.add_argument("--agreement", type=int, default=0, metavar="N",
                    help="also compare each mode's model with compact's on N prompts per benchmark (teacher-forced)")
    ap.add_argument("--agreement-benchmarks", default="gsm8k,humaneval,mt-bench")
    ap.add_argument("--agreement-tokens", type=int, default=128)
    args = ap.parse_args()

    runtimes = {m: load_mode(m) for m in args.modes}
    for m, r in runtimes.items():
        print(f"{m}: linear layers {r.linear_numerics}, fused kernels {r.model.fused}, "
              f"{gemm_weight_bytes(r) / 1e6:.0f} MB of GEMM weights per step")
    g = torch.Generator().manual_seed(0)
    vocab = next(iter(runtimes.values())).vocab_size
    prefix = torch.randint(0, vocab, (args.context,), generator=g)
    blocks = {b: torch.randint(0, vocab, (b,), generator=g) for b in args.batches}
    cells: dict[tuple[str, int], list[float]] = {}
    for _ in range(args.repeats):
        for b in args.batches:  # the modes side by side at each B, so a noisy moment hits them alike
            for m, r in runtimes.items():
                cells.setdefault((m, b), []).append(step_ms(r, prefix, blocks[b], args.steps))
    ms = {k: statistics.median(v) for k, v in cells.items()}

    headers = ["B", *[f"{m} ms" for m in args.modes]]
    if "compact" in args.modes:
        headers += [f"{m}/compact" for m in args.modes if m != "compact"]
    headers += [f"{m} x B=1" for m in args.modes]
    rows = []
    for b in args.batches:
        row = [b, *[ms[m, b] for m in args.modes]]
        if "compact" in args.modes:
            row += [ms[m, b] / ms["compact", b] for m in args.modes if m != "compact"]
        row += [ms[m, b] / ms[m, args.batches[0]] for m in args.modes]
        rows.append(row)
    print(f"\n{cpu_name()}, {torch.get_num_threads()} threads, context {args.context}, "
          f"median of {args.repeats} rounds x {args.steps} steps")
    print_table(headers, rows)
    if 1 in args.batches:
        print("\nat B = 1 (plain decoding): " + ", ".join(
            f"{m} {1e3 / ms[m, 1]:.1f} forwards/s ({gemm_weight_bytes(runtimes[m]) / ms[m, 1] / 1e6:.1f} GB/s of weights)"
            for m in args.modes))
    if args.gemms:
        rows = []
        for m, r in runtimes.items():
            mb = gemm_weight_bytes(r) / 1e6
            for n in (1, 8):
                layers, head = gemm_ms(r, n, repeats=max(5, args.repeats * 2))
                rows.append([m, n, layers, head, layers + head, mb / (layers + head)])
        print("\nGEMMs alone (30 layers x 4 linear layers, then the LM head):")
        print_table(["mode", "rows", "layers ms", "head ms", "total ms", "GB/s of weights"], rows)
    if args.agreement and "compact" in runtimes:
        from common import load_prompts
        from dspark.model.tokenizer import Tokenizer

        exact = runtimes["compact"]
        tokenizer = Tokenizer(exact.model_dir)
        prompts = [tokenizer.encode_chat([{"role": "user", "content": p}])
                   for b in args.agreement_benchmarks.split(",") for p in load_prompts(b.strip(), args.agreement)]
        rows = [[m, *agreement(exact, r, prompts, args.agreement_tokens)] for m, r in runtimes.items() if m != "compact"]
        print(f"\nagainst the exact model (compact) on its greedy answers, {len(prompts)} prompts x {args.agreement_tokens} tokens:")
        print_table(["mode", "argmax agreement", "mean total variation"], rows)
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        plt.figure(figsize=(6, 4))
        for m in args.modes:
            plt.plot(args.batches, [ms[m, b] for b in args.batches], "o-", label=m)
        plt.xscale("log", base=2)
        plt.yscale("log")
        plt.xlabel("tokens per forward (B)")
        plt.ylabel("ms per step")
        plt.legend()
        plt.title(f"SmolLM2-135M forward by weight format\n{cpu_name()}")
        plt.tight_layout()
        plt.savefig(args.plot, dpi=120)
        print(f"wrote {args.plot}")


if __name__ == "__main__":
    main()
