"""The paper's offline evaluation (docs/method.md §10): accepted length per round on the benchmarks.

Scheduler off, chain drafts, a fixed block γ: every drafter named on the command line generates
`limit` prompts of each benchmark (every turn of multi-turn prompts) at each temperature, and
every round is recorded (runner.py). Out come, per drafter x temperature x γ and benchmark:
    τ = Σ emitted / Σ rounds (bonus included; Table 1), rounds, tokens, acceptance rate,
    P(accept k | accepted k-1) for k = 1..γ (Fig. 2),
and per domain (math, code, chat) and overall, for drafters with confidences, the static
threshold sweep (Fig. 5) and reliability diagrams (Fig. 6), computed from the recorded rounds
(acceptance.py). `block_sizes` adds runs at other γ (Fig. 4); several checkpoints of one
drafter, each with its own label, give the depth comparison (Fig. 3) as rows of the table.

A parallel drafter cannot draft past the block it was trained at (`block_size` of the drafter):
its runs use min(γ, block) and larger sweep points are listed as unsupported, not faked.

Every (drafter, temperature, γ, benchmark) result is cached in `work_dir` with a fingerprint of
everything that determines it (target, checkpoint files, seed, limit, max_new_tokens, prompts,
and the source of this package: a changed drafter or sampler is a different result),
so an interrupted evaluation resumes where it stopped and a finished one re-renders for free.

    results = run_offline_eval(EvalConfig(drafters=(DrafterSpec.parse("ngram"),), limit=2),
                               load_runtime=..., tokenizer=..., work_dir=Path("runs/eval"))
    write_results(results, "docs/results/offline_eval.json")
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import os
import subprocess
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path

import numpy as np

from dspark.evaluation.acceptance import (
    DEFAULT_THRESHOLDS,
    RoundRecords,
    mean_accepted_length,
    position_acceptance,
    reliability,
    threshold_sweep,
)
from dspark.evaluation.prompts import BENCHMARKS, load_turns
from dspark.evaluation.runner import BenchmarkRun, ChatTokenizer, Conversation, run_conversations
from dspark.model.target_runtime import TargetRuntime

# The paper's three domains (Table 1 groups its columns so; Alpaca is not available here).
DOMAINS = {
    "math": ("gsm8k", "math500", "aime25"),
    "code": ("mbpp", "humaneval", "livecodebench"),
    "chat": ("mt-bench", "arena-hard-v2"),
}
CACHE_FORMAT = "dspark-offline-eval/1"


def domain_of(benchmark: str) -> str | None:
    return next((d for d, names in DOMAINS.items() if benchmark in names), None)


@dataclass(frozen=True)
class DrafterSpec:
    """One drafter to evaluate: `[LABEL@]NAME[=PATH]` on the command line."""

    label: str  # row name in the table and key in the results ("dspark", "dspark-2l", ...)
    name: str  # registry name for make_drafter ("ngram", "dspark", "dflash", "eagle3", ...)
    path: str | None = None  # checkpoint directory, for drafters that need one

    @classmethod
    def parse(cls, text: str) -> DrafterSpec:
        """"dspark=runs/d/final", "d2@dspark=runs/d2/final" or "ngram"."""
        label, sep, rest = text.partition("@")
        if not sep:
            label, rest = "", text
        name, sep, path = rest.partition("=")
        name, label, path = name.strip(), label.strip(), path.strip()
        if not name or (sep and not path):
            raise ValueError(f"a drafter is [LABEL@]NAME[=PATH], e.g. 'dspark=runs/dspark/final' or 'd2@dspark=DIR'; got {text!r}")
        return cls(label=label or name, name=name, path=path or None)


@dataclass(frozen=True)
class EvalConfig:
    drafters: tuple[DrafterSpec, ...]  # the first one is the reference of the printed gains
    benchmarks: tuple[str, ...] = BENCHMARKS
    limit: int = 10  # prompts per benchmark
    temperatures: tuple[float, ...] = (1.0, 0.0)
    gamma: int = 7  # draft tokens per round (block size), Table 1
    block_sizes: tuple[int, ...] = ()  # extra γ values (Fig. 4)
    max_new_tokens: int = 256
    seed: int = 0
    batch_size: int = 8  # requests per engine step (the numbers do not depend on it)
    thresholds: tuple[float, ...] = DEFAULT_THRESHOLDS  # static confidence thresholds (Fig. 5)
    target: str = "smollm2-135m-instruct"  # what the results name as the target (model name or directory)
    target_dtype: str = "bfloat16"

    def __post_init__(self) -> None:
        from dspark.drafters import drafter_names

        if not self.drafters:
            raise ValueError("name at least one drafter (--drafter NAME[=PATH])")
        for spec in self.drafters:
            if spec.name not in drafter_names():
                raise ValueError(f"unknown drafter {spec.name!r}; expected one of {drafter_names()}")
        labels = [d.label for d in self.drafters]
        if len(set(labels)) != len(labels):
            raise ValueError(f"drafter labels must be unique, got {labels}; label repeats as LABEL@NAME=PATH")
        unknown = [b for b in self.benchmarks if b not in BENCHMARKS]
        if unknown or not self.benchmarks:
            raise ValueError(f"unknown benchmarks {unknown}; expected some of {BENCHMARKS}")
        if self.limit < 1:
            raise ValueError(f"limit must be >= 1, got {self.limit}")
        if not self.temperatures or any(not (t >= 0.0) or math.isinf(t) for t in self.temperatures):
            raise ValueError(f"temperatures must be finite and >= 0, got {self.temperatures}")
        if self.gamma < 1 or any(g < 1 for g in self.block_sizes):
            raise ValueError(f"block sizes must be >= 1, got gamma={self.gamma}, block_sizes={self.block_sizes}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {self.batch_size}")
        if any(not 0.0 <= c <= 1.0 for c in self.thresholds):
            raise ValueError(f"thresholds must lie in [0, 1], got {self.thresholds}")

    @property
    def primary_temperature(self) -> float:
        """The temperature of the headline `tau` (the paper's Table 1 is at temperature 1)."""
        return 1.0 if 1.0 in self.temperatures else self.temperatures[0]

    @property
    def gammas(self) -> tuple[int, ...]:
        return (self.gamma,) + tuple(g for g in dict.fromkeys(self.block_sizes) if g != self.gamma)


@dataclass
class RunKey:
    label: str
    temperature: float
    gamma: int  # the γ actually drafted (min of the requested γ and the drafter's block)
    requested_gamma: int

    @property
    def slug(self) -> str:
        return f"{_safe(self.label)}/T{self.temperature:g}-g{self.gamma}"


@dataclass
class EvalRun:
    """One drafter x temperature x γ over the benchmarks."""

    key: RunKey
    spec: DrafterSpec
    benchmarks: dict[str, BenchmarkRun] = field(default_factory=dict)


# ---- running --------------------------------------------------------------------------------


def run_offline_eval(
    config: EvalConfig,
    *,
    load_runtime: Callable[[tuple[int, ...] | None], TargetRuntime],  # capture layers -> target runtime
    tokenizer: ChatTokenizer,
    work_dir: str | Path | None = None,  # cache of finished benchmarks; None = no cache
    progress: bool = True,
    log: Callable[[str], None] | None = None,
) -> dict:
    """Run (or read from the cache) every drafter x temperature x γ x benchmark; return the
    JSON-ready results (`build_results`)."""
    from tqdm import tqdm

    from dspark.drafters import drafter_capture_layers, make_drafter

    log = log or (lambda msg: print(msg, file=sys.stderr))
    capture_layers = {}
    for spec in config.drafters:  # every checkpoint checked before hours of running the others
        try:
            capture_layers[spec.label] = drafter_capture_layers(spec.name, spec.path)
        except (ValueError, FileNotFoundError) as e:
            raise ValueError(f"drafter {spec.label!r}: {e} (in `dspark eval`, give a checkpoint as NAME=PATH)") from None
    conversations = {b: [Conversation(f"{b}/{i}", tuple(t)) for i, t in enumerate(load_turns(b, limit=config.limit))]
                     for b in config.benchmarks}
    runs: list[EvalRun] = []
    unsupported: list[dict] = []
    plain_digests: dict[str, str] = {}  # benchmark -> output digest of plain decoding at temperature 0
    runtime, runtime_layers = None, None
    for spec in config.drafters:
        layers = capture_layers[spec.label]
        if runtime is None or layers != runtime_layers:
            runtime = None  # free the previous target before loading another
            runtime, runtime_layers = load_runtime(layers), layers
        drafter = make_drafter(spec.name, runtime=runtime, path=spec.path)
        block = drafter.spec.block_size if drafter is not None else None
        for temperature in config.temperatures:
            for requested in config.gammas:
                gamma = requested if block is None else min(requested, int(block))
                if requested != config.gamma and gamma != requested:
                    unsupported.append({"label": spec.label, "temperature": temperature, "gamma": requested,
                                        "reason": f"{spec.name} drafts at most its trained block of {block} tokens"})
                    continue
                key = RunKey(spec.label, temperature, gamma, requested)
                run = EvalRun(key=key, spec=spec)
                for bench in config.benchmarks:
                    convs = conversations[bench]
                    fingerprint = _fingerprint(config, spec, key, bench, convs)
                    path = None if work_dir is None else Path(work_dir) / key.slug / f"{bench}.npz"
                    cached = _load_cached(path, fingerprint) if path is not None else None
                    if cached is None:
                        total = sum(len(c.turns) for c in convs)
                        bar = tqdm(total=total, desc=f"{spec.label} T={temperature:g} γ={gamma} {bench}", unit="req",
                                   disable=not progress, leave=False)
                        cached = run_conversations(runtime, drafter, tokenizer, convs, gamma=gamma, temperature=temperature,
                                                   seed=config.seed, max_new_tokens=config.max_new_tokens,
                                                   batch_size=config.batch_size, on_request_done=partial(bar.update, 1))
                        bar.close()
                        if path is not None:
                            _save_cached(path, fingerprint, cached)
                        log(f"{spec.label} T={temperature:g} γ={gamma} {bench}: τ={cached.tau:.3f} over {cached.rounds} rounds "
                            f"({cached.seconds:.0f} s)")
                    for s in cached.skipped:
                        log(f"  skipped {s['request']}: {s['reason']}")
                    run.benchmarks[bench] = cached
                runs.append(run)
        del drafter
    if 0.0 in config.temperatures:
        # The losslessness reference: plain decoding (no drafter) on the same runtime. Drafters
        # agreeing with each other is not enough; each must give the target's own greedy output.
        spec, key = DrafterSpec(label="plain", name="none"), RunKey("plain", 0.0, config.gamma, config.gamma)
        for bench in config.benchmarks:
            convs = conversations[bench]
            fingerprint = _fingerprint(config, spec, key, bench, convs)
            path = None if work_dir is None else Path(work_dir) / "_plain" / f"T0-g{config.gamma}" / f"{bench}.npz"
            cached = _load_cached(path, fingerprint) if path is not None else None
            if cached is None:
                cached = run_conversations(runtime, None, tokenizer, convs, gamma=config.gamma, temperature=0.0,
                                           seed=config.seed, max_new_tokens=config.max_new_tokens, batch_size=config.batch_size)
                if path is not None:
                    _save_cached(path, fingerprint, cached)
                log(f"plain decoding T=0 {bench}: the greedy reference ({cached.seconds:.0f} s)")
            plain_digests[bench] = cached.output_digest
    return build_results(config, runs, unsupported=unsupported, plain_digests=plain_digests)


# ---- results --------------------------------------------------------------------------------


def summarize_benchmark(run: BenchmarkRun, gamma: int) -> dict:
    pa = position_acceptance(run.records, gamma)
    return {
        "tau": _num(run.tau), "rounds": run.rounds, "tokens": run.generated_tokens, "emitted_in_rounds": run.emitted_in_rounds,
        "requests": run.requests, "draft_tokens": run.draft_tokens, "accepted_tokens": run.accepted_tokens,
        "acceptance_rate": _num(run.accepted_tokens / run.draft_tokens if run.draft_tokens else float("nan")),
        "position_acceptance": pa.to_json(), "skipped": len(run.skipped), "seconds": round(run.seconds, 2),
        "output_digest": run.output_digest,
    }


def summarize_group(runs: Sequence[BenchmarkRun], gamma: int, thresholds: Sequence[float]) -> dict:
    """A domain (or all benchmarks): τ macro-averaged over its benchmarks as the paper does, and
    the rest pooled over their rounds."""
    records = RoundRecords.concat([r.records for r in runs])
    taus = [r.tau for r in runs if r.rounds]
    out = {
        "benchmarks": len(runs),
        "tau": _num(float(np.mean(taus)) if taus else float("nan")),
        "tau_pooled": _num(mean_accepted_length(records)),
        "position_acceptance": position_acceptance(records, gamma).to_json(),
    }
    if records.confidences is not None:
        out["threshold_sweep"] = {"conditional": threshold_sweep(records, thresholds).to_json(),
                                  "cumulative": threshold_sweep(records, thresholds, cumulative=True).to_json()}
        out["reliability"] = reliability(records, gamma)
    return out


def build_results(config: EvalConfig, runs: Sequence[EvalRun], *, unsupported: Sequence[dict] = (),
                  plain_digests: dict[str, str] | None = None) -> dict:
    """The results file. Its head is the issue's schema: target, temperature, block_size,
    prompts_per_benchmark, tau {label: {benchmark: τ}} (at the primary temperature and γ);
    everything else follows. `plain_digests` (benchmark -> output digest of plain greedy
    decoding) is the reference of `greedy_outputs_agree`; without it the drafters are only
    compared with each other."""
    primary = config.primary_temperature
    run_json = []
    for run in runs:
        benches = {b: summarize_benchmark(r, run.key.gamma) for b, r in run.benchmarks.items()}
        groups = {}
        for domain, names in DOMAINS.items():
            members = [run.benchmarks[b] for b in names if b in run.benchmarks]
            if members:
                groups[domain] = summarize_group(members, run.key.gamma, config.thresholds)
        groups["all"] = summarize_group(list(run.benchmarks.values()), run.key.gamma, config.thresholds)
        run_json.append({
            "label": run.key.label, "drafter": run.spec.name, "path": run.spec.path, "temperature": run.key.temperature,
            "gamma": run.key.gamma, "requested_gamma": run.key.requested_gamma, "benchmarks": benches, "domains": groups,
        })
    main = [r for r in run_json if r["requested_gamma"] == config.gamma]
    tau_by_t: dict[str, dict] = {}
    for r in main:
        tau_by_t.setdefault(_t_key(r["temperature"]), {})[r["label"]] = {b: v["tau"] for b, v in r["benchmarks"].items()}
    greedy = [r for r in run_json if r["temperature"] == 0.0]
    agree = {}
    plain_digests = plain_digests or {}
    if greedy and plain_digests:  # lossless: at temperature 0 every drafter and γ gives the target's own greedy output
        for b in config.benchmarks:
            agree[b] = all(r["benchmarks"][b]["output_digest"] == plain_digests[b] for r in greedy)
    elif len(greedy) > 1:
        for b in config.benchmarks:
            agree[b] = len({r["benchmarks"][b]["output_digest"] for r in greedy}) == 1
    return {
        "target": config.target,
        "temperature": primary,
        "block_size": config.gamma,
        "prompts_per_benchmark": config.limit,
        "tau": tau_by_t.get(_t_key(primary), {}),
        "tau_mean": {r["label"]: r["domains"]["all"]["tau"] for r in main if r["temperature"] == primary},
        "tau_by_temperature": tau_by_t,
        "greedy_outputs_agree": agree,
        "greedy_reference": "plain decoding" if plain_digests else ("each other" if agree else None),
        "unsupported": list(unsupported),
        "config": {
            "drafters": [_drafter_json(d) for d in config.drafters],
            "benchmarks": list(config.benchmarks), "limit": config.limit, "temperatures": list(config.temperatures),
            "gamma": config.gamma, "block_sizes": list(config.block_sizes), "max_new_tokens": config.max_new_tokens,
            "seed": config.seed, "batch_size": config.batch_size, "thresholds": list(config.thresholds),
            "target": config.target, "target_dtype": config.target_dtype, "chain_drafts": True, "scheduler": "off",
            **_commit(),
        },
        "runs": run_json,
    }


def write_results(results: dict, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(_to_json(results) + "\n")
    os.replace(tmp, path)
    return path


def _to_json(value, level: int = 0) -> str:
    """Indented JSON with every list of plain numbers on one line (rates, bins, sweeps), so the
    file stays readable and diffable; nan/inf are refused (they were mapped to null before)."""
    pad = " " * (level + 1)
    if isinstance(value, dict) and value:
        items = [f"{pad}{json.dumps(str(k))}: {_to_json(v, level + 1)}" for k, v in value.items()]
        return "{\n" + ",\n".join(items) + "\n" + " " * level + "}"
    if isinstance(value, list) and any(isinstance(v, (dict, list)) for v in value):
        return "[\n" + ",\n".join(pad + _to_json(v, level + 1) for v in value) + "\n" + " " * level + "]"
    return json.dumps(value, allow_nan=False, ensure_ascii=False)


def _drafter_json(spec: DrafterSpec) -> dict:
    out = asdict(spec)
    if spec.path:  # what the checkpoint says about itself (depth, block) when it says it
        cfg = Path(spec.path) / "config.json"
        if cfg.exists():
            try:
                meta = json.loads(cfg.read_text())
            except json.JSONDecodeError:
                meta = {}
            out.update({k: meta[k] for k in ("num_layers", "block_size", "markov_rank", "target_layer_ids") if k in meta})
    return out


def _commit() -> dict:
    repo = Path(__file__).resolve().parents[2]
    try:
        head = subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD"], check=False, capture_output=True, text=True, timeout=10)
        status = subprocess.run(["git", "-C", str(repo), "status", "--porcelain", "--untracked-files=no"],
                                check=False, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return {"commit": None}
    if head.returncode != 0:
        return {"commit": None}
    return {"commit": head.stdout.strip(), "dirty": bool(status.stdout.strip())}


def _t_key(temperature: float) -> str:
    return f"{float(temperature):g}"


def _num(x: float) -> float | None:
    return None if x is None or not math.isfinite(x) else float(x)


def _safe(label: str) -> str:
    return "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in label)


# ---- the work-dir cache ---------------------------------------------------------------------


def _fingerprint(config: EvalConfig, spec: DrafterSpec, key: RunKey, bench: str, convs: Sequence[Conversation]) -> dict:
    prompts = hashlib.sha1(json.dumps([c.turns for c in convs]).encode()).hexdigest()
    return {
        "format": CACHE_FORMAT, "target": config.target, "target_dtype": config.target_dtype, "drafter": spec.name,
        "path": str(Path(spec.path).resolve()) if spec.path else None, "checkpoint": _checkpoint_digest(spec.path),
        "temperature": key.temperature, "gamma": key.gamma, "seed": config.seed, "max_new_tokens": config.max_new_tokens,
        "benchmark": bench, "limit": config.limit, "prompts": prompts, "code": _code_digest(),
    }


@functools.lru_cache(maxsize=1)
def _code_digest() -> str:
    """The dspark package's Python sources (its C++ kernels live in them), hashed: without it an
    A/B of two versions of a drafter on one checkpoint reads the first version's cached result."""
    root = Path(__file__).resolve().parents[1]  # the dspark package
    digest = hashlib.sha1()
    for f in sorted(root.rglob("*.py")):
        digest.update(str(f.relative_to(root)).encode())
        digest.update(f.read_bytes())
    return digest.hexdigest()


def _checkpoint_digest(path: str | None) -> str | None:
    """Names, sizes and modification times of the checkpoint's files: a retrained drafter invalidates the cache."""
    if not path or not Path(path).is_dir():
        return None
    entries = sorted((f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in Path(path).iterdir() if f.is_file())
    return hashlib.sha1(json.dumps(entries).encode()).hexdigest()


def _save_cached(path: Path, fingerprint: dict, run: BenchmarkRun) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    meta = {"fingerprint": fingerprint, "requests": run.requests, "rounds": run.rounds, "emitted_in_rounds": run.emitted_in_rounds,
            "draft_tokens": run.draft_tokens, "accepted_tokens": run.accepted_tokens, "generated_tokens": run.generated_tokens,
            "output_digest": run.output_digest, "seconds": run.seconds, "skipped": run.skipped}
    arrays = {"num_drafts": run.records.num_drafts, "num_accepted": run.records.num_accepted}
    if run.records.confidences is not None:
        arrays["confidences"] = run.records.confidences
    tmp = path.with_name(path.name + ".tmp.npz")
    np.savez(tmp, meta=np.array(json.dumps(meta)), **arrays)
    os.replace(tmp, path)


def _load_cached(path: Path, fingerprint: dict) -> BenchmarkRun | None:
    if not path.exists():
        return None
    try:
        with np.load(path) as data:
            meta = json.loads(str(data["meta"]))
            if meta.get("fingerprint") != fingerprint:
                return None
            records = RoundRecords(data["num_drafts"], data["num_accepted"],
                                   data["confidences"] if "confidences" in data.files else None)
    except (OSError, ValueError, KeyError):  # a torn or foreign file: recompute
        return None
    return BenchmarkRun(records=records, requests=meta["requests"], rounds=meta["rounds"],
                        emitted_in_rounds=meta["emitted_in_rounds"], draft_tokens=meta["draft_tokens"],
                        accepted_tokens=meta["accepted_tokens"], generated_tokens=meta["generated_tokens"],
                        output_digest=meta["output_digest"], seconds=meta["seconds"], skipped=meta["skipped"])


__all__ = ["DOMAINS", "DrafterSpec", "EvalConfig", "EvalRun", "RunKey", "build_results", "domain_of", "run_offline_eval",
           "summarize_benchmark", "summarize_group", "write_results"]
