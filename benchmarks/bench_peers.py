"""Single requests against peers (issue #6, item 5): `transformers` `generate()` plain and with
prompt lookup, against our engine with no drafter and with the DSpark drafter; greedy, same
prompts, same machine, one run.

    python benchmarks/bench_peers.py --benchmarks gsm8k,humaneval,mt-bench --prompts 4 --max-tokens 96 \\
        --repeats 3 --drafter-path runs/dspark/final --csv docs/results/peers.csv

llama.cpp (through `llama-cpp-python`, plain decoding, --llama-threads threads) runs when the
package is installed and a GGUF of the same weights exists (--gguf, default: the bf16 file
scripts/make_gguf.sh writes); otherwise its row is left out with a note saying how to get it.
It is fed the same prompt token ids (our chat template) and generates exactly --max-tokens
tokens greedily (top-k 1, no repetition penalty).

One request at a time (single-user latency), every request generating exactly --max-tokens new
tokens (no early stop) so that every decoder does the same work. Ratios are taken within each
repeat (same machine state) against ours with no drafter, and the median over repeats is
reported, as in bench_decode.py, whose runners this reuses. The DSpark row runs the drafter at
--gamma with --policy (default `dspark`, Algorithm 1 on an SPS(B) profile measured first; `all`
verifies every draft); it is left out, with a note, when no checkpoint is given or shipped.
"""

from __future__ import annotations

import argparse
import csv
import subprocess
import sys
import time
from pathlib import Path

import torch
from bench_decode import run_engine, run_hf
from common import load_prompts, median, print_table

from dspark.drafters import drafter_capture_layers, make_drafter
from dspark.drafters.shipped import shipped_checkpoint
from dspark.engine.speculative import SpeculativeEngine
from dspark.serving_config import WEIGHT_CHOICES
from dspark.model.target_runtime import TargetConfig, TargetRuntime
from dspark.model.tokenizer import Tokenizer
from dspark.profiling.sps import profile_sps
from dspark.scheduling.policies import parse_policy

CSV_COLUMNS = ("decoder", "tokens_per_s", "x_ours_none", "accepted_length", "benchmarks", "prompts", "max_tokens", "temperature", "repeats")


def dspark_engine(runtime: TargetRuntime, path: str, *, gamma: int, policy: str, drafter: str = "dspark") -> SpeculativeEngine:
    """Our engine with a DSpark checkpoint at `gamma` (`drafter` "dspark", or "dspark-lookup": with
    lookup proposals); `policy` "all" verifies every draft."""
    policy_obj = None if policy == "all" else parse_policy(policy)
    engine = SpeculativeEngine(runtime, make_drafter(drafter, runtime=runtime, path=path), num_speculative_tokens=gamma,
                               policy=policy_obj)
    if policy_obj is not None and policy_obj.needs_sps_profile:  # as `dspark generate` and `dspark serve` do
        engine.sps_profile = profile_sps(runtime, max_batch=2 * (gamma + 1), tokens_per_request=gamma + 1)
    return engine


def default_gguf_path(model_dir: Path) -> Path:
    """Where scripts/make_gguf.sh writes the bf16 GGUF of a model directory."""
    return Path.home() / ".cache" / "dspark" / "gguf" / f"{Path(model_dir).name}-bf16.gguf"


def load_llama_cpp(gguf: Path, *, threads: int):
    """A llama.cpp model, or (None, why not) when the package or the file is missing."""
    try:
        from llama_cpp import Llama
    except ImportError:
        return None, "llama-cpp-python is not installed (pip install llama-cpp-python: builds from source, ~12 min on 2 cores)"
    if not gguf.is_file():
        return None, f"no GGUF at {gguf} (bash scripts/make_gguf.sh writes a bf16 one of the default model)"
    why_not = llama_cpp_crash(gguf, threads=threads)
    if why_not is not None:
        return None, why_not
    return Llama(model_path=str(gguf), n_ctx=2048, n_threads=threads, n_threads_batch=threads, verbose=False), None


# Loads the GGUF and decodes one token, as load_llama_cpp and run_llama do.
_LLAMA_PROBE = """
import sys
from llama_cpp import Llama
llm = Llama(model_path=sys.argv[1], n_ctx=64, n_threads=int(sys.argv[2]), n_threads_batch=int(sys.argv[2]), verbose=False)
next(iter(llm.generate([1, 2, 3], top_k=1, temp=0.0)))
"""


def llama_cpp_crash(gguf: Path, *, threads: int, timeout_s: float = 300) -> str | None:
    """None when llama.cpp loads `gguf` and decodes a token in a child process, else why not.

    Why a child: a crash inside llama.cpp takes the whole process with it (llama-cpp-python
    0.3.36 segfaults on the default model's own Q4_1 GGUF on an AMX Xeon), and would end the
    run with no table at all instead of one missing row."""
    try:
        child = subprocess.run([sys.executable, "-c", _LLAMA_PROBE, str(gguf), str(threads)], capture_output=True,
                               text=True, timeout=timeout_s, check=False)
    except subprocess.TimeoutExpired:
        return f"llama.cpp did not load {gguf.name} and decode a token within {timeout_s:.0f} s in a child process"
    if child.returncode == 0:
        return None
    how = f"signal {-child.returncode}" if child.returncode < 0 else f"exit status {child.returncode}"
    last = child.stderr.strip().splitlines()[-1:] or ["no message"]
    return f"llama.cpp failed on {gguf.name} in a child process ({how}: {last[0][:200]})"


