"""Plain decoding on our runtime vs transformers `generate()`, and n-gram speculative decoding
vs plain decoding, on the same prompts in one run.

    python benchmarks/bench_decode.py --prompts 4 --max-tokens 64 --repeats 3

Prints one table per comparison; ratios are taken within each repeat (same machine state) and
the median over repeats is reported, since this machine is shared and noisy.
"""

from __future__ import annotations

import argparse
import time

import torch

from common import load_prompts, median, print_table
from dspark.drafters.ngram import NgramDrafter
from dspark.engine.speculative import GenerationRequest, SpeculativeEngine
from dspark.model.target_runtime import TargetConfig, TargetRuntime
from dspark.model.tokenizer import Tokenizer
from dspark.sampling.params import SamplingParams


def run_engine(engine: SpeculativeEngine, prompt_ids: list[list[int]], max_tokens: int, eos,
               temperature: float = 0.0) -> tuple[float, int, float]:
    """Requests one at a time (single-user latency); sampled ones seeded by their index. Returns
    seconds, tokens, mean τ."""
    seconds, tokens, taus = 0.0, 0, []
    for i, ids in enumerate(prompt_ids):
        params = SamplingParams(temperature=temperature, seed=i if temperature > 0 else None)
        req = GenerationRequest(f"b{i}", ids, max_tokens, params, stop_token_ids=frozenset())
        t0 = time.perf_counter()
        (state,) = engine.generate([req])
        seconds += time.perf_counter() - t0
        tokens += len(state.output_ids)
        taus.append(state.mean_accepted_length)
    return seconds, tokens, sum(taus) / len(taus)


def run_hf(model, prompt_ids: list[list[int]], max_tokens: int, temperature: float = 0.0, **kwargs) -> tuple[float, int]:
    seconds, tokens = 0.0, 0
    sampling = {"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0} if temperature > 0 else {"do_sample": False}
    for ids in prompt_ids:
        x = torch.tensor([ids])
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_tokens,
                                 min_new_tokens=max_tokens, pad_token_id=model.config.eos_token_id, **sampling, **kwargs)
        seconds += time.perf_counter() - t0
        tokens += out.shape[1] - x.shape[1]
    return seconds, tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--benchmark", default="humaneval")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--gamma", type=int, default=7)
    ap.add_argument("--skip-hf", action="store_true")
    args = ap.parse_args()

    runtime = TargetRuntime.load(TargetConfig(dtype="bfloat16"))
    tokenizer = Tokenizer(runtime.model_dir)
    prompt_ids = [tokenizer.encode_chat([{"role": "user", "content": p}]) for p in load_prompts(args.benchmark, args.prompts)]
    plain = SpeculativeEngine(runtime, None)
    ngram = SpeculativeEngine(runtime, NgramDrafter(), num_speculative_tokens=args.gamma)
    hf32 = hf16 = None
    if not args.skip_hf:
        from transformers import AutoModelForCausalLM

        hf32 = AutoModelForCausalLM.from_pretrained(str(runtime.model_dir), dtype=torch.float32).eval()
        hf16 = AutoModelForCausalLM.from_pretrained(str(runtime.model_dir), dtype=torch.bfloat16).eval()
    run_engine(plain, prompt_ids[:1], 8, None)  # warm-up

    rows = []
    for rep in range(args.repeats):
        r = {}
        s, n, _ = run_engine(plain, prompt_ids, args.max_tokens, None)
        r["ours_plain"] = n / s
        s, n, tau = run_engine(ngram, prompt_ids, args.max_tokens, None)
        r["ours_ngram"], r["tau"] = n / s, tau
        if hf32 is not None:
            s, n = run_hf(hf32, prompt_ids, args.max_tokens)
            r["hf_fp32"] = n / s
            s, n = run_hf(hf16, prompt_ids, args.max_tokens)
            r["hf_bf16"] = n / s
            s, n = run_hf(hf32, prompt_ids, args.max_tokens, prompt_lookup_num_tokens=args.gamma)
            r["hf_fp32_lookup"] = n / s
        rows.append(r)
        print(f"repeat {rep}: " + ", ".join(f"{k}={v:.2f}" for k, v in r.items()), flush=True)

    def med(key: str) -> float:
        return median([r[key] for r in rows])

    print(f"\n{args.benchmark}, {args.prompts} prompts x {args.max_tokens} new tokens, greedy, batch 1, "
          f"median of {args.repeats} repeats (tokens/s)")
    table = [["ours plain (bf16)", med("ours_plain"), 1.0],
             [f"ours n-gram γ={args.gamma} (τ={med('tau'):.2f})", med("ours_ngram"), median([r["ours_ngram"] / r["ours_plain"] for r in rows])]]
    if hf32 is not None:
        for key, name in [("hf_fp32", "transformers generate fp32"), ("hf_bf16", "transformers generate bf16"),
                          ("hf_fp32_lookup", f"transformers prompt lookup fp32 ({args.gamma})")]:
            table.append([name, med(key), median([r[key] / r["ours_plain"] for r in rows])])
    print_table(["decoder", "tok/s", "x ours plain"], table)
    if hf32 is not None:
        print(f"\nours plain / transformers fp32 = {median([r['ours_plain'] / r['hf_fp32'] for r in rows]):.2f}x, "
              f"/ transformers bf16 = {median([r['ours_plain'] / r['hf_bf16'] for r in rows]):.2f}x")


if __name__ == "__main__":
    main()
