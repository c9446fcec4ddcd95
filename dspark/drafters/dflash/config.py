"""The DFlash baseline's configuration: one flat frozen dataclass, JSON round trip with an "algo" field.

DFlash is DSpark's parallel backbone in its original form, so its draft-layer geometry has the
same fields, defaults and validation as `DSparkConfig` (the same target layers, mask row and
target geometry by default: `DFlashConfig.from_target(target_cfg, **overrides)`); it has no
sequential or confidence head, and its loss is cross-entropy alone with position weights
w_k = exp(-(k-1)/γ_w) (DFlash Eq. 4; its recipe pairs γ_w = 4 with a block of 8 inputs, i.e.
γ = 7 drafts, 5 with 10 and 7 with 16).

    cfg = DFlashConfig.from_target(ModelConfig.from_dir(model_dir))    # 2 draft layers, γ = 7
    assert DFlashConfig.from_json(cfg.to_json()) == cfg
    cfg = DFlashConfig.tiny()                                            # unit tests
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from dspark.drafters.config_json import DrafterConfigBase, config_for_target
from dspark.drafters.dspark.config import DSparkConfig
from dspark.model.config import ModelConfig

ALGO = "dflash"


@dataclass(frozen=True)
class DFlashConfig(DrafterConfigBase):
    # ---- shared with the target (embedding / LM head / RoPE) -------------------------------
    vocab_size: int
    hidden_size: int  # must equal the target's: the embedding and LM head are the target's
    target_layer_ids: tuple[int, ...]  # target layers whose outputs form H_ctx, in concat order
    mask_token_id: int  # embedding row fed at block positions 1..γ (the frozen target row)
    # ---- draft layers (default: the target's geometry) -------------------------------------
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    qk_norm: bool = False
    num_layers: int = 2
    block_size: int = 7  # γ draft tokens; the block holds γ + 1 inputs: x_0 and γ masks
    # False (default, the original DFlash): the block is [x_0, mask × γ] and the anchor's own output
    # predicts nothing. True (DeepSpec's DFlash checkpoints): the block is [x_0, mask × (γ-1)] and
    # block position k-1 predicts x_k, the anchor's output included (DSpark's block without its heads).
    anchor_predicts: bool = False
    # ---- training loss ---------------------------------------------------------------------
    position_decay: float = 4.0  # γ_w in w_k = exp(-(k-1)/γ_w) (DFlash: 4 for its block of 8)

    json_algo = ALGO  # not a field: unannotated

    def __post_init__(self) -> None:
        # The backbone is DSpark's: validate the geometry by exactly DSpark's rules.
        self.backbone_geometry()

    # ---- derived (and num_context_layers = m, q_size, kv_size: DrafterConfigBase) -----------

    @property
    def algo(self) -> str:
        return ALGO

    @property
    def block_len(self) -> int:  # inputs per block: x_0 + γ masks (γ - 1 masks when the anchor predicts)
        return self.block_size if self.anchor_predicts else self.block_size + 1

    @property
    def first_draft_slot(self) -> int:  # the block position whose output predicts x_1
        return 0 if self.anchor_predicts else 1

    def backbone_geometry(self) -> DSparkConfig:
        """The same backbone as a DSparkConfig (raises ValueError on an invalid geometry)."""
        shared = {f.name for f in dataclasses.fields(DSparkConfig)} & {f.name for f in dataclasses.fields(self)}
        return DSparkConfig(**{name: getattr(self, name) for name in shared})

    # ---- constructors ----------------------------------------------------------------------

    @classmethod
    def from_target(cls, target: ModelConfig, **overrides: Any) -> DFlashConfig:
        """The target's geometry and DSpark's defaults (5 evenly spread target layers, the last
        vocabulary row as the mask), then `overrides`."""
        dspark = DSparkConfig.from_target(target)
        names = {f.name for f in dataclasses.fields(cls)}
        defaults: dict[str, Any] = {name: getattr(dspark, name) for name in names if hasattr(dspark, name)}
        defaults["position_decay"] = cls.position_decay
        return config_for_target(cls, target, defaults=defaults, overrides=overrides)

    @classmethod
    def tiny(cls, **overrides: Any) -> DFlashConfig:
        """For unit tests: matches `ModelConfig.tiny()`, γ = 4, context from target layers (1, 3)."""
        base: dict[str, Any] = {"block_size": 4, "target_layer_ids": (1, 3)}
        base.update(overrides)
        return cls.from_target(ModelConfig.tiny(), **base)

    def check_target(self, target: ModelConfig) -> None:
        """Raise if this drafter cannot run on `target` (shared embedding / LM head / layers)."""
        self.backbone_geometry().check_target(target)

    # JSON (to_dict / from_dict / to_json / from_json, tagged "algo": "dflash"): DrafterConfigBase


__all__ = ["ALGO", "DFlashConfig"]
