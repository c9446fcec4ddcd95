"""Per-round cost of the service split: the same round loop in one process and over gRPC.

`dspark serve` runs the engine, the target (LocalVerifier) and the drafter in one process;
`dspark up` runs the verifier and the drafter as services, one process each, and the engine
talks to them over gRPC on loopback. This benchmark runs the same workload both ways on the same
model and drafter: (a) in-process, `SpeculativeEngine(runtime, drafter)`; (b) split, the same
engine over `RemoteVerifier` + `RemoteDrafter` against `dspark verifier` and `dspark drafter`
started here as separate processes on 127.0.0.1, as `dspark up` starts them. It reports the
median round time (`engine.step()`: draft, schedule, verify, hand over hidden states) of each,
the overhead (split − in-process) as a share of the split round time, the same for the CPU time
a round costs all processes together (this one and the services, every thread: Linux schedstat),
which a loaded machine disturbs far less than wall time, and the payload on the wire per round:
Σ `ByteSize()` of the protobuf requests and replies (services/wire_bytes.py) to and from each
service, admission and release calls included.

Draft rows travel three ways, one table row each:
  point   temperature 0: the drafter sends its argmax as a one-entry sparse row, whatever top-k
  sparse  temperature 1 with drafter.top_k = K: K (id, probability) pairs per draft token
  dense   temperature 1 with drafter.top_k = 0: the full vocabulary per draft token
Requests at concurrency C: C requests admitted together (prompts cycled), no stop tokens (every
request emits max_tokens), temperature-1 requests seeded. Both modes must emit exactly the same
tokens (greedy, and seeded sampling: same rows, same random streams); the benchmark stops with
an error otherwise. Modes alternate within each repeat; medians over repeats. On a shared CPU,
give every process one torch thread (`--threads 1`): spinning OpenMP workers of a contended
process make its rounds many times slower, a different amount in each process.

    python benchmarks/bench_service_split.py --prompts 8 --max-tokens 16 --concurrency 1 4 16 --repeats 1 --threads 1
    python benchmarks/bench_service_split.py --quick --threads 1               # smoke run (most of it: loading models)
    python benchmarks/bench_service_split.py --model DIR --drafter dspark --drafter-path CKPT --quick
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from common import load_prompts, median, print_table

from dspark.drafters import drafter_capture_layers, make_drafter
from dspark.engine.speculative import GenerationRequest, SpeculativeEngine
from dspark.model.target_runtime import TargetConfig, TargetRuntime
from dspark.model.tokenizer import Tokenizer
from dspark.protos import DRAFTER_SERVICE, VERIFIER_SERVICE
from dspark.sampling.params import SamplingParams
from dspark.scheduling.policies import parse_policy
from dspark.serving_config import DEFAULT_MODEL_NAME, ServingConfig
from services.drafter.client import RemoteDrafter
from services.grpc_common import wait_until_serving
from services.verifier.client import RemoteVerifier
from services.wire_bytes import WireBytes

REPO = Path(__file__).resolve().parents[1]
HEADERS = ["rows", "C", "rounds", "tau", "inproc_ms", "split_ms", "overhead_%", "inproc_cpu_ms", "split_cpu_ms", "cpu_overhead_%",
           "to_verifier_kB", "from_verifier_kB", "to_drafter_kB", "from_drafter_kB"]


@dataclass(frozen=True)
class RowKind:
    name: str
    temperature: float
    top_k: int  # the drafter's truncation (drafter.top_k); 0 = full rows


@dataclass
class Run:
    outputs: list[list[int]]  # per request, its emitted tokens
    round_seconds: list[float]  # one per engine.step(), wall time
    round_cpu_seconds: list[float]  # one per engine.step(), CPU time of this process and the services
    draft_tokens: int
    emitted_in_rounds: int
    decode_rounds: int  # Σ over requests of their decode rounds (τ = emitted_in_rounds / this)
    bytes_per_service: dict[str, tuple[int, int]]  # service -> (sent, received), whole run


@dataclass
class Cell:
    """One table row: a kind of draft rows at one concurrency."""

    rows: str  # point | sparse-K | dense
    concurrency: int
    rounds: int  # engine steps of one run (prefill round included)
    tau: float  # tokens per decode round
    inproc_s: float  # median round, in-process
    split_s: float  # median round, split
    overhead_share: float  # (split - inproc) / split, median over repeats
    inproc_cpu_s: float  # median round's CPU time, all processes
    split_cpu_s: float
    cpu_overhead_share: float
    to_verifier: float  # payload bytes per round, scheduler -> verifier
    from_verifier: float
    to_drafter: float
    from_drafter: float


# ---- the two deployments ------------------------------------------------------------------------


def cpu_seconds(pids: list[int]) -> float:
    """CPU time so far of these processes, every thread (/proc/PID/task/TID/schedstat, in ns)."""
    total = 0
    for pid in pids:
        for task in Path(f"/proc/{pid}/task").iterdir():
            try:
                total += int((task / "schedstat").read_text().split()[0])
            except (FileNotFoundError, ProcessLookupError):  # a thread that ended meanwhile
                pass
    return total / 1e9


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServiceProcesses:
    """`dspark verifier` and one `dspark drafter` per top-k, each its own process on loopback."""

    def __init__(self, args: argparse.Namespace, top_ks: list[int], sps_max_batch: int):
        self.procs: list[subprocess.Popen] = []
        # our serving variables would override the flags (and DSPARK_RPC_AUTH_TOKEN would lock us out)
        sections = tuple(f"DSPARK_{name.upper()}_" for name in ServingConfig.__dataclass_fields__)
        env = {k: v for k, v in os.environ.items() if not k.startswith(sections) and k != "DSPARK_CONFIG"}
        if args.threads:  # torch's intra-op threads, as this process has them (torch reads it at start-up)
            env["OMP_NUM_THREADS"] = str(args.threads)
        common = ["--model", args.model, "--dtype", args.dtype, "--drafter", args.drafter, "--log-level", "warning",
                  "--host", "127.0.0.1"] + (["--drafter-path", args.drafter_path] if args.drafter_path else [])
        try:
            self.verifier = self._start(["verifier", *common, "--kv-budget-mb", str(args.kv_budget_mb),
                                         "--sps-max-batch", str(sps_max_batch)], env)
            self.drafters = {k: self._start(["drafter", *common, "--drafter-top-k", str(k)], env) for k in top_ks}
            for address, service in [(self.verifier, VERIFIER_SERVICE), *((a, DRAFTER_SERVICE) for a in self.drafters.values())]:
                wait_until_serving(address, service, timeout=args.startup_timeout_s, alive=self.all_alive)
        except BaseException:
            self.stop()
            raise

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def all_alive(self) -> bool:
        return all(p.poll() is None for p in self.procs)

    def _start(self, argv: list[str], env: dict[str, str]) -> str:
        port = free_port()
        cmd = [sys.executable, "-m", "dspark.cli", *argv, "--port", str(port)]
        self.procs.append(subprocess.Popen(cmd, env=env, cwd=REPO))
        return f"127.0.0.1:{port}"

    def stop(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.terminate()
        for p in self.procs:
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


# ---- one run ------------------------------------------------------------------------------------


def run_level(engine: SpeculativeEngine, prompts: list[list[int]], *, kind: RowKind, concurrency: int, max_tokens: int,
              tag: str, wire: WireBytes | None, pids: list[int]) -> Run:
    """`concurrency` requests admitted together, run to completion, every round timed (wall time,
    and CPU time of the processes `pids`)."""
    requests = [GenerationRequest(f"{tag}-{i}", prompts[i % len(prompts)], max_tokens,
                                  SamplingParams(temperature=kind.temperature, seed=1000 + i))
                for i in range(concurrency)]
    if wire is not None:
        wire.reset()
    for r in requests:
        engine.add_request(r)
    states = [engine.running[r.request_id] for r in requests]
    round_seconds, round_cpu_seconds = [], []
    while engine.has_unfinished:
        c0 = cpu_seconds(pids)
        t0 = time.perf_counter()
        engine.step()
        round_seconds.append(time.perf_counter() - t0)
        round_cpu_seconds.append(cpu_seconds(pids) - c0)
    per_service = {}
    if wire is not None:
        for service in (VERIFIER_SERVICE, DRAFTER_SERVICE):
            b = wire.totals(service)
            per_service[service] = (b.sent, b.received)
    return Run(outputs=[s.output_ids for s in states], round_seconds=round_seconds, round_cpu_seconds=round_cpu_seconds,
               draft_tokens=sum(s.draft_tokens for s in states), emitted_in_rounds=sum(s.emitted_in_rounds for s in states),
               decode_rounds=sum(s.rounds for s in states), bytes_per_service=per_service)


def check_same(inproc: Run, split: Run, what: str) -> None:
    """A benchmark of a broken split is worthless: both modes must emit the very same tokens."""
    if split.outputs != inproc.outputs:
        bad = next(i for i, (a, b) in enumerate(zip(inproc.outputs, split.outputs)) if a != b)
        raise AssertionError(f"{what}: request {bad} differs between in-process and split: "
                             f"{inproc.outputs[bad][:12]}... vs {split.outputs[bad][:12]}...")
    if inproc.draft_tokens == 0:
        raise AssertionError(f"{what}: the drafter proposed nothing; there are no rows to measure")


# ---- the benchmark ------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=DEFAULT_MODEL_NAME, help="default model name or a local HF model directory")
    ap.add_argument("--drafter", default="dspark", help="a drafter that gives full rows (dspark, dflash, eagle3)")
    ap.add_argument("--drafter-path", default=None, help="its checkpoint (default: the shipped one)")
    ap.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"])
    ap.add_argument("--benchmark", default="mt-bench", help="prompt set of ../shared/data/eval")
    ap.add_argument("--prompts", type=int, default=8, help="distinct prompts, cycled over the C requests")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32], help="requests in flight")
    ap.add_argument("--gamma", type=int, default=7, help="draft tokens per round (scheduler.gamma)")
    ap.add_argument("--policy", default="fixed:4", help="none | fixed:K | threshold:C | dspark | dspark-async")
    ap.add_argument("--top-k", type=int, default=32, help="the sparse rows' k (drafter.top_k)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--kv-budget-mb", type=int, default=512, help="KV memory of each verifier (in-process and service)")
    ap.add_argument("--sps-max-batch", type=int, default=64, help="SPS(B) profile for a policy that needs one")
    ap.add_argument("--threads", type=int, default=0,
                    help="torch threads of every process (this one and the services); 0 = torch's default")
    ap.add_argument("--startup-timeout-s", type=float, default=600.0)
    ap.add_argument("--plot", default=None, help="write a PNG of the overhead share against C")
    ap.add_argument("--quick", action="store_true", help="2 prompts, 8 tokens, C = 1 and 4, one repeat")
    args = ap.parse_args(argv)
    if args.quick:
        args.prompts, args.max_tokens, args.concurrency, args.repeats = 2, 8, [1, 4], 1
    if args.drafter in ("none", "ngram"):
        ap.error(f"--drafter {args.drafter} sends no probability rows (point masses only); use a trained drafter")
    return args


def _raise_keyboard_interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


@contextlib.contextmanager
def stop_signals_interrupt():
    """SIGTERM, and a Ctrl-C that a background shell left ignored, raise KeyboardInterrupt while
    the benchmark runs, so that its `finally` stops the services (previous handlers restored)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {signum: signal.signal(signum, _raise_keyboard_interrupt) for signum in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def main(argv: list[str] | None = None) -> list[Cell]:
    args = parse_args(argv)
    threads = torch.get_num_threads()
    try:
        with stop_signals_interrupt():
            return run_benchmark(args)
    finally:
        torch.set_num_threads(threads)  # --threads is for the run only (main may be called in a larger program)


def run_benchmark(args: argparse.Namespace) -> list[Cell]:
    if args.threads:
        torch.set_num_threads(args.threads)
    kinds = [RowKind("point", 0.0, 0), RowKind(f"sparse-{args.top_k}", 1.0, args.top_k), RowKind("dense", 1.0, 0)]
    top_ks = sorted({k.top_k for k in kinds})
    policy_spec = args.policy
    needs_profile = parse_policy(policy_spec).needs_sps_profile

    print(f"starting the services ({args.model}, drafter {args.drafter}, top-k {top_ks}) ...", flush=True)
    services = ServiceProcesses(args, top_ks, args.sps_max_batch if needs_profile else 0)
    try:
        capture = drafter_capture_layers(args.drafter, args.drafter_path)
        runtime = TargetRuntime.load(TargetConfig(model=args.model, dtype=args.dtype, kv_budget_mb=args.kv_budget_mb,
                                                  capture_layers=capture))
        tokenizer = Tokenizer(runtime.model_dir)
        prompts = [tokenizer.encode_chat([{"role": "user", "content": p}]) for p in load_prompts(args.benchmark, args.prompts)]
        local_drafters = {k: make_drafter(args.drafter, runtime=runtime, path=args.drafter_path, top_k=k) for k in top_ks}
        wire = WireBytes()
        remote_verifier = RemoteVerifier(services.verifier, wire_bytes=wire)
        remote_drafters = {k: RemoteDrafter(address, wire_bytes=wire) for k, address in services.drafters.items()}
        profile = remote_verifier.sps_profile if needs_profile else None  # both modes schedule on the same profile
        pids = [os.getpid(), *services.pids]  # CPU time of a round: the same processes in both modes

        def engine(split: bool, kind: RowKind) -> SpeculativeEngine:
            policy = parse_policy(policy_spec)  # fresh: a policy may keep per-request state
            if split:
                e = SpeculativeEngine.from_parts(verifier=remote_verifier, drafter=remote_drafters[kind.top_k],
                                                 num_speculative_tokens=args.gamma, policy=policy)
            else:
                e = SpeculativeEngine(runtime, local_drafters[kind.top_k], num_speculative_tokens=args.gamma, policy=policy)
                e.sps_profile = profile
            return e

        def run(split: bool, kind: RowKind, c: int, tokens: int, tag: str) -> Run:
            return run_level(engine(split, kind), prompts, kind=kind, concurrency=c, max_tokens=tokens, tag=tag,
                             wire=wire if split else None, pids=pids)

        for kind in kinds:  # first calls (allocations, lazy init) out of the timings; the same check as below
            check_same(run(False, kind, 2, 4, f"warm-{kind.name}-a"), run(True, kind, 2, 4, f"warm-{kind.name}-b"), f"warm-up {kind.name}")

        results: dict[tuple[str, int], list[tuple[Run, Run]]] = {}
        for rep in range(args.repeats):
            for kind in kinds:
                for c in args.concurrency:
                    tag = f"r{rep}-{kind.name}-c{c}"
                    if rep % 2 == 0:  # alternate the order: drift on a shared machine hits both modes alike
                        inproc = run(False, kind, c, args.max_tokens, tag + "-in")
                        split = run(True, kind, c, args.max_tokens, tag + "-split")
                    else:
                        split = run(True, kind, c, args.max_tokens, tag + "-split")
                        inproc = run(False, kind, c, args.max_tokens, tag + "-in")
                    check_same(inproc, split, f"{kind.name}, C = {c}, repeat {rep}")
                    results.setdefault((kind.name, c), []).append((inproc, split))
                    print(f"repeat {rep} {kind.name:>10} C={c:<3} in-process {1e3 * median(inproc.round_seconds):8.1f} ms/round "
                          f"({1e3 * median(inproc.round_cpu_seconds):.1f} CPU), split {1e3 * median(split.round_seconds):8.1f} "
                          f"ms/round ({1e3 * median(split.round_cpu_seconds):.1f} CPU)", flush=True)
    finally:
        services.stop()

    cells = [summarize(name, c, pairs) for (name, c), pairs in results.items()]
    print(f"\n{args.model}, drafter {args.drafter}, {args.benchmark} ({args.prompts} prompts cycled), {args.max_tokens} tokens "
          f"per request, γ = {args.gamma}, policy {policy_spec}; median of {args.repeats} repeats of each run's median round.")
    print("overhead_% = (split - inproc) / split, of wall time and of CPU time (all processes); kB per round =")
    print("Σ protobuf ByteSize() / rounds (admission included);", end=" ")
    print("outputs identical in both modes (checked). split = dspark verifier + dspark drafter processes on loopback.")
    print_table(HEADERS, [table_row(cell) for cell in cells])
    if args.plot:
        write_plot(args.plot, cells)
    return cells


def summarize(rows: str, concurrency: int, pairs: list[tuple[Run, Run]]) -> Cell:
    """One table row from the (in-process, split) runs of every repeat."""
    inproc_s = [median(a.round_seconds) for a, _ in pairs]
    split_s = [median(b.round_seconds) for _, b in pairs]
    inproc_cpu = [median(a.round_cpu_seconds) for a, _ in pairs]
    split_cpu = [median(b.round_cpu_seconds) for _, b in pairs]
    first = pairs[0][1]  # bytes and rounds are the same in every repeat: same tokens, same rounds
    rounds = len(first.round_seconds)
    (v_sent, v_recv), (d_sent, d_recv) = first.bytes_per_service[VERIFIER_SERVICE], first.bytes_per_service[DRAFTER_SERVICE]
    return Cell(rows=rows, concurrency=concurrency, rounds=rounds, tau=first.emitted_in_rounds / max(first.decode_rounds, 1),
                inproc_s=median(inproc_s), split_s=median(split_s),
                overhead_share=median([(s - i) / s for i, s in zip(inproc_s, split_s)]),
                inproc_cpu_s=median(inproc_cpu), split_cpu_s=median(split_cpu),
                cpu_overhead_share=median([(s - i) / s for i, s in zip(inproc_cpu, split_cpu)]),
                to_verifier=v_sent / rounds, from_verifier=v_recv / rounds, to_drafter=d_sent / rounds, from_drafter=d_recv / rounds)


def table_row(c: Cell) -> list[str]:
    return [c.rows, str(c.concurrency), str(c.rounds), f"{c.tau:.2f}", f"{1e3 * c.inproc_s:.1f}", f"{1e3 * c.split_s:.1f}",
            f"{100 * c.overhead_share:.1f}", f"{1e3 * c.inproc_cpu_s:.1f}", f"{1e3 * c.split_cpu_s:.1f}",
            f"{100 * c.cpu_overhead_share:.1f}", f"{c.to_verifier / 1e3:.1f}",
            f"{c.from_verifier / 1e3:.1f}", f"{c.to_drafter / 1e3:.1f}", f"{c.from_drafter / 1e3:.1f}"]


def write_plot(path: str, cells: list[Cell]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    for name in dict.fromkeys(c.rows for c in cells):
        mine = [c for c in cells if c.rows == name]
        plt.plot([c.concurrency for c in mine], [100 * c.overhead_share for c in mine], "o-", label=name)
    plt.xscale("log", base=2)
    plt.xlabel("requests in flight C")
    plt.ylabel("split overhead, % of round time")
    plt.legend()
    plt.grid(alpha=0.3)
    plt.savefig(path, dpi=120)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
