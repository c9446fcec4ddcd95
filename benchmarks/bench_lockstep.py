"""Engines stepped in lockstep: what a policy / drafter costs or buys at C concurrent requests,
with machine noise cancelled round by round.

    python benchmarks/bench_lockstep.py --engines none,dspark-lookup:dspark --concurrency 1 2 4 8 16 \
        --temperature 0 1 --repeats 3 --max-tokens 64

Every engine runs over the same target runtime and gets the same C requests (first-turn prompts
of gsm8k, humaneval, mt-bench and mbpp, cut at --max-prompt-chars, --max-tokens new tokens each,
no early stop); then the engines take one round each in turn until all are done. A slow moment
of a shared machine therefore hits every engine's rounds alike, where `dspark bench serve`
(one server per policy, one after the other) saw the same point move by 30 % between runs on a
shared 2-core host. The first round of each batch prefills every prompt and is left out: the
rates are of decode rounds only (emitted tokens / seconds in `step`). Ratios are to the first
engine, per repeat; the table gives their median. Greedy outputs of all engines are checked
equal. Engine specs: "none" (plain decoding) or "DRAFTER[:POLICY]" (policy default `dspark`,
with an SPS profile measured first as the servers do).
"""

from __future__ import annotations

import argparse
import statistics
import time

from common import cpu_name, load_prompts, print_table
from dspark.drafters.registry import make_drafter
from dspark.engine.speculative import GenerationRequest, SpeculativeEngine
from dspark.model.target_runtime import TargetConfig, TargetRuntime
from dspark.model.tokenizer import Tokenizer
from dspark.profiling.sps import profile_sps
from dspark.sampling.params import SamplingParams
from dspark.scheduling.policies import parse_policy


def build_engine(runtime: TargetRuntime, spec: str, gamma: int, sps) -> SpeculativeEngine:
    if spec == "none":
        return SpeculativeEngine(runtime, None)
    drafter, policy = spec.split(":", 1) if ":" in spec else (spec, "dspark")
    engine = SpeculativeEngine(runtime, make_drafter(drafter, runtime=runtime), num_speculative_tokens=gamma,
                               policy=parse_policy(policy))
    if engine.policy is not None and engine.policy.needs_sps_profile:
        engine.sps_profile = sps
    return engine


def lockstep(engines: list[SpeculativeEngine], prompts: list[list[int]], *, batch: int, concurrency: int,
             max_tokens: int, temperature: float) -> list[dict]:
    """One batch of `concurrency` requests per engine, stepped round by round in turn."""
    for j, engine in enumerate(engines):
        for i in range(concurrency):
            params = SamplingParams(temperature=temperature, seed=batch * 1000 + i if temperature > 0 else None)
            engine.add_request(GenerationRequest(f"e{j}-b{batch}-{i}", prompts[(batch * concurrency + i) % len(prompts)],
                                                 max_tokens, params, stop_token_ids=frozenset()))
    stats = [{"seconds": 0.0, "tokens": 0, "rounds": 0, "outputs": {}} for _ in engines]
    while any(e.has_unfinished for e in engines):
        for engine, st in zip(engines, stats):
            if not engine.has_unfinished:
                continue
            t0 = time.perf_counter()
            outs = engine.step()
            dt = time.perf_counter() - t0
            if st["rounds"] > 0:  # round 0 prefills every prompt
                st["seconds"] += dt
                st["tokens"] += sum(len(o.new_token_ids) for o in outs)
            st["rounds"] += 1
            for o in outs:
                st["outputs"].setdefault(o.request_id.split("-", 1)[1], []).extend(o.new_token_ids)
    return stats


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engines", default="none,dspark-lookup:dspark")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    ap.add_argument("--temperature", type=float, nargs="+", default=[0.0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--max-prompt-chars", type=int, default=600)
    ap.add_argument("--gamma", type=int, default=7)
    args = ap.parse_args()

    runtime = TargetRuntime.load(TargetConfig())
    tokenizer = Tokenizer(runtime.model_dir)
    texts = [t for b in ("gsm8k", "humaneval", "mt-bench", "mbpp") for t in load_prompts(b, 16)]
    prompts = [tokenizer.encode_chat([{"role": "user", "content": t[: args.max_prompt_chars]}]) for t in texts]
    sps = profile_sps(runtime, max_batch=max(64, max(args.concurrency) * (args.gamma + 1)), tokens_per_request=args.gamma + 1)
    specs = args.engines.split(",")
    engines = [build_engine(runtime, s, args.gamma, sps) for s in specs]
    lockstep(engines, prompts, batch=0, concurrency=2, max_tokens=8, temperature=0.0)  # warm-up

    rows, batch = [], 1
    for temperature in args.temperature:
        for c in args.concurrency:
            ratios: dict[str, list[float]] = {s: [] for s in specs}
            rates: dict[str, list[float]] = {s: [] for s in specs}
            rounds: dict[str, list[int]] = {s: [] for s in specs}
            for _ in range(args.repeats):
                stats = lockstep(engines, prompts, batch=batch, concurrency=c, max_tokens=args.max_tokens, temperature=temperature)
                batch += 1
                if temperature == 0.0:
                    assert all(st["outputs"] == stats[0]["outputs"] for st in stats), "greedy outputs differ between engines"
                base = stats[0]["tokens"] / stats[0]["seconds"]
                for s, st in zip(specs, stats):
                    rate = st["tokens"] / st["seconds"]
                    rates[s].append(rate)
                    ratios[s].append(rate / base)
                    rounds[s].append(st["rounds"])
            for s in specs:
                rows.append([f"{temperature:g}", c, s, round(statistics.median(rates[s]), 1),
                             round(statistics.median(ratios[s]), 3), " ".join(f"{r:.3f}" for r in ratios[s]),
                             round(statistics.median(rounds[s]))])
            print(f"T={temperature:g} C={c}: " + ", ".join(f"{s} x{statistics.median(ratios[s]):.3f}" for s in specs), flush=True)
    print(f"\n{cpu_name()}; decode rounds only, {args.max_tokens} tokens a request, "
          f"median of {args.repeats} lockstep repeats")
    print_table(["T", "C", "engine", "tok/s", f"x {specs[0]}", "per repeat", "rounds"], rows)


if __name__ == "__main__":
    main()
