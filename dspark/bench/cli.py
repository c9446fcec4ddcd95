"""`dspark bench`: the serving benchmark (issue #6) and its report.

    dspark bench serve --policies none,fixed:1,fixed:7,threshold:0.5,dspark,dspark-async \\
        --concurrency 1,2,4,8 --temperature 0,1 --max-tokens 128 --requests-per-point 32 \\
        --drafter dspark --drafter-path runs/dspark/final
    dspark bench serve --url http://127.0.0.1:8000 --policies dspark --concurrency 1,4    # a running server
    dspark bench serve --policies dspark --rate 0.5,1,2 --duration 120                     # open loop (Poisson)
    dspark bench plot --csv docs/results/serving.csv --out docs/results/
    dspark bench soak --duration 180 --concurrency 8                                     # leak check (dspark/bench/soak.py)

`bench serve` starts `dspark serve` for each policy in turn (a free port, /health, stopped after;
its log in --server-log-dir), or with --url loads a server already running (then --policies
names the one policy it runs, the label its rows get). Each finished point is merged into the
CSV at once (serve_csv.py), so an interrupted run keeps what it measured and a rerun replaces
its own rows. `add_bench_parser(subparsers)` registers the command on dspark/cli.py's parser.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
from pathlib import Path

from dspark.cli_args import comma_floats, comma_ints, comma_names


def add_bench_parser(subparsers) -> None:
    b = subparsers.add_parser("bench", help="serving benchmark: load the OpenAI API per policy, plot Figs. 7-8")
    sub = b.add_subparsers(dest="bench_command", required=True)

    s = sub.add_parser("serve", help="load generator against `dspark serve` per policy (or --url)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    s.add_argument("--policies", type=comma_names, default=("none", "fixed:1", "fixed:7", "threshold:0.5", "dspark", "dspark-async"),
                   help="comma-separated: none | fixed:K | threshold:C | dspark | dspark-async (with --url: exactly one)")
    s.add_argument("--url", default=None, help="load this running server instead of starting one per policy")
    s.add_argument("--concurrency", type=comma_ints, default=None, help="closed-loop levels, e.g. 1,2,4,8,16,32,64 (default 1,2,4,8)")
    s.add_argument("--rate", type=comma_floats, default=(), help="open-loop Poisson arrival rates in requests/s, e.g. 0.5,1,2")
    s.add_argument("--temperature", type=comma_floats, default=(0.0, 1.0), help="comma-separated, e.g. 0,1")
    s.add_argument("--max-tokens", type=int, default=128)
    s.add_argument("--requests-per-point", type=int, default=32,
                   help="measured requests per point (closed loop: at least 2 per client)")
    s.add_argument("--duration", type=float, default=None, help="seconds per point instead of a request count")
    s.add_argument("--warmup", type=int, default=None, help="warm-up requests per point (default: the concurrency, or ceil(rate))")
    s.add_argument("--seed", type=int, default=0, help="request k of a point is sent with seed + k")
    s.add_argument("--prompt-sets", type=comma_names, default=("math", "code", "chat"),
                   help="domains (math, code, chat) or benchmark names of ../shared/data/eval, interleaved")
    s.add_argument("--prompts-per-benchmark", type=int, default=64)
    s.add_argument("--max-prompt-chars", type=int, default=4000, help="leave out longer prompts (0: keep all)")
    s.add_argument("--endpoint", choices=("chat", "completions"), default="chat")
    s.add_argument("--csv", default="docs/results/serving.csv", help="merged into (see dspark/bench/serve_csv.py)")
    s.add_argument("--records-dir", default=None, help="also write every request's record here (JSON lines per policy)")
    s.add_argument("--batch-metric", default=None, help="/metrics name of the verifier batch size (default: found by name)")
    s.add_argument("--api-key", default=os.environ.get("DSPARK_API_KEY"), help="bearer key (default $DSPARK_API_KEY)")
    s.add_argument("--request-timeout", type=float, default=900.0, help="seconds per request")
    s.add_argument("--no-progress", action="store_true")
    g = s.add_argument_group("servers started per policy (ignored with --url)")
    g.add_argument("--drafter", default="dspark", help="the drafter every policy but none runs")
    g.add_argument("--drafter-path", default=None, help="its checkpoint directory (default: the one shipped for the target, if any)")
    g.add_argument("--gamma", type=int, default=7, help="draft tokens per round (block size)")
    g.add_argument("--model", default="smollm2-135m-instruct")
    g.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"])
    g.add_argument("--kv-budget-mb", type=int, default=None)
    g.add_argument("--sps-max-batch", type=int, default=None, help="SPS(B) profile bound at server start (default: serve's)")
    g.add_argument("--server-start-timeout", type=float, default=900.0, help="seconds to wait for /health")
    g.add_argument("--server-log-dir", default=None, help="one serve-<policy>.log per server (default: a temporary directory)")
    s.set_defaults(func=cmd_bench_serve)

    p = sub.add_parser("plot", help="Fig. 7 frontier, Fig. 8 budget and the markdown summary from the CSV")
    p.add_argument("--csv", default="docs/results/serving.csv")
    p.add_argument("--out", default="docs/results/", help="directory for serving_frontier.png, serving_budget.png, serving_summary.md")
    p.add_argument("--reference", default="fixed:1", help="the policy speedups are measured against (MTP-1)")
    p.add_argument("--baseline", default="none", help="the policy no other may fall below")
    p.add_argument("--sla", type=comma_floats, default=(10.0, 20.0), help="per-user tokens/s SLAs, e.g. 10,20")
    p.set_defaults(func=cmd_bench_plot)

    from dspark.bench.soak import add_soak_parser

    add_soak_parser(sub)


def _check_args(args) -> str | None:
    """The first problem with the arguments, or None."""
    from dspark.scheduling.policies import parse_policy

    if not args.policies:
        return "--policies is empty"
    for policy in args.policies:
        try:
            parse_policy(policy)
        except ValueError as e:
            return str(e)
    if args.url and len(args.policies) != 1:
        return f"with --url the server runs one policy: give exactly one in --policies (its label), got {list(args.policies)}"
    if any(c < 1 for c in args.concurrency or ()):
        return f"--concurrency levels must be >= 1, got {list(args.concurrency)}"
    if any(not r > 0 for r in args.rate):
        return f"--rate values must be > 0 requests/s, got {list(args.rate)}"
    if not args.temperature or any(t < 0 for t in args.temperature):
        return f"--temperature needs values >= 0, got {list(args.temperature)}"
    return None


def cmd_bench_serve(args) -> int:
    from dspark.bench.serve_csv import details_path, record_points
    from dspark.bench.serve_load import LoadConfig, PointResult, describe, run_sweep, write_records
    from dspark.bench.serve_process import ServerSpec, free_port, running_server, serve_command
    from dspark.bench.serve_prompts import load_prompt_mix

    if args.concurrency is None:
        args.concurrency = () if args.rate else (1, 2, 4, 8)
    problem = _check_args(args)
    try:
        config = LoadConfig(max_tokens=args.max_tokens, seed=args.seed, warmup=args.warmup,
                            requests=None if args.duration else args.requests_per_point, duration_s=args.duration,
                            endpoint=args.endpoint, request_timeout_s=args.request_timeout, batch_metric=args.batch_metric,
                            progress=not args.no_progress)
        prompts = load_prompt_mix(args.prompt_sets, per_benchmark=args.prompts_per_benchmark,
                                  max_chars=args.max_prompt_chars or None) if problem is None else []
    except (ValueError, FileNotFoundError) as e:
        problem = problem or str(e)
    if problem is not None:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    print(f"{len(prompts)} prompts ({', '.join(args.prompt_sets)}); CSV {args.csv}", file=sys.stderr)

    noted = []

    def on_point(result: PointResult) -> None:
        print(describe(result.summary), flush=True)
        if result.summary.verifier_batch_tokens is None and not noted:
            noted.append(True)
            print("note: the server exposes no verifier batch size at /metrics: verifier_batch_tokens is left empty "
                  f"in {details_path(args.csv)}", file=sys.stderr)
        record_points(args.csv, [result.summary])
        if args.records_dir:
            write_records(Path(args.records_dir) / f"{result.summary.policy.replace(':', '_')}.jsonl", result)

    def sweep(url: str, policy: str) -> None:
        asyncio.run(run_sweep(url, config, prompts, policy=policy, temperatures=args.temperature,
                              concurrencies=args.concurrency, rates=args.rate, api_key=args.api_key, on_point=on_point))

    if args.url:
        try:
            sweep(args.url, args.policies[0])
        except RuntimeError as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
        return 0

    from dspark.serving_config import GatewaySection

    spec = ServerSpec(drafter=args.drafter, drafter_path=args.drafter_path, gamma=args.gamma, model=args.model,
                      dtype=args.dtype, kv_budget_mb=args.kv_budget_mb, sps_max_batch=args.sps_max_batch,
                      # raise the server's limit (dspark serve: gateway.max_tokens_limit) only where needed
                      max_tokens_limit=args.max_tokens if args.max_tokens > GatewaySection.max_tokens_limit else None)
    log_dir = Path(args.server_log_dir or tempfile.mkdtemp(prefix="dspark-bench-"))
    failed = []
    for policy in args.policies:
        port = free_port(spec.host)
        log_path = log_dir / f"serve-{policy.replace(':', '_')}.log"
        print(f"starting dspark serve for policy {policy} on port {port} (log {log_path})", file=sys.stderr, flush=True)
        try:
            with running_server(serve_command(policy, spec, port=port), url=f"http://{spec.host}:{port}", log_path=log_path,
                                start_timeout_s=args.server_start_timeout) as url:
                sweep(url, policy)
        except (RuntimeError, TimeoutError) as e:  # the next policy may still run: report this one at the end
            print(f"error: policy {policy}: {e}", file=sys.stderr, flush=True)
            failed.append(policy)
    if failed:
        print(f"error: these policies did not complete: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


def cmd_bench_plot(args) -> int:
    from dspark.bench.serve_plots import write_report

    try:
        files, markdown = write_report(args.csv, args.out, reference=args.reference, baseline=args.baseline, slas=args.sla)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(markdown)
    print("wrote " + ", ".join(str(f) for f in files), file=sys.stderr)
    return 0
