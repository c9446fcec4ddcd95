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

from dspark.drafters.config_json import DrafterConfigBase, check_geometry, check_shares_target, config_for_target, target_geometry
from dspark.model.config import ModelConfig

ALGO = "eagle3"
ENTRY_LAYOUTS = ("token", "feature")


@dataclass(frozen=True)
class Eagle3Config(DrafterConfigBase):
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
    # How entries are laid out (ENTRY_LAYOUTS). "token" (default): entry p = [embed(x_p) ; g_{p-1}]
    # at RoPE position p, entry 0 = [embed(x_0) ; 0] attended to like any other. "feature"
    # (DeepSpec / SpecForge checkpoints): the same pairs indexed by the feature's position, i.e. at
    # RoPE position p - 1, and no featureless entry: entry 0 is never another entry's key.
    entry_layout: str = "token"

    json_algo = ALGO  # not a field: unannotated

    def __post_init__(self) -> None:
        check_geometry(self)
        if not 0 < self.step_decay <= 1:
            raise ValueError(f"step_decay must be in (0, 1], got {self.step_decay}")
        if self.entry_layout not in ENTRY_LAYOUTS:
            raise ValueError(f"entry_layout must be one of {ENTRY_LAYOUTS}, got {self.entry_layout!r}")

    # ---- derived (and num_context_layers = m fused layers, q_size, kv_size: DrafterConfigBase) -

    @property
    def algo(self) -> str:
        return ALGO

    # ---- constructors ----------------------------------------------------------------------

    @classmethod
    def from_target(cls, target: ModelConfig, **overrides: Any) -> Eagle3Config:
        """The decoder layer with the target's geometry, features from the 5 evenly spread target
        layers the runtime captures by default, then `overrides`."""
        from dspark.model.target_runtime import default_capture_layers

        defaults = {**target_geometry(target), "target_layer_ids": default_capture_layers(target.num_layers)}
        return config_for_target(cls, target, defaults=defaults, overrides=overrides)

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

    # JSON (to_dict / from_dict / to_json / from_json, tagged "algo": "eagle3"): DrafterConfigBase


__all__ = ["ALGO", "ENTRY_LAYOUTS", "Eagle3Config"]
