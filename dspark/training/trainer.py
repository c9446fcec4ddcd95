"""The drafter trainer: target cache -> batches of anchor blocks -> AdamW -> checkpoints.

    dspark train --cache C --out RUN --steps 2000 --batch-seqs 8 --anchors-per-seq 64
    dspark train --cache C --out RUN --steps 2000 ... --resume      # continue from RUN's latest checkpoint

Recipe (docs/method.md §3, DeepSpec): AdamW (no weight decay by default), linear warmup over the first
`warmup` fraction of steps then cosine decay to 0, grad-norm clip 1.0, the DSpark loss
0.1 CE + 0.9 TV + 1.0 conf with position weights. The target is frozen and only its embedding
and LM head are needed here (p_t = softmax(LMHead(cached hidden)) on the sampled rows).

Invariant of the loop: step s (0-based) trains on batch s of the flat schedule epoch 0, epoch 1,
..., each batch a pure function of (seed, epoch, index in epoch) (anchors.py), with the learning
rate a pure function of s. Model, optimizer moments and the step counter are the whole state;
a checkpoint stores all of it (safetensors + JSON, no pickle), so `--resume` reproduces the
uninterrupted run's loss trace bit for bit (tested).

Run directory:
    train_config.json                 TrainConfig
    metrics.jsonl                     one line per step, then {"event": "end", ...} with wall
                                      time, tokens processed and peak memory
    checkpoints/step-0000100/         drafter checkpoint (config.json, model.safetensors) +
                                      optimizer.safetensors + trainer_state.json
    checkpoints/latest                name of the newest complete checkpoint (written last)
    final/                            the drafter checkpoint to calibrate and serve

Algorithms are the drafter families of the registry (`--algo NAME`: dspark.drafters.registry
`family(NAME)`: its objective builds the model and computes the loss on a TrainBatch, its
checkpoint I/O saves and loads it), all on the same cache, anchors, target layers and block size
(the comparison of docs/method.md §9):
    dspark   the DSpark loss above (drafters/dspark/objective.py)
    dflash   the parallel backbone alone, CE with position weights w_k = exp(-(k-1)/γ_w) (DFlash Eq. 4)
    eagle3   one layer, training-time test over γ steps: Σ_j 0.8^(j-1) · soft CE of step j against
             p_t (EAGLE-3's training code); `layers` must be 1
Every objective logs the same diagnostics (tv, acc, tau, acc_per_pos: the analytic acceptance of
its teacher-forced drafts against p_t; dspark/training/objective.py), so the runs' logs compare directly.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import resource
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from dspark.drafters.registry import DrafterFamily, families, family
from dspark.drafters.shared import SharedWeights
from dspark.model.config import ModelConfig
from dspark.training.anchors import plan_batches, sample_batch
from dspark.training.heldout import evaluate_heldout
from dspark.training.target_cache import TargetCache

CHECKPOINT_DIR = "checkpoints"
LATEST_FILE = "latest"
METRICS_FILE = "metrics.jsonl"
CONFIG_FILE = "train_config.json"
OPTIMIZER_FILE = "optimizer.safetensors"
STATE_FILE = "trainer_state.json"


@dataclass(frozen=True)
class TrainConfig:
    algo: str = "dspark"
    steps: int | None = None  # total optimizer steps; None = `epochs` passes over the train split
    epochs: float = 1.0
    batch_seqs: int = 8  # sequences per batch (one row each)
    anchors_per_seq: int = 64  # blocks per sequence per batch (DeepSpec: 512)
    max_batch_tokens: int | None = None  # cap on the context tokens of a batch
    lr: float = 6e-4
    warmup: float = 0.04  # fraction of the steps
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    betas: tuple[float, float] = (0.9, 0.95)
    # drafter shape
    layers: int = 2
    block_size: int = 7
    markov_rank: int = 256
    head: str = "markov"
    seed: int = 0
    split: str = "train"
    checkpoint_every: int = 500
    keep_checkpoints: int = 2
    eval_every: int = 0  # held-out evaluation every N steps (0: only at the end; heldout.py)
    eval_sequences: int | None = None  # the first N held-out sequences only (None: all of them)
    precision: str = "fp32"  # "fp32" | "bf16" (autocast; for CUDA)
    # DSpark only: N most frequent response tokens of the cache's train split as the draft
    # vocabulary (draft_vocab.py); None = the whole target vocabulary
    draft_vocab_size: int | None = None
    # DSpark only: start from this checkpoint's weights (same shape; its Markov head's columns
    # are gathered onto the draft vocabulary) instead of a fresh initialisation
    init_from: str | None = None

    def __post_init__(self) -> None:
        if self.steps is not None and self.steps < 1:
            raise ValueError(f"steps must be >= 1, got {self.steps}")
        if self.steps is None and not self.epochs > 0:
            raise ValueError(f"epochs must be > 0, got {self.epochs}")
        algos = sorted(f.name for f in families())
        if self.algo not in algos:
            raise ValueError(f"algo must be one of {algos}, got {self.algo!r}")
        if not 0 <= self.warmup < 1:
            raise ValueError(f"warmup must be a fraction in [0, 1), got {self.warmup}")
        if self.precision not in ("fp32", "bf16"):
            raise ValueError(f"precision must be 'fp32' or 'bf16', got {self.precision!r}")
        for name in ("batch_seqs", "anchors_per_seq", "layers", "block_size", "markov_rank", "checkpoint_every", "keep_checkpoints"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.eval_every < 0:
            raise ValueError(f"eval_every must be >= 0, got {self.eval_every}")
        if self.eval_sequences is not None and self.eval_sequences < 1:
            raise ValueError(f"eval_sequences must be >= 1, got {self.eval_sequences}")
        family(self.algo).objective.check(self)  # what only some families train with (draft vocabulary, layers)
        if self.draft_vocab_size is not None and self.draft_vocab_size < 1:
            raise ValueError(f"draft_vocab_size must be >= 1, got {self.draft_vocab_size}")

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["betas"] = list(self.betas)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TrainConfig:
        d = dict(d)
        d["betas"] = tuple(d["betas"])
        d.setdefault("eval_every", 0)  # run directories written before held-out evaluation existed
        d.setdefault("draft_vocab_size", None)  # ... and before draft vocabularies
        d.setdefault("init_from", None)
        d.setdefault("eval_sequences", None)
        return cls(**d)


# ---- schedule -----------------------------------------------------------------------------------


def learning_rate(step: int, *, total_steps: int, base_lr: float, warmup: float) -> float:
    """Linear warmup over round(warmup * total) steps (at least 1), then cosine decay to 0."""
    warm = max(1, round(warmup * total_steps))
    if step < warm:
        return base_lr * (step + 1) / warm
    progress = (step - warm) / max(1, total_steps - warm)
    return base_lr * 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))


def total_steps(config: TrainConfig, cache: TargetCache) -> int:
    if config.steps is not None:
        return config.steps
    indices = cache.indices(config.split)
    full, frac = int(config.epochs), config.epochs - int(config.epochs)
    n = sum(len(_plan(config, cache, indices, e)) for e in range(full))
    if frac > 0:
        n += math.ceil(frac * len(_plan(config, cache, indices, full)))
    return max(1, n)


def _plan(config: TrainConfig, cache: TargetCache, indices: list[int], epoch: int) -> list[list[int]]:
    return plan_batches(cache, indices, batch_seqs=config.batch_seqs, seed=config.seed, epoch=epoch,
                        max_batch_tokens=config.max_batch_tokens)


def batch_schedule(config: TrainConfig, cache: TargetCache, *, start: int, stop: int):
    """Yield (step, epoch, sequence indices) for steps start..stop-1 of the flat epoch schedule."""
    indices = cache.indices(config.split)
    if not indices:
        raise ValueError(f"the cache has no {config.split!r} sequences")
    step, epoch = 0, 0
    while step < stop:
        plan = _plan(config, cache, indices, epoch)
        if not plan:
            raise ValueError(f"no {config.split!r} sequence has a response of >= 2 tokens: nothing to train on")
        for seqs in plan:
            if step >= stop:
                return
            if step >= start:
                yield step, epoch, seqs
            step += 1
        epoch += 1


# ---- optimizer state as safetensors + JSON ------------------------------------------------------


def save_optimizer(path: Path, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """Tensors to safetensors; returns the JSON-able rest (param groups, non-tensor state)."""
    sd = optimizer.state_dict()
    tensors, scalars = {}, {}
    for idx, state in sd["state"].items():
        for key, value in state.items():
            if torch.is_tensor(value):
                tensors[f"state.{idx}.{key}"] = value.detach().cpu().contiguous()
            else:
                scalars[f"{idx}.{key}"] = value
    save_file(tensors, str(path))
    groups = [{k: (list(v) if isinstance(v, tuple) else v) for k, v in g.items()} for g in sd["param_groups"]]
    return {"param_groups": groups, "scalars": scalars}


def load_optimizer(path: Path, optimizer: torch.optim.Optimizer, rest: dict[str, Any]) -> None:
    state: dict[int, dict[str, Any]] = {}
    with safe_open(str(path), framework="pt", device="cpu") as f:
        for name in f.keys():  # noqa: SIM118
            _, idx, key = name.split(".", 2)
            state.setdefault(int(idx), {})[key] = f.get_tensor(name)
    for name, value in rest["scalars"].items():
        idx, key = name.split(".", 1)
        state.setdefault(int(idx), {})[key] = value
    groups = [{k: (tuple(v) if k == "betas" else v) for k, v in g.items()} for g in rest["param_groups"]]
    optimizer.load_state_dict({"state": state, "param_groups": groups})


# ---- the loop -----------------------------------------------------------------------------------


@dataclass
class TrainResult:
    run_dir: Path
    final_dir: Path
    steps: int  # steps completed in total (including before a resume)
    losses: list[float]  # loss of each step run by THIS call
    summary: dict[str, Any]


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _shared_on(target_shared: SharedWeights, device: torch.device) -> SharedWeights:
    if target_shared.embed.device == device:
        return target_shared
    embed = target_shared.embed.to(device)
    tied = target_shared.lm_head.data_ptr() == target_shared.embed.data_ptr()
    return SharedWeights(embed=embed, lm_head=embed if tied else target_shared.lm_head.to(device))


def resident_mb() -> dict[str, float]:
    """This process's resident memory now, split as Linux reports it (/proc/self/status): private
    memory (RssAnon: tensors, optimiser state, the allocator) and pages of mapped files (RssFile:
    mostly the target cache's memmaps, clean pages the kernel reclaims under pressure). Empty where
    /proc is not there."""
    try:
        lines = Path("/proc/self/status").read_text().splitlines()
    except OSError:
        return {}
    kib = {k: float(v.split()[0]) for k, _, v in (line.partition(":") for line in lines) if k in ("RssAnon", "RssFile")}
    return {"private_mb": kib["RssAnon"] / 1024, "mapped_files_mb": kib["RssFile"] / 1024} if len(kib) == 2 else {}


def peak_memory_mb(device: torch.device, *, peak_private_mb: float | None = None) -> dict[str, float]:
    """peak_rss_mb counts the cache pages a run has touched (they stay resident while memory is
    free), so on a large cache it reads far above what the run needs; peak_private_mb, the most
    private memory seen at any step, is what must fit in RAM."""
    out = {"peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}  # Linux: KiB
    if peak_private_mb is not None:
        out["peak_private_mb"] = round(peak_private_mb, 1)
    if "mapped_files_mb" in (now := resident_mb()):
        out["mapped_files_mb"] = round(now["mapped_files_mb"], 1)
    if device.type == "cuda":
        out["peak_cuda_mb"] = torch.cuda.max_memory_allocated(device) / 2**20
    return out


def train(
    config: TrainConfig,
    *,
    cache: TargetCache,
    target_config: ModelConfig,
    shared: SharedWeights,
    run_dir: str | Path,
    resume: bool = False,
    device: str | torch.device = "cpu",
    progress: bool = True,
    stop_after: int | None = None,  # stop (as if interrupted) once this many total steps are done; tests
    eval_cache: TargetCache | None = None,  # held-out sequences in a cache of their own (default: `cache`'s held-out split)
) -> TrainResult:
    from tqdm import tqdm

    device = torch.device(device)
    run = Path(run_dir)
    ckpt_root = run / CHECKPOINT_DIR
    algo = family(config.algo)
    shared = _shared_on(shared, device)
    total = total_steps(config, cache)
    start = 0
    if resume and (ckpt_root / LATEST_FILE).exists():
        saved = TrainConfig.from_dict(json.loads((run / CONFIG_FILE).read_text()))
        # how often and on how much to evaluate may change
        if saved != dataclasses.replace(config, eval_every=saved.eval_every, eval_sequences=saved.eval_sequences):
            diff = {k: (v, getattr(config, k)) for k, v in saved.to_dict().items() if v != config.to_dict()[k]}
            raise ValueError(f"--resume with different settings than {run / CONFIG_FILE} (saved, given): {diff}")
        ckpt = ckpt_root / (ckpt_root / LATEST_FILE).read_text().strip()
        state = json.loads((ckpt / STATE_FILE).read_text())
        model = algo.load(ckpt, shared=shared, device=device)
        optimizer = _make_optimizer(model, config)
        load_optimizer(ckpt / OPTIMIZER_FILE, optimizer, state["optimizer"])
        torch.set_rng_state(torch.tensor(state["torch_rng"], dtype=torch.uint8))
        start = state["step"]
        tokens_done, labels_done, wall_before = state["context_tokens"], state["label_tokens"], state["wall_s"]
        _truncate_log(run / METRICS_FILE, start)
    else:
        if resume:
            print(f"--resume: no checkpoint in {ckpt_root}, starting from scratch", file=sys.stderr)
        if run.exists():
            for name in (CHECKPOINT_DIR, "final"):
                shutil.rmtree(run / name, ignore_errors=True)
            (run / METRICS_FILE).unlink(missing_ok=True)
        run.mkdir(parents=True, exist_ok=True)
        (run / CONFIG_FILE).write_text(json.dumps(config.to_dict(), indent=2))
        torch.manual_seed(config.seed)
        model = algo.objective.build(config=config, target_config=target_config, cache=cache, shared=shared).to(device)
        optimizer = _make_optimizer(model, config)
        tokens_done = labels_done = 0
        wall_before = 0.0

    model.train()
    stop = total if stop_after is None else min(total, stop_after)
    losses: list[float] = []
    heldout: dict[str, Any] | None = None
    t0 = time.perf_counter()
    autocast = torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=config.precision == "bf16")
    bar = tqdm(total=total, initial=start, disable=not progress, desc="train", dynamic_ncols=True)
    log = (run / METRICS_FILE).open("a")
    step = start
    peak_private: float | None = None
    try:
        for step, epoch, seqs in batch_schedule(config, cache, start=start, stop=stop):
            batch = sample_batch(cache, seqs, anchors_per_seq=config.anchors_per_seq, block_size=config.block_size,
                                 seed=config.seed, epoch=epoch).to(device)
            lr = learning_rate(step, total_steps=total, base_lr=config.lr, warmup=config.warmup)
            for group in optimizer.param_groups:
                group["lr"] = lr
            with autocast:
                result = algo.objective.loss(model, batch)
            optimizer.zero_grad(set_to_none=True)
            result.total.backward()
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), config.grad_clip)
            optimizer.step()
            tokens_done += batch.context_tokens
            labels_done += batch.num_labels
            losses.append(result.metrics["loss"])
            if "private_mb" in (memory := resident_mb()):  # after the step: gradients and optimiser state are live
                peak_private = max(peak_private or 0.0, memory["private_mb"])
            entry = {"step": step + 1, "epoch": epoch, "lr": lr, "grad_norm": float(grad_norm), **result.metrics,
                     "blocks": batch.num_blocks, "labels": batch.num_labels, "context_tokens": batch.context_tokens,
                     "elapsed_s": round(wall_before + time.perf_counter() - t0, 3)}
            log.write(json.dumps(entry) + "\n")
            log.flush()
            bar.set_postfix(loss=f"{entry['loss']:.3f}", tv=f"{entry['tv']:.3f}", acc=f"{entry['acc']:.3f}", tau=f"{entry['tau']:.2f}")
            bar.update(1)
            step += 1
            if config.eval_every and (step % config.eval_every == 0 or step == total):
                # before the checkpoint: a resume from step s keeps the evaluation of step s
                heldout = _evaluate(algo, model, eval_cache or cache, config, device)
                if heldout is not None:
                    log.write(json.dumps({"event": "eval", "step": step, **heldout}) + "\n")
                    log.flush()
            if step % config.checkpoint_every == 0 or step == stop:
                _save_training_checkpoint(run, algo, model, optimizer, step=step, context_tokens=tokens_done,
                                          label_tokens=labels_done, wall_s=wall_before + time.perf_counter() - t0,
                                          keep=config.keep_checkpoints)
        bar.close()
        wall = wall_before + time.perf_counter() - t0
        summary: dict[str, Any] = {"event": "end" if step >= total else "stopped", "steps": step, "total_steps": total,
                                   "wall_s": round(wall, 3), "context_tokens": tokens_done, "label_tokens": labels_done,
                                   "label_tokens_per_s": round(labels_done / wall, 1) if wall > 0 else None,
                                   **peak_memory_mb(device, peak_private_mb=peak_private)}
        if step >= total:
            summary["heldout"] = heldout if heldout is not None else _evaluate(algo, model, eval_cache or cache, config, device)
        log.write(json.dumps(summary) + "\n")
    finally:
        log.close()
    final = run / "final"
    if step >= total:
        algo.save(final, drafter=model)
    return TrainResult(run_dir=run, final_dir=final, steps=step, losses=losses, summary=summary)


def _evaluate(algo: DrafterFamily, model: nn.Module, cache: TargetCache, config: TrainConfig,
              device: torch.device) -> dict[str, Any] | None:
    """Held-out diagnostics on the cache's held-out split, anchors as dense as in training."""
    result = evaluate_heldout(algo.objective, model, cache, split="heldout", block_size=config.block_size,
                              anchors_per_seq=config.anchors_per_seq, batch_seqs=config.batch_seqs,
                              seed=config.seed, device=device, precision=config.precision,
                              max_sequences=config.eval_sequences)
    return None if result is None else result.to_dict()


def _make_optimizer(model: nn.Module, config: TrainConfig) -> torch.optim.Optimizer:
    params = [p for p in model.parameters() if p.requires_grad]
    return torch.optim.AdamW(params, lr=config.lr, betas=config.betas, weight_decay=config.weight_decay)


def _save_training_checkpoint(run: Path, algo: DrafterFamily, model: nn.Module, optimizer: torch.optim.Optimizer, *,
                              step: int, context_tokens: int, label_tokens: int, wall_s: float, keep: int) -> Path:
    root = run / CHECKPOINT_DIR
    name = f"step-{step:07d}"
    d = root / name
    if d.exists():
        shutil.rmtree(d)
    d.mkdir(parents=True)
    algo.save(d, drafter=model)
    rest = save_optimizer(d / OPTIMIZER_FILE, optimizer)
    state = {"step": step, "context_tokens": context_tokens, "label_tokens": label_tokens, "wall_s": wall_s,
             "optimizer": rest, "torch_rng": torch.get_rng_state().tolist()}
    (d / STATE_FILE).write_text(json.dumps(state))
    _atomic_write(root / LATEST_FILE, name)  # last: the checkpoint is complete
    old = sorted(p for p in root.glob("step-*") if p.is_dir())
    for p in old[:-keep]:
        shutil.rmtree(p)
    return d


def _truncate_log(path: Path, step: int) -> None:
    """Drop log lines of steps after `step` (and end markers): they are recomputed on resume."""
    if not path.exists():
        return
    def kept(entry: dict[str, Any]) -> bool:
        return entry.get("step", 0) <= step and entry.get("event") in (None, "eval")

    keep = [line for line in path.read_text().splitlines() if line and kept(json.loads(line))]
    path.write_text("".join(line + "\n" for line in keep))


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (Path(run_dir) / METRICS_FILE).read_text().splitlines() if line.strip()]


__all__ = [
    "TrainConfig", "TrainResult", "batch_schedule", "learning_rate", "load_optimizer", "read_metrics", "save_optimizer", "total_steps",
    "train",
]
