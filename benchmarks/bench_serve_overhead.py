"""What the serving path costs per token at one request: `dspark serve` driven by the official
`openai` client against the bare engine, same prompts, same drafter and policy, same machine,
one run (issue #16 item 4: HTTP, SSE, bus and threads add at most 10 % per token at C = 1;
issue #15: a speculative speedup through `dspark serve` within 10 % of the engine's).

    python benchmarks/bench_serve_overhead.py --benchmarks gsm8k,humaneval,mt-bench --prompts 2 --max-tokens 128 --repeats 3

Two setups, each once as a server and once as the bare engine in this process:
  plain          `dspark serve --drafter none --policy none`  vs  SpeculativeEngine(runtime, None)
  DRAFTER POLICY `dspark serve --drafter D --policy P`        vs  the engine with the same drafter and policy
(default dspark-lookup with the `dspark` policy: the serving default). Every request is a
greedy chat completion (the server's chat template; the engine gets the same prompt ids) that
stops at end of sequence or --max-tokens, streamed as the user sees it: seconds from sending
the request to its last token, and the time to the first token. The server's greedy text must
equal the engine's decoded output (the benchmark stops otherwise: the two paths would not be
doing the same work). Servers stay up, idle, while the engine runs; setups and paths alternate
within each repeat and the medians of per-repeat numbers are reported.

Per-token overhead = serve seconds per token / engine seconds per token - 1, over the same
tokens. The speculative speedup is taken over plain in each path: serve's against the engine's.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from pathlib import Path

from bench_peers import dspark_engine
from common import load_prompts, median, print_table

from dspark.bench.serve_process import ServerSpec, free_port, running_server, serve_command
from dspark.drafters import drafter_capture_layers
from dspark.drafters.shipped import shipped_checkpoint
from dspark.engine.speculative import SpeculativeEngine
from dspark.engine.requests import GenerationRequest
from dspark.model.target_runtime import TargetConfig, TargetRuntime
from dspark.model.tokenizer import Tokenizer
from dspark.sampling.params import SamplingParams

PLAIN = "plain"


def stream_chat(client, model: str, prompt: str, max_tokens: int) -> tuple[float, float, str, int]:
    """One greedy streamed chat completion: (seconds to the last token, seconds to the first,
    text, completion tokens from the usage chunk)."""
    t0 = time.perf_counter()
    first, text, tokens = None, [], 0
    stream = client.chat.completions.create(model=model, messages=[{"role": "user", "content": prompt}],
                                            max_tokens=max_tokens, temperature=0.0, stream=True,
                                            stream_options={"include_usage": True})
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            if first is None:
                first = time.perf_counter() - t0
            text.append(chunk.choices[0].delta.content)
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    return time.perf_counter() - t0, first or 0.0, "".join(text), tokens


def run_engine_requests(engine: SpeculativeEngine, prompt_ids: list[list[int]], max_tokens: int,
                        stop: frozenset[int]) -> tuple[float, list[list[int]], float]:
    """The same requests on the bare engine, one at a time: (seconds, outputs, mean τ)."""
    seconds, outputs, taus = 0.0, [], []
    for i, ids in enumerate(prompt_ids):
        req = GenerationRequest(f"o{i}", ids, max_tokens, SamplingParams(temperature=0.0), stop_token_ids=stop)
        t0 = time.perf_counter()
        (state,) = engine.generate([req])
        seconds += time.perf_counter() - t0
        outputs.append(list(state.output_ids))
        taus.append(state.mean_accepted_length)
    return seconds, outputs, sum(taus) / len(taus)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--benchmarks", default="gsm8k,humaneval,mt-bench", help="comma-separated sets of ../shared/data/eval")
    ap.add_argument("--prompts", type=int, default=2, help="first-turn prompts per benchmark")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--drafter", default="dspark-lookup", help="the speculative setup's drafter (dspark or dspark-lookup)")
    ap.add_argument("--drafter-path", default=None, help="its checkpoint (default: the shipped one)")
    ap.add_argument("--policy", default="dspark", help="the speculative setup's policy (server and engine)")
    ap.add_argument("--gamma", type=int, default=7)
    ap.add_argument("--log-dir", default="runs/bench_serve_overhead", help="the servers' logs")
    args = ap.parse_args()
    if args.drafter not in ("dspark", "dspark-lookup"):
        print(f"error: --drafter takes dspark or dspark-lookup, got {args.drafter!r}", file=sys.stderr)
        return 2
    try:
        import openai
    except ImportError:
        print("error: the official openai client is not installed (pip install openai)", file=sys.stderr)
        return 2

    drafter_path = str(args.drafter_path or shipped_checkpoint("dspark"))
    runtime = TargetRuntime.load(TargetConfig(capture_layers=drafter_capture_layers("dspark", drafter_path)))
    tokenizer = Tokenizer(runtime.model_dir)
    benchmarks = [b.strip() for b in args.benchmarks.split(",") if b.strip()]
    prompts = [p for b in benchmarks for p in load_prompts(b, args.prompts)]
    prompt_ids = [tokenizer.encode_chat([{"role": "user", "content": p}]) for p in prompts]
    stop = frozenset(tokenizer.eos_token_ids)
    speculative = f"{args.drafter} {args.policy}"
    engines = {PLAIN: SpeculativeEngine(runtime, None),
               speculative: dspark_engine(runtime, drafter_path, gamma=args.gamma, policy=args.policy, drafter=args.drafter)}
    spec = ServerSpec(drafter=args.drafter, drafter_path=drafter_path, gamma=args.gamma)
    policies = {PLAIN: "none", speculative: args.policy}
    print(f"ours: linear layers {runtime.linear_numerics}; {len(prompts)} prompts; starting two servers", file=sys.stderr)

    with contextlib.ExitStack() as stack:
        clients = {}
        for name, policy in policies.items():
            port = free_port()
            url = stack.enter_context(running_server(serve_command(policy, spec, port=port), url=f"http://127.0.0.1:{port}",
                                                     log_path=Path(args.log_dir) / f"{policy}.log"))
            clients[name] = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=600.0, max_retries=0)
        model = spec.model
        for name in engines:  # warm-up: both paths, every setup
            run_engine_requests(engines[name], prompt_ids[:1], 8, stop)
            stream_chat(clients[name], model, prompts[0], 8)

        repeats = []
        for rep in range(args.repeats):
            row = {}
            for name in engines:
                s_engine, outputs, tau = run_engine_requests(engines[name], prompt_ids, args.max_tokens, stop)
                served = [stream_chat(clients[name], model, p, args.max_tokens) for p in prompts]
                tokens = sum(len(o) for o in outputs)
                for i, (out, (_, _, text, n)) in enumerate(zip(outputs, served)):
                    if text != tokenizer.decode(out) or n != len(out):
                        print(f"error: {name}, prompt {i}: the server's greedy answer ({n} tokens) differs from the "
                              f"engine's ({len(out)} tokens); the two paths are not doing the same work", file=sys.stderr)
                        return 1
                s_serve = sum(s[0] for s in served)
                row[name] = {"engine": tokens / s_engine, "serve": tokens / s_serve, "tau": tau,
                             "ttft_ms": 1000 * median([s[1] for s in served]), "tokens": tokens}
            repeats.append(row)
            print(f"repeat {rep}: " + ", ".join(f"{k}: engine {v['engine']:.1f} serve {v['serve']:.1f} tok/s"
                                                for k, v in row.items()), flush=True)

    print(f"\n{'+'.join(benchmarks)}, {len(prompts)} prompts, up to {args.max_tokens} new tokens (stop at end of "
          f"sequence), greedy, one request at a time, median of {args.repeats} repeats; linear layers "
          f"{runtime.linear_numerics}")
    table = []
    for name in engines:
        engine = median([r[name]["engine"] for r in repeats])
        serve = median([r[name]["serve"] for r in repeats])
        overhead = median([r[name]["engine"] / r[name]["serve"] - 1 for r in repeats])
        x_engine = median([r[name]["engine"] / r[PLAIN]["engine"] for r in repeats])
        x_serve = median([r[name]["serve"] / r[PLAIN]["serve"] for r in repeats])
        table.append([name, repeats[0][name]["tokens"], f"{engine:.1f}", f"{serve:.1f}", f"{100 * overhead:+.1f} %",
                      f"{median([r[name]['ttft_ms'] for r in repeats]):.0f}", f"{x_engine:.3f}", f"{x_serve:.3f}",
                      f"{median([r[name]['tau'] for r in repeats]):.2f}"])
    print_table(["setup", "tokens", "engine tok/s", "serve tok/s", "per-token overhead", "serve TTFT ms",
                 "x plain (engine)", "x plain (serve)", "τ"], table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
