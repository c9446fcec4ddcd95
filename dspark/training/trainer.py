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

Algorithms plug in through `DrafterAlgorithm` (build a model, compute a loss on a TrainBatch,
save it), all on the same cache, anchors, target layers and block size (the comparison of
docs/method.md §9):
    dspark   the DSpark loss above
    dflash   the parallel backbone alone, CE with position weights w_k = exp(-(k-1)/γ_w) (DFlash Eq. 4)
    eagle3   one layer, training-time test over γ steps: Σ_j 0.8^(j-1) · soft CE of step j against
             p_t (EAGLE-3's training code); `layers` must be 1
Every algorithm logs the same diagnostics (tv, acc, tau, acc_per_pos: the analytic acceptance of
its teacher-forced drafts against p_t), so the runs' logs compare directly.
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
from typing import Any, Protocol

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from dspark.drafters import dflash, eagle3
from dspark.drafters.dflash.config import DFlashConfig
from dspark.drafters.dflash.model import DFlashDrafter
from dspark.drafters.dspark.checkpoint import load_checkpoint, save_checkpoint, transfer_weights
from dspark.drafters.dspark.config import DSparkConfig
from dspark.drafters.dspark.model import DSparkDrafter
from dspark.drafters.eagle3.config import Eagle3Config
from dspark.drafters.eagle3.model import Eagle3Drafter
from dspark.drafters.shared import SharedWeights
from dspark.model.config import ModelConfig
from dspark.training.anchors import TrainBatch, plan_batches, sample_batch
from dspark.training.draft_vocab import frequent_tokens
from dspark.training.heldout import evaluate_heldout
from dspark.training.losses import (
    acceptance_rate,
    ce_loss,
    dspark_loss,
    expected_acceptance,
    expected_accepted_length,
    greedy_acceptance,
    position_weights,
    target_probs_from_hidden,
    weighted_mean,
)
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
        if self.algo not in ALGORITHMS:
            raise ValueError(f"algo must be one of {sorted(ALGORITHMS)}, got {self.algo!r}")
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
        if self.algo != "dspark" and (self.draft_vocab_size is not None or self.init_from is not None):
            raise ValueError(f"draft_vocab_size and init_from are DSpark options, not {self.algo}'s")
        if self.draft_vocab_size is not None and self.draft_vocab_size < 1:
            raise ValueError(f"draft_vocab_size must be >= 1, got {self.draft_vocab_size}")
        if self.algo == "eagle3" and self.layers != 1:
            raise ValueError(f"EAGLE-3 is a one-layer drafter: layers must be 1, got {self.layers}")

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


# ---- algorithms ---------------------------------------------------------------------------------


@dataclass
class StepLoss:
    total: torch.Tensor  # [] what backward() runs on
    metrics: dict[str, Any]  # floats / lists for the log and the progress bar


class DrafterAlgorithm(Protocol):
    """What the trainer needs from a drafter family (dspark, dflash, eagle3)."""

    def build(self, *, config: TrainConfig, target_config: ModelConfig, cache: TargetCache, shared: SharedWeights) -> nn.Module: ...

    def loss(self, model: nn.Module, batch: TrainBatch) -> StepLoss: ...

    def save(self, model: nn.Module, directory: Path) -> None: ...

    def load(self, directory: Path, *, shared: SharedWeights, device: torch.device) -> nn.Module: ...


class DSparkAlgorithm:
    def build(self, *, config: TrainConfig, target_config: ModelConfig, cache: TargetCache, shared: SharedWeights) -> DSparkDrafter:
        cfg = DSparkConfig.from_target(target_config, target_layer_ids=cache.capture_layers, num_layers=config.layers,
                                       block_size=config.block_size, markov_rank=config.markov_rank, head_type=config.head,
                                       draft_vocab_size=config.draft_vocab_size)
        d2t = None if config.draft_vocab_size is None else frequent_tokens(cache, size=config.draft_vocab_size, split=config.split)
        model = DSparkDrafter(cfg, shared=shared, draft_to_target=d2t)
        if config.init_from is not None:
            transfer_weights(load_checkpoint(config.init_from, shared=shared).drafter, model)
        return model

    def loss(self, model: DSparkDrafter, batch: TrainBatch) -> StepLoss:
        c = model.config
        # valid blocks only: padding blocks carry no loss, so they skip the vocabulary-sized products
        logits, confidence_logits = model.forward_valid(batch.blocks, target_tokens=batch.target_tokens)  # [n, γ, N], [n, γ]
        valid = batch.blocks.block_valid  # [rows, nb]
        n, gamma, _ = logits.shape
        mask = batch.label_mask[valid]  # [n, γ]
        labels = batch.target_tokens[valid]  # [n, γ] target ids
        with torch.no_grad():
            p_t = target_probs_from_hidden(batch.target_hidden[valid].reshape(n * gamma, -1), model.shared.lm_head)
            p_t = p_t.view(n, gamma, -1)  # [n, γ, V]
            target_argmax = p_t.argmax(dim=-1)  # [n, γ]
            outside = None
            d2t = model.draft_to_target
            if d2t is not None:  # only the N columns the drafter can propose, and the mass it cannot
                p_t = p_t[..., d2t]  # [n, γ, N]
                outside = (1.0 - p_t.sum(dim=-1)).clamp_min(0.0)  # [n, γ]
                labels = model.target_to_draft()[labels]  # [n, γ] draft indices, -1 outside
        loss = dspark_loss(draft_logits=logits, target_ids=labels, target_probs=p_t, outside_mass=outside,
                           confidence_logits=confidence_logits, mask=mask, ce_weight=c.ce_weight,
                           tv_weight=c.tv_weight, conf_weight=c.conf_weight, position_decay=c.position_decay)
        acc = expected_acceptance(loss.c_star, mask)  # [γ]
        draft_argmax = logits.detach().argmax(dim=-1)  # [n, γ] draft indices
        if d2t is not None:
            draft_argmax = d2t[draft_argmax]
        metrics = {
            "loss": loss.total.item(), "ce": loss.ce.item(), "tv": loss.tv.item(), "conf": loss.conf.item(),
            "acc": float((loss.c_star * mask).sum() / mask.sum().clamp_min(1)),
            "tau": expected_accepted_length(loss.c_star, mask).item(),
            "acc_per_pos": [round(float(a), 4) for a in acc],
            **greedy_metrics(draft_argmax, target_argmax, mask),
        }
        return StepLoss(total=loss.total, metrics=metrics)

    def save(self, model: DSparkDrafter, directory: Path) -> None:
        save_checkpoint(directory, drafter=model)

    def load(self, directory: Path, *, shared: SharedWeights, device: torch.device) -> DSparkDrafter:
        return load_checkpoint(directory, shared=shared, device=device).drafter


DIAGNOSTIC_DECAY = 4.0  # γ_w of the logged tv of the baselines (DSpark's default, so all logs weight alike)


@torch.no_grad()
def acceptance_metrics(draft_logits: torch.Tensor, batch: TrainBatch, lm_head: torch.Tensor, *, decay: float) -> dict[str, Any]:
    """The diagnostics every algorithm logs, from its teacher-forced draft logits [n, γ, V] of the
    valid blocks: tv (weighted mean ‖p_d - p_t‖₁, as L_tv), acc (mean c* = 1 - TV), tau (expected
    accepted length 1 + Σ_k Π_{i<=k} c*_i) and acc_per_pos."""
    valid = batch.blocks.block_valid
    n, gamma, vocab = draft_logits.shape
    mask = batch.label_mask[valid]  # [n, γ]
    p_t = target_probs_from_hidden(batch.target_hidden[valid].reshape(n * gamma, -1), lm_head).view(n, gamma, vocab)
    p_d = torch.softmax(draft_logits.float(), dim=-1)
    c_star = acceptance_rate(p_d, p_t)  # [n, γ]
    tv = weighted_mean((p_d - p_t).abs().sum(-1), position_weights(gamma, decay=decay, device=p_d.device), mask)
    return {
        "tv": tv.item(), "acc": float((c_star * mask).sum() / mask.sum().clamp_min(1)),
        "tau": expected_accepted_length(c_star, mask).item(),
        "acc_per_pos": [round(float(a), 4) for a in expected_acceptance(c_star, mask)],
        **greedy_metrics(p_d.argmax(dim=-1), p_t.argmax(dim=-1), mask),
    }


def greedy_metrics(draft_argmax: torch.Tensor, target_argmax: torch.Tensor, mask: torch.Tensor) -> dict[str, Any]:
    """The temperature-0 diagnostics (losses.greedy_acceptance) every algorithm logs beside c*_k:
    greedy_tau, greedy_acc_per_pos (conditional argmax agreement) and its denominators."""
    tau, hits, tries = greedy_acceptance(draft_argmax, target_argmax, mask)  # [], [γ], [γ]
    return {"greedy_tau": float(tau), "greedy_acc_per_pos": [round(float(h) / max(int(t), 1), 4) for h, t in zip(hits, tries)],
            "greedy_hits_per_pos": [int(h) for h in hits], "greedy_tries_per_pos": [int(t) for t in tries]}


class DFlashAlgorithm:
    """DFlash: the parallel backbone over [x_0, mask × γ], cross-entropy with position weights."""

    def build(self, *, config: TrainConfig, target_config: ModelConfig, cache: TargetCache, shared: SharedWeights) -> DFlashDrafter:
        cfg = DFlashConfig.from_target(target_config, target_layer_ids=cache.capture_layers, num_layers=config.layers,
                                       block_size=config.block_size)
        return DFlashDrafter(cfg, shared=shared)

    def loss(self, model: DFlashDrafter, batch: TrainBatch) -> StepLoss:
        valid = batch.blocks.block_valid  # [rows, nb]: padding blocks carry no loss
        logits = model(batch.blocks)[valid]  # [n, γ, V]
        weights = position_weights(logits.shape[1], decay=model.config.position_decay, device=logits.device)
        ce = ce_loss(logits, batch.target_tokens[valid], weights, batch.label_mask[valid])  # DFlash Eq. 4
        metrics = {"loss": ce.item(), "ce": ce.item(), **acceptance_metrics(logits, batch, model.shared.lm_head, decay=DIAGNOSTIC_DECAY)}
        return StepLoss(total=ce, metrics=metrics)

    def save(self, model: DFlashDrafter, directory: Path) -> None:
        dflash.save_checkpoint(directory, drafter=model)

    def load(self, directory: Path, *, shared: SharedWeights, device: torch.device) -> DFlashDrafter:
        return dflash.load_checkpoint(directory, shared=shared, device=device)


class Eagle3Algorithm:
    """EAGLE-3: one layer over fused target features, training-time test over γ steps."""

    def build(self, *, config: TrainConfig, target_config: ModelConfig, cache: TargetCache, shared: SharedWeights) -> Eagle3Drafter:
        cfg = Eagle3Config.from_target(target_config, target_layer_ids=cache.capture_layers, block_size=config.block_size)
        return Eagle3Drafter(cfg, shared=shared)

    def loss(self, model: Eagle3Drafter, batch: TrainBatch) -> StepLoss:
        if batch.context_token_ids is None:
            raise ValueError("EAGLE-3 reads the context's tokens: the batch has no context_token_ids (build it with build_batch)")
        out = model(batch.blocks, context_token_ids=batch.context_token_ids, target_tokens=batch.target_tokens)
        valid = batch.blocks.block_valid
        logits = out.logits[valid]  # [n, γ, V]: step j's logits of x_j
        n, gamma, vocab = logits.shape
        mask = batch.label_mask[valid].to(logits.dtype)  # [n, γ]
        with torch.no_grad():
            p_t = target_probs_from_hidden(batch.target_hidden[valid].reshape(n * gamma, -1), model.shared.lm_head).view(n, gamma, vocab)
        soft_ce = -(p_t * torch.log_softmax(logits.float(), dim=-1)).sum(-1)  # [n, γ] cross-entropy against p_t
        per_step = (soft_ce * mask).sum(0) / mask.sum(0).clamp_min(1)  # [γ] mean over blocks with a label
        step_weights = model.config.step_decay ** torch.arange(gamma, dtype=torch.float32, device=logits.device)
        total = (step_weights * per_step).sum()  # EAGLE-3: Σ_j 0.8^(j-1) L_j
        metrics = {"loss": total.item(), "ce": total.item(), **acceptance_metrics(logits, batch, model.shared.lm_head, decay=DIAGNOSTIC_DECAY)}
        return StepLoss(total=total, metrics=metrics)

    def save(self, model: Eagle3Drafter, directory: Path) -> None:
        eagle3.save_checkpoint(directory, drafter=model)

    def load(self, directory: Path, *, shared: SharedWeights, device: torch.device) -> Eagle3Drafter:
        return eagle3.load_checkpoint(directory, shared=shared, device=device)


ALGORITHMS: dict[str, DrafterAlgorithm] = {"dspark": DSparkAlgorithm(), "dflash": DFlashAlgorithm(), "eagle3": Eagle3Algorithm()}


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


def peak_memory_mb(device: torch.device) -> dict[str, float]:
    out = {"peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}  # Linux: KiB
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
    algo = ALGORITHMS[config.algo]
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
        model = algo.build(config=config, target_config=target_config, cache=cache, shared=shared).to(device)
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
    try:
        for step, epoch, seqs in batch_schedule(config, cache, start=start, stop=stop):
            batch = sample_batch(cache, seqs, anchors_per_seq=config.anchors_per_seq, block_size=config.block_size,
                                 seed=config.seed, epoch=epoch).to(device)
            lr = learning_rate(step, total_steps=total, base_lr=config.lr, warmup=config.warmup)
            for group in optimizer.param_groups:
                group["lr"] = lr
            with autocast:
                result = algo.loss(model, batch)
            optimizer.zero_grad(set_to_none=True)
            result.total.backward()
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), config.grad_clip)
            optimizer.step()
            tokens_done += batch.context_tokens
            labels_done += batch.num_labels
            losses.append(result.metrics["loss"])
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
                                   **peak_memory_mb(device)}
        if step >= total:
            summary["heldout"] = heldout if heldout is not None else _evaluate(algo, model, eval_cache or cache, config, device)
        log.write(json.dumps(summary) + "\n")
    finally:
        log.close()
    final = run / "final"
    if step >= total:
        algo.save(model, final)
    return TrainResult(run_dir=run, final_dir=final, steps=step, losses=losses, summary=summary)


