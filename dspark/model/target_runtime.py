"""The target model as the verifier runs it: requests, their KV caches, one batched forward.

    runtime = TargetRuntime.load(TargetConfig())
    runtime.add_request("a", max_tokens=512)           # reserves KV (or raises KVBudgetExceeded)
    out = runtime.forward(["a"], token_ids, [len(prompt)], logits_indices=...)
    runtime.truncate("a", kept_length)                 # drop rejected speculative tokens
    runtime.free_request("a")

`forward` appends the K/V of every query token to its request's cache; the caller (the
speculative engine) truncates back to the accepted prefix after rejection sampling.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from dspark.model import compact_weights
from dspark.model.config import ModelConfig
from dspark.model.kv_cache import KVBudgetExceeded, KVCache
from dspark.model.model_store import DEFAULT_MODEL, resolve_model_dir
from dspark.model.transformer import AttentionMetadata, Transformer
from dspark.serving_config import DEVICE_PATTERN, WEIGHT_CHOICES, ModelSection

__all__ = ["WEIGHT_CHOICES", "TargetConfig", "TargetRuntime", "ForwardOutput", "KVBudgetExceeded", "default_capture_layers"]

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}
DTYPE_CHOICES = ("auto", *DTYPES)


def cpu_has_fast_bf16() -> bool:
    """True when this CPU multiplies bf16 natively (AVX-512 BF16 or AMX). Without it oneDNN
    emulates bf16 GEMMs and they run ~2.5x slower than fp32 (measured on an AVX2-only EPYC)."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def resolve_device(device: str | torch.device = "auto") -> torch.device:
    """"auto" -> the first CUDA device torch sees, else the CPU; "cpu", "cuda", "cuda:N" as given,
    refused with a ValueError when torch cannot reach that device (at start-up, not mid-request)."""
    if str(device) == "auto":
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    try:
        dev = torch.device(device)
    except RuntimeError as e:
        raise ValueError(f"device must be 'auto', 'cpu', 'cuda' or 'cuda:N', got {device!r}") from e
    if dev.type == "cpu":
        return dev
    if dev.type != "cuda":
        raise ValueError(f"device must be 'auto', 'cpu', 'cuda' or 'cuda:N', got {device!r}")
    if not torch.cuda.is_available():
        raise ValueError(f"device {device!r} asked for, but this torch sees no CUDA device "
                         f"(torch {torch.__version__}, CUDA build: {torch.version.cuda or 'no'}); use 'cpu' or 'auto'")
    index = torch.cuda.current_device() if dev.index is None else dev.index
    if index >= torch.cuda.device_count():
        raise ValueError(f"device {device!r}: only {torch.cuda.device_count()} CUDA device(s) visible")
    return torch.device("cuda", index)


def resolve_dtype(dtype: str, device: torch.device | str = "cpu") -> str:
    """"auto" -> "bfloat16" on CUDA or a CPU with native bf16, else "float32"."""
    if dtype != "auto":
        return dtype
    return "bfloat16" if torch.device(device).type == "cuda" or cpu_has_fast_bf16() else "float32"


def default_capture_layers(num_layers: int, count: int = 5) -> tuple[int, ...]:
    """`count` layers spread evenly from the second to the third-to-last (DeepSpec's choice,
    e.g. [1, 9, 17, 25, 33] of Qwen3-4B's 36 layers)."""
    if num_layers <= count:
        return tuple(range(num_layers))
    first, last = 1, num_layers - 3
    if last - first + 1 < count:  # too shallow for that range: spread over all layers instead
        first, last = 0, num_layers - 1
    return tuple(round(first + i * (last - first) / (count - 1)) for i in range(count))


