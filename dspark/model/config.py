"""The target model's architecture, read from a Hugging Face `config.json`.

One flat dataclass covers the Llama family (Llama 2/3, SmolLM2) and Qwen2/Qwen3: they differ
only in QKV bias, per-head q/k RMSNorm and RoPE scaling, which are fields here.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral")


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool = False  # Qwen2: bias on q/k/v projections
    qk_norm: bool = False  # Qwen3: RMSNorm on each head of q and k before RoPE
    rope_scaling: dict | None = None  # only {"rope_type": "llama3", ...} is implemented

    @classmethod
    def from_hf_dict(cls, cfg: dict) -> "ModelConfig":
        model_type = cfg.get("model_type", "")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"unsupported model_type {model_type!r}; expected one of {SUPPORTED_MODEL_TYPES}"
            )
        num_heads = cfg["num_attention_heads"]
        rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
        rope_theta = cfg.get("rope_theta", rope.get("rope_theta", 10000.0))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ("default", "llama3"):
            raise ValueError(f"unsupported rope_type {rope_type!r}; expected 'default' or 'llama3'")
        return cls(
            model_type=model_type,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=cfg.get("num_key_value_heads", num_heads),
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // num_heads,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope_theta),
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", model_type == "qwen2")),
            qk_norm=model_type == "qwen3",
            rope_scaling=dict(rope) if rope_type == "llama3" else None,
        )

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> "ModelConfig":
        return cls.from_hf_dict(json.loads((Path(model_dir) / "config.json").read_text()))

    @classmethod
    def tiny(cls, **overrides) -> "ModelConfig":
        """A randomly initialisable model small enough for unit tests (milliseconds per forward)."""
        base = dict(
            model_type="llama", vocab_size=256, hidden_size=64, intermediate_size=128,
            num_layers=4, num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-5,
            rope_theta=10000.0, max_position_embeddings=512, tie_word_embeddings=True,
        )
        base.update(overrides)
        return cls(**base)

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def kv_bytes_per_token(self, element_size: int) -> int:
        return 2 * self.num_layers * self.kv_size * element_size