def _evaluate(algo: DrafterAlgorithm, model: nn.Module, cache: TargetCache, config: TrainConfig,
              device: torch.device) -> dict[str, Any] | None:
    """Held-out diagnostics on the cache's held-out split, anchors as dense as in training."""
    result = evaluate_heldout(algo, model, cache, split="heldout", block_size=config.block_size,
                              anchors_per_seq=config.anchors_per_seq, batch_seqs=config.batch_seqs,
                              seed=config.seed, device=device, precision=config.precision,
                              max_sequences=config.eval_sequences)
    return None if result is None else result.to_dict()


def _make_optimizer(model: nn.Module, config: TrainConfig) -> torch.optim.Optimizer:
    params = [p for p in model.parameters() if p.requires_grad]
    return torch.optim.AdamW(params, lr=config.lr, betas=config.betas, weight_decay=config.weight_decay)


def _save_training_checkpoint(run: Path, algo: DrafterAlgorithm, model: nn.Module, optimizer: torch.optim.Optimizer, *,
                              step: int, context_tokens: int, label_tokens: int, wall_s: float, keep: int) -> Path:
    root = run / CHECKPOINT_DIR
    name = f"step-{step:07d}"
    d = root / name
    if d.exists():
        shutil.rmtree(d)
    d.mkdir(parents=True)
    algo.save(model, d)
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
    "ALGORITHMS", "DFlashAlgorithm", "DSparkAlgorithm", "DrafterAlgorithm", "Eagle3Algorithm", "StepLoss", "TrainConfig",
    "TrainResult", "acceptance_metrics", "batch_schedule", "learning_rate", "load_optimizer", "read_metrics", "save_optimizer", "total_steps", "train",
]