@dataclass(frozen=True)
class TargetConfig:
    model: str = DEFAULT_MODEL  # the default model's name, or a local HF Llama/Qwen directory
    dtype: str = "auto"  # compute dtype of the linear layers; "auto": bf16 where the hardware has it (resolve_dtype)
    weights: str = "auto"  # how the linear layers hold their weights: serving_config.WEIGHT_CHOICES
    kv_budget_mb: int = 4096  # memory for all requests' KV caches together
    capture_layers: tuple[int, ...] | None = None  # target layers whose hidden states feed the drafter; None = 5 spread evenly
    max_model_len: int | None = None  # None = the model's max_position_embeddings
    device: str = "auto"  # auto | cpu | cuda | cuda:N (resolve_device); compact weights are CPU-only

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_CHOICES:
            raise ValueError(f"dtype must be one of {list(DTYPE_CHOICES)}, got {self.dtype!r}")
        if self.weights not in WEIGHT_CHOICES:
            raise ValueError(f"weights must be one of {list(WEIGHT_CHOICES)}, got {self.weights!r}")
        if self.weights.startswith("compact") and self.dtype not in ("auto", "float32"):
            raise ValueError(f"{self.weights} weights compute in float32; dtype {self.dtype!r} asks for dense weights")
        if self.kv_budget_mb <= 0:
            raise ValueError(f"kv_budget_mb must be positive, got {self.kv_budget_mb}")
        if DEVICE_PATTERN.fullmatch(self.device) is None:
            raise ValueError(f"device must be 'auto', 'cpu', 'cuda' or 'cuda:N', got {self.device!r}")

    @classmethod
    def of(cls, model: ModelSection, *, capture_layers: tuple[int, ...] | None = None,
           kv_budget_mb: int | None = None) -> "TargetConfig":
        """The serving configuration's [model] section as a TargetConfig (the one translation of
        it, used by `dspark serve`/`generate` and by the verifier and drafter services)."""
        return cls(model=model.name, dtype=model.dtype, weights=model.weights, device=model.device,
                   kv_budget_mb=model.kv_budget_mb if kv_budget_mb is None else kv_budget_mb,
                   capture_layers=capture_layers, max_model_len=model.max_model_len or None)


@dataclass
class ForwardOutput:
    hidden: torch.Tensor  # [num_tokens, hidden] final normed hidden states (LM head input)
    logits: torch.Tensor  # [num_logits, vocab] fp32, rows of `logits_indices` (all tokens if None)
    captured: torch.Tensor | None = None  # [num_tokens, num_capture_layers, hidden] when capture=True
    query_start: list[int] = field(default_factory=list)  # offset of each request's first token


