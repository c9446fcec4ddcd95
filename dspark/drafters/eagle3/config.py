"""The EAGLE-3 baseline's configuration: one flat frozen dataclass, JSON round trip with an "algo" field.

EAGLE-3 fuses low, mid and high target features through one linear layer; here the fusion
reads ALL the target layers the cache captured (`target_layer_ids`, DeepSpec's 5 evenly spread
layers by default, the very layers DSpark and DFlash read), so the three drafters see the
same target information. The one decoder layer has the target's attention geometry; its
attention input is [RMSNorm(embed(x)) ; RMSNorm(feature)] (2 × hidden wide).

Training-time test (TTT) unrolls `block_size` = γ steps (the same horizon as DSpark's block);
step j's loss is weighted step_decay^(j-1) (EAGLE-3's training code: 0.8).

    cfg = Eagle3Config.from_target(ModelConfig.from_dir(model_dir))    # γ = 7, 5 fused layers
    assert Eagle3Config.from_json(cfg.to_json()) == cfg
    cfg = Eagle3Config.tiny()                                            # unit tests
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dspark.drafters.config_json import check_fields, check_shares_target, config_from_dict, config_from_json, config_to_dict, config_to_json
from dspark.model.config import ModelConfig

ALGO = "eagle3"


@dataclass(frozen=True)
class Eagle3Config:
    # ---- shared with the target (embedding / LM head / RoPE) -------------------------------
    vocab_size: int
    hidden_size: int  # must equal the target's: the embedding and LM head are the target's
    target_layer_ids: tuple[int, ...]  # target layers fused by fc, in concat order
    # ---- the decoder layer (default: the target's geometry) --------------------------------
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    qk_norm: bool = False
    # ---- training-time test ----------------------------------------------------------------
    block_size: int = 7  # γ: TTT unroll horizon in training, draft tokens per round in serving
    step_decay: float = 0.8  # step j's loss weight step_decay^(j-1) (EAGLE-3)

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "num_heads", "num_kv_heads", "head_dim", "intermediate_size", "block_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if not isinstance(self.target_layer_ids, tuple) or not self.target_layer_ids:
            raise ValueError(f"target_layer_ids must be a non-empty tuple, got {self.target_layer_ids!r}")
        if len(set(self.target_layer_ids)) != len(self.target_layer_ids) or min(self.target_layer_ids) < 0:
            raise ValueError(f"target_layer_ids must be distinct non-negative layer indices, got {self.target_layer_ids}")
        if not 0 < self.step_decay <= 1:
            raise ValueError(f"step_decay must be in (0, 1], got {self.step_decay}")

    # ---- derived ---------------------------------------------------------------------------

    @property
    def algo(self) -> str:
        return ALGO

    @property
    def num_context_layers(self) -> int:  # m, the fused target layers
        return len(self.target_layer_ids)

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    # ---- constructors ----------------------------------------------------------------------

    @classmethod
    def from_target(cls, target: ModelConfig, **overrides: Any) -> Eagle3Config:
        """The decoder layer with the target's geometry, features from the 5 evenly spread target
        layers the runtime captures by default, then `overrides`."""
        from dspark.model.target_runtime import default_capture_layers

        base: dict[str, Any] = {
            "vocab_size": target.vocab_size,
            "hidden_size": target.hidden_size,
            "target_layer_ids": default_capture_layers(target.num_layers),
            "num_heads": target.num_heads,
            "num_kv_heads": target.num_kv_heads,
            "head_dim": target.head_dim,
            "intermediate_size": target.intermediate_size,
            "rms_norm_eps": target.rms_norm_eps,
            "rope_theta": target.rope_theta,
            "rope_scaling": dict(target.rope_scaling) if target.rope_scaling else None,
            "qk_norm": target.qk_norm,
        }
        check_fields(cls, overrides)
        base.update(overrides)
        base["target_layer_ids"] = tuple(base["target_layer_ids"])
        cfg = cls(**base)
        cfg.check_target(target)
        return cfg

    @classmethod
    def tiny(cls, **overrides: Any) -> Eagle3Config:
        """For unit tests: matches `ModelConfig.tiny()` (vocab 256, hidden 64, 4 layers), γ = 4,
        features from target layers (1, 3)."""
        base: dict[str, Any] = {"block_size": 4, "target_layer_ids": (1, 3)}
        base.update(overrides)
        return cls.from_target(ModelConfig.tiny(), **base)

    def check_target(self, target: ModelConfig) -> None:
        """Raise if this drafter cannot run on `target` (shared embedding / LM head / layers)."""
        check_shares_target(self.vocab_size, self.hidden_size, self.target_layer_ids, target)

    # ---- JSON (dspark/drafters/config_json.py) ---------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        return config_to_dict(self, algo=ALGO)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Eagle3Config:
        return config_from_dict(cls, d, algo=ALGO)

    def to_json(self) -> str:
        return config_to_json(self, algo=ALGO)

    @classmethod
    def from_json(cls, text: str) -> Eagle3Config:
        return config_from_json(cls, text, algo=ALGO)


__all__ = ["ALGO", "Eagle3Config"]
