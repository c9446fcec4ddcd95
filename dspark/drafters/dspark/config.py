"""The DSpark drafter's configuration: one flat frozen dataclass, JSON round trip, presets.

The draft layers mirror the target's attention geometry by default (hidden size, heads, KV
heads, head dim, MLP width, RoPE): the drafter shares the target's embedding and LM head, so
its hidden size MUST equal the target's; the other sizes are copied only as a sensible default
(`DSparkConfig.from_target(target_cfg, **overrides)`).

    cfg = DSparkConfig.from_target(ModelConfig.from_dir(model_dir))   # 2 draft layers, γ = 7
    text = cfg.to_json(); assert DSparkConfig.from_json(text) == cfg
    cfg = DSparkConfig.tiny()                                           # unit tests
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dspark.drafters.config_json import DrafterConfigBase, check_geometry, check_shares_target, config_for_target, target_geometry
from dspark.model.config import ModelConfig

HEAD_TYPES = ("markov", "rnn", "gated")


def default_target_layer_ids(num_target_layers: int, count: int = 5) -> tuple[int, ...]:
    """`count` target layers spread evenly (DeepSpec: [1, 9, 17, 25, 33] of 36); the same rule
    as the target runtime's capture layers, so a default drafter reads what a default runtime
    captures."""
    from dspark.model.target_runtime import default_capture_layers

    return default_capture_layers(num_target_layers, count)


@dataclass(frozen=True)
class DSparkConfig(DrafterConfigBase):
    # ---- shared with the target (embedding / LM head / RoPE) -------------------------------
    vocab_size: int
    hidden_size: int  # must equal the target's: the embedding and LM head are the target's
    target_layer_ids: tuple[int, ...]  # target layers whose outputs form H_ctx, in concat order
    mask_token_id: int  # embedding row fed at block positions 2..γ (the frozen target row)
    # ---- draft layers (default: the target's geometry) -------------------------------------
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None  # same meaning as ModelConfig.rope_scaling (llama3 only)
    qk_norm: bool = False  # per-head RMSNorm on q and k (Qwen3-style targets)
    num_layers: int = 2  # a 2-layer DSpark beats a 5-layer DFlash (docs/method.md §10); ~1/15 of a 30-layer target
    block_size: int = 7  # γ: one anchor in, γ draft tokens out
    # ---- sequential + confidence heads -----------------------------------------------------
    head_type: str = "markov"  # "markov" (default) | "rnn" (docs/method.md §2, RNN head) | "gated" (DeepSpec's gated Markov head)
    markov_rank: int = 256  # r: W1 ∈ R^{V×r}, W2 ∈ R^{r×N}; also the RNN state size
    # N, the draft vocabulary (FR-Spec; EAGLE-3's draft_vocab_size): the LM head and the sequential
    # head's output cover only N target tokens (the checkpoint's `draft_to_target` map, the most
    # frequent tokens of the target's own outputs); p_d is zero elsewhere, the verifier still uses
    # the full vocabulary (docs/method.md §6). None = the whole target vocabulary.
    draft_vocab_size: int | None = None
    # the confidence head reads [h_k ; W1[x_{k-1}]] (True, the default and DeepSpec's released
    # drafters) or h_k alone (False: DeepSpec's confidence_head_with_markov = false)
    confidence_reads_prev: bool = True
    # ---- training loss (docs/method.md §3) -------------------------------------------------
    ce_weight: float = 0.1
    tv_weight: float = 0.9
    conf_weight: float = 1.0
    position_decay: float = 4.0  # γ_w in w_k = exp(-(k-1)/γ_w)

    def __post_init__(self) -> None:
        check_geometry(self, also_positive=("num_layers", "markov_rank"))
        if self.head_type not in HEAD_TYPES:
            raise ValueError(f"head_type must be one of {HEAD_TYPES}, got {self.head_type!r}")
        if self.draft_vocab_size is not None and not (isinstance(self.draft_vocab_size, int) and 1 <= self.draft_vocab_size <= self.vocab_size):
            raise ValueError(f"draft_vocab_size must be an int in [1, {self.vocab_size}] or None, got {self.draft_vocab_size!r}")
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise ValueError(f"mask_token_id must be in [0, {self.vocab_size}), got {self.mask_token_id}")
        for name in ("ce_weight", "tv_weight", "conf_weight"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if not self.position_decay > 0:
            raise ValueError(f"position_decay (γ_w) must be > 0, got {self.position_decay}")

    # derived: num_context_layers (m), q_size and kv_size come from DrafterConfigBase

    @property
    def output_vocab_size(self) -> int:
        """N, the number of tokens the drafter can propose (V without a draft vocabulary)."""
        return self.vocab_size if self.draft_vocab_size is None else self.draft_vocab_size

    # ---- constructors ----------------------------------------------------------------------

    @classmethod
    def from_target(cls, target: ModelConfig, **overrides: Any) -> DSparkConfig:
        """Draft layers with the target's geometry, context from 5 evenly spread target layers.

        `mask_token_id` defaults to the last vocabulary row (any fixed row works: the mask
        embedding is frozen and the draft layers learn around it); override it when the
        tokenizer has a reserved unused token."""
        defaults = {
            **target_geometry(target),
            "target_layer_ids": default_target_layer_ids(target.num_layers),
            "mask_token_id": target.vocab_size - 1,
        }
        return config_for_target(cls, target, defaults=defaults, overrides=overrides)

    @classmethod
    def tiny(cls, **overrides: Any) -> DSparkConfig:
        """For unit tests: matches `ModelConfig.tiny()` (vocab 256, hidden 64, 4 layers), γ = 4,
        rank 16, context from target layers (1, 3)."""
        base: dict[str, Any] = {"block_size": 4, "markov_rank": 16, "target_layer_ids": (1, 3)}
        base.update(overrides)
        return cls.from_target(ModelConfig.tiny(), **base)

    def check_target(self, target: ModelConfig) -> None:
        """Raise if this drafter cannot run on `target` (shared embedding / LM head / layers)."""
        check_shares_target(self.vocab_size, self.hidden_size, self.target_layer_ids, target)

    # JSON (to_dict / from_dict / to_json / from_json; no "algo" tag, as in the first
    # checkpoints): DrafterConfigBase