class TargetRuntime:
    def __init__(self, model: Transformer, *, kv_budget_tokens: int, capture_layers: tuple[int, ...] | None = None, max_model_len: int | None = None):
        self.model = model
        self.config: ModelConfig = model.config
        self.capture_layers = capture_layers if capture_layers is not None else default_capture_layers(self.config.num_layers)
        bad = [l for l in self.capture_layers if not 0 <= l < self.config.num_layers]
        if bad:
            raise ValueError(f"capture layers {bad} out of range for a {self.config.num_layers}-layer model")
        self.max_model_len = min(max_model_len or self.config.max_position_embeddings, self.config.max_position_embeddings)
        self.device: torch.device = model.embed.weight.device  # where the weights, the KV and the logits live
        # fp32 K/V: attention runs in fp32 and reads the cache without conversion copies
        self.kv = KVCache(self.config, budget_tokens=kv_budget_tokens, dtype=torch.float32, device=self.device)

    @classmethod
    def load(cls, cfg: TargetConfig = TargetConfig()) -> "TargetRuntime":
        model_dir = resolve_model_dir(cfg.model)
        device = resolve_device(cfg.device)
        dense_dtype = DTYPES[resolve_dtype(cfg.dtype, device)]
        if device.type != "cpu":
            # The compact kernels, the fused ops and the layer loop are CPU code (C++ on AVX2 /
            # AVX-512): on a GPU the linear layers hold dense `dtype` weights and attention is
            # SDPA over the padded batch ("varlen", Transformer.set_attention).
            if cfg.weights.startswith("compact"):
                raise ValueError(f"{cfg.weights} weights run on the CPU only; on {device} use weights 'dense' or 'auto'")
            model = Transformer.from_dir(model_dir, compute_dtype=dense_dtype, device=device)
        elif cfg.weights == "dense" or (cfg.weights == "auto" and cfg.dtype not in ("auto", "float32")):
            model = Transformer.from_dir(model_dir, compute_dtype=dense_dtype)
        else:
            model = Transformer.from_dir(model_dir, compute_dtype=torch.float32, compact=True,
                                         int8_activations=cfg.weights == "compact-int8")
            if not model.compact and cfg.weights.startswith("compact"):
                reason = compact_weights.unavailable_reason() or (
                    "no exact compact format (Q4_1 / Q8_0 blocks) reproduces every linear layer's weights")
                raise ValueError(f"{model_dir}: {cfg.weights} weights unavailable: {reason}; use weights='dense'")
            if not model.compact and dense_dtype != torch.float32:  # auto: the hardware's dense dtype instead
                model = Transformer.from_dir(model_dir, compute_dtype=dense_dtype)
        tokens = cfg.kv_budget_mb * 2**20 // model.config.kv_bytes_per_token(torch.float32.itemsize)
        runtime = cls(model, kv_budget_tokens=int(tokens), capture_layers=cfg.capture_layers, max_model_len=cfg.max_model_len)
        runtime.model_dir = model_dir
        return runtime

    @property
    def linear_numerics(self) -> str:
        """What the linear layers run: "compact" (exact fp32 weights, compact blocks), "compact-int8"
        (those weights, int8 activations), "bfloat16" or "float32"."""
        if self.model.compact:
            return "compact-int8" if self.model.int8_activations else "compact"
        return str(self.model.compute_dtype).removeprefix("torch.")

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    # ---- request lifecycle ---------------------------------------------------------------

    def add_request(self, request_id: str, max_tokens: int) -> None:
        """Reserve KV for a request that may reach `max_tokens` tokens (prompt + output + draft slack)."""
        if max_tokens > self.max_model_len:
            raise ValueError(f"request {request_id!r} needs {max_tokens} tokens, the context window is {self.max_model_len}")
        self.kv.allocate(request_id, max_tokens)

    def free_request(self, request_id: str) -> None:
        self.kv.free(request_id)

    def has_request(self, request_id: str) -> bool:
        return request_id in self.kv.requests

    def context_len(self, request_id: str) -> int:
        return self.kv.get(request_id).length

    def truncate(self, request_id: str, length: int) -> None:
        self.kv.truncate(request_id, length)

    # ---- the forward pass ----------------------------------------------------------------

    @torch.inference_mode()
    def forward(
        self,
        request_ids: list[str],
        token_ids: torch.Tensor,  # [num_tokens] int64, requests concatenated in order
        query_lens: list[int],
        *,
        logits_indices: torch.Tensor | None = None,  # [num_logits] rows of the batch that need logits; None = all
        capture: bool = False,
    ) -> ForwardOutput:
        if len(request_ids) != len(query_lens):
            raise ValueError(f"{len(request_ids)} request ids but {len(query_lens)} query lengths")
        if token_ids.dim() != 1 or token_ids.shape[0] != sum(query_lens):
            raise ValueError(f"token_ids must be 1-D with sum(query_lens)={sum(query_lens)} entries, got shape {tuple(token_ids.shape)}")
        if len(set(request_ids)) != len(request_ids):
            raise ValueError("a request may appear only once per forward")
        if not request_ids:
            raise ValueError("a forward needs at least one request")
        if token_ids.dtype not in (torch.int64, torch.int32):
            raise ValueError(f"token_ids must be int64 (or int32), got {token_ids.dtype}")
        num_tokens = token_ids.shape[0]
        if logits_indices is not None and logits_indices.numel() and (
            logits_indices.dtype not in (torch.int64, torch.int32)
            or int(logits_indices.min()) < 0 or int(logits_indices.max()) >= num_tokens
        ):
            raise ValueError(f"logits_indices must be integer rows in [0, {num_tokens}), got {logits_indices.tolist()}")
        if token_ids.numel() and (int(token_ids.min()) < 0 or int(token_ids.max()) >= self.vocab_size):
            raise ValueError(f"token ids must be in [0, {self.vocab_size}), got range [{int(token_ids.min())}, {int(token_ids.max())}]")
        caches = [self.kv.get(r) for r in request_ids]
        for rid, cache, q in zip(request_ids, caches, query_lens):
            if q < 1:
                raise ValueError(f"request {rid!r}: query length must be >= 1, got {q}")
            if cache.length + q > cache.capacity:
                raise ValueError(f"request {rid!r}: {cache.length}+{q} tokens exceed its reserved KV of {cache.capacity}")
        meta = AttentionMetadata.build(caches, query_lens)
        token_ids = token_ids.to(self.device, non_blocking=True)  # checked on the host above
        if logits_indices is not None:
            logits_indices = logits_indices.to(self.device, non_blocking=True)
        hidden, captured = self.model(
            token_ids, meta.positions(), meta, capture_layers=self.capture_layers if capture else ()
        )
        for cache, q in zip(caches, query_lens):
            cache.length += q
        rows = hidden if logits_indices is None else hidden[logits_indices]
        starts = torch.tensor([0] + query_lens[:-1]).cumsum(0).tolist() if query_lens else []
        return ForwardOutput(hidden=hidden, logits=self.model.compute_logits(rows), captured=captured, query_start=starts)