def run_llama(llm, prompt_ids: list[list[int]], max_tokens: int, temperature: float = 0.0) -> tuple[float, int]:
    """Plain decoding of exactly max_tokens tokens per prompt (prompt evaluation included, as in
    ours): greedy, or sampled from the full softmax at `temperature`. Returns seconds, tokens."""
    seconds, tokens = 0.0, 0
    top_k = 1 if temperature == 0 else 0
    for ids in prompt_ids:
        t0 = time.perf_counter()
        n = 0
        for _ in llm.generate(ids, top_k=top_k, top_p=1.0, min_p=0.0, temp=temperature, repeat_penalty=1.0, reset=True):
            n += 1
            if n == max_tokens:
                break
        seconds += time.perf_counter() - t0
        tokens += n
    return seconds, tokens


def write_csv(path: str | Path, rows: list[dict]) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(CSV_COLUMNS), lineterminator="\n")
        writer.writeheader()
        writer.writerows(rows)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--benchmarks", default="gsm8k,humaneval,mt-bench", help="comma-separated sets of ../shared/data/eval")
    ap.add_argument("--prompts", type=int, default=4, help="first-turn prompts per benchmark")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--gamma", type=int, default=7, help="draft tokens per round: DSpark's block and prompt lookup's")
    ap.add_argument("--drafter-path", default=None, help="DSpark checkpoint directory (default: the shipped one, if any)")
    ap.add_argument("--drafters", default="dspark,dspark-lookup",
                    help="our speculative rows on the DSpark checkpoint: dspark, dspark-lookup (comma-separated)")
    ap.add_argument("--policy", default="dspark", help="DSpark row: none | fixed:K | threshold:C | dspark | dspark-async | all")
    ap.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"], help="our linear layers")
    ap.add_argument("--weights", default="auto", choices=WEIGHT_CHOICES,
                    help="our linear layers' weights (auto: compact exact blocks where the checkpoint has them)")
    ap.add_argument("--also-weights", default="",
                    help="comma-separated other weights modes (e.g. compact-int8) whose plain and drafter rows run beside")
    ap.add_argument("--device", default="cpu", help="where our rows run: auto | cpu | cuda | cuda:N (model.device); the peers stay on the CPU")
    ap.add_argument("--dense-baseline", action="store_true",
                    help="also run our plain decoding on dense weights (--dtype), beside the --weights rows")
    ap.add_argument("--hf-dtypes", default="float32", help="transformers dtypes, comma-separated (float32 is its default)")
    ap.add_argument("--temperature", type=float, default=0.0, help="0: greedy; > 0: sampled (full softmax, seeded per prompt)")
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--gguf", default=None, help="llama.cpp peer: GGUFs of the same weights, comma-separated "
                    "(default: scripts/make_gguf.sh's bf16 file; `package` = the default model's own Q4_1 file)")
    ap.add_argument("--llama-threads", type=int, default=torch.get_num_threads(), help="llama.cpp threads (default: torch's)")
    ap.add_argument("--skip-llama", action="store_true")
    ap.add_argument("--csv", default=None, help="also write the table here")
    args = ap.parse_args()

    benchmarks = [b.strip() for b in args.benchmarks.split(",") if b.strip()]
    drafters = [d.strip() for d in args.drafters.split(",") if d.strip()]
    if not set(drafters) <= {"dspark", "dspark-lookup"}:
        print(f"error: --drafters takes dspark and/or dspark-lookup, got {args.drafters!r}", file=sys.stderr)
        return 2
    drafter_path = args.drafter_path or shipped_checkpoint("dspark")
    try:
        if args.policy != "all":
            parse_policy(args.policy)
        hf_dtypes = [getattr(torch, d.strip(), None) for d in args.hf_dtypes.split(",") if d.strip()]
        if not all(isinstance(d, torch.dtype) for d in hf_dtypes):
            raise ValueError(f"--hf-dtypes must name torch dtypes (float32, bfloat16), got {args.hf_dtypes!r}")
        capture = drafter_capture_layers("dspark", drafter_path) if drafter_path else None
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        runtime = TargetRuntime.load(TargetConfig(dtype=args.dtype, weights=args.weights, capture_layers=capture, device=args.device))
    except ValueError as e:  # e.g. compact weights asked for on a GPU, or a device torch cannot reach
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"ours: linear layers {runtime.linear_numerics}", file=sys.stderr)
    tokenizer = Tokenizer(runtime.model_dir)
    prompt_ids = [tokenizer.encode_chat([{"role": "user", "content": p}])
                  for b in benchmarks for p in load_prompts(b, args.prompts)]
    engines = {"ours none": SpeculativeEngine(runtime, None)}
    if args.dense_baseline:
        dense = TargetRuntime.load(TargetConfig(dtype=args.dtype, weights="dense", device=args.device))
        engines[f"ours none, dense {dense.linear_numerics}"] = SpeculativeEngine(dense, None)
    others = [w.strip() for w in args.also_weights.split(",") if w.strip()]
    if not set(others) <= set(WEIGHT_CHOICES):
        print(f"error: --also-weights takes {', '.join(WEIGHT_CHOICES)}, got {args.also_weights!r}", file=sys.stderr)
        return 2
    runtimes = {"": runtime}
    for w in others:
        other = TargetRuntime.load(TargetConfig(dtype=args.dtype, weights=w, capture_layers=capture, device=args.device))
        runtimes[f", {other.linear_numerics}"] = other
        engines[f"ours none, {other.linear_numerics}"] = SpeculativeEngine(other, None)
    if drafter_path:
        for suffix, rt in runtimes.items():
            for name in drafters:
                engines[f"ours {name} γ={args.gamma} {args.policy}{suffix}"] = dspark_engine(
                    rt, str(drafter_path), gamma=args.gamma, policy=args.policy, drafter=name)
    else:
        print("note: no DSpark checkpoint (--drafter-path, none shipped): the dspark row is left out", file=sys.stderr)
    hf = {}
    if not args.skip_hf:
        from transformers import AutoModelForCausalLM

        for dtype in hf_dtypes:
            model = AutoModelForCausalLM.from_pretrained(str(runtime.model_dir), dtype=dtype).eval()
            name = str(dtype).removeprefix("torch.")
            hf[f"transformers generate {name}"] = (model, {})
            hf[f"transformers prompt lookup {name} ({args.gamma})"] = (model, {"prompt_lookup_num_tokens": args.gamma})
    llama = {}
    if not args.skip_llama:
        from dspark.model.model_store import default_gguf_path as package_gguf_path

        for name in (args.gguf.split(",") if args.gguf else [""]):
            gguf = (package_gguf_path() if name.strip() == "package" else Path(name.strip()) if name.strip()
                    else default_gguf_path(runtime.model_dir))
            llm, why_not = load_llama_cpp(gguf, threads=args.llama_threads)
            if llm is None:
                print(f"note: the llama.cpp row of {gguf.name} is left out: {why_not}", file=sys.stderr)
            else:
                label = gguf.stem.rsplit("-", 1)[-1].rsplit(".", 1)[-1].lower()  # ...-bf16 -> bf16, ....Q4_1 -> q4_1
                llama[f"llama.cpp {label} ({args.llama_threads} threads)"] = llm
    for engine in engines.values():
        run_engine(engine, prompt_ids[:1], 8, None)  # warm-up
    for llm in llama.values():
        run_llama(llm, prompt_ids[:1], 8)
    for model, kwargs in hf.values():
        run_hf(model, prompt_ids[:1], 8, **kwargs)

    repeats = []
    for rep in range(args.repeats):
        speed, tau = {}, {}
        for name, engine in engines.items():
            s, n, tau[name] = run_engine(engine, prompt_ids, args.max_tokens, None, temperature=args.temperature)
            speed[name] = n / s
        for name, (model, kwargs) in hf.items():
            s, n = run_hf(model, prompt_ids, args.max_tokens, temperature=args.temperature, **kwargs)
            speed[name] = n / s
        for name, llm in llama.items():
            s, n = run_llama(llm, prompt_ids, args.max_tokens, temperature=args.temperature)
            speed[name] = n / s
        repeats.append((speed, tau))
        print(f"repeat {rep}: " + ", ".join(f"{k}={v:.2f}" for k, v in speed.items()), flush=True)

    names = list(repeats[0][0])
    rows = []
    for name in names:
        tau = median([r[1][name] for r in repeats]) if name in repeats[0][1] else None
        rows.append({"decoder": name, "tokens_per_s": round(median([r[0][name] for r in repeats]), 2),
                     "x_ours_none": round(median([r[0][name] / r[0]["ours none"] for r in repeats]), 3),
                     "accepted_length": "" if tau is None or name == "ours none" else round(tau, 3),
                     "benchmarks": "+".join(benchmarks), "prompts": len(prompt_ids), "max_tokens": args.max_tokens,
                     "temperature": args.temperature, "repeats": args.repeats})
    print(f"\n{'+'.join(benchmarks)}, {len(prompt_ids)} prompts x {args.max_tokens} new tokens, "
          f"{'greedy' if args.temperature == 0 else f'T = {args.temperature}'}, one request at a "
          f"time, median of {args.repeats} repeats")
    print_table(["decoder", "tok/s", "x ours none", "τ"],
                [[r["decoder"], r["tokens_per_s"], r["x_ours_none"], r["accepted_length"] or "-"] for r in rows])
    if args.csv:
        write_csv(args.csv, rows)
        print(f"wrote {args.csv}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
