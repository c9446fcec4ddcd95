"""Checkpoints in DeepSpec's released layout (github.com/deepseek-ai/DeepSpec), mapped onto our drafters.

    is_deepspec_checkpoint(DIR)                       # config.json names a DeepSpec model class
    deepspec_family(json.load(DIR/config.json))       # "dspark" | "dflash" | "eagle3"
    cfg = read_config(DIR, algo="dspark")             # our DSparkConfig / DFlashConfig / Eagle3Config
    check_target(DIR, target_config)                  # ValueError unless DIR was trained for this target
    cfg, state = load(DIR, algo="dspark", shared=SharedWeights.from_target(target))  # our names, fp32

The registry and each family's `load_checkpoint` call these when `--drafter-path DIR` holds such a
checkpoint, so `make_drafter("dspark", runtime=..., path=DIR)` serves it as it is.

What a DeepSpec checkpoint directory holds (its ckpt_manager: HF `save_pretrained` of the draft
model, bf16): config.json, a deep copy of the TARGET's HF config (hidden size, vocabulary, heads,
RoPE ...) with the draft's own fields on top (`architectures` = the DeepSpec class,
`num_hidden_layers` = draft layers, `num_target_layers`, `target_layer_ids`, and per family
`block_size`, `mask_token_id`, `markov_rank`, `markov_head_type`, `enable_confidence_head`,
`confidence_head_with_markov`, or `ttt_length`, `step_loss_decay`); model.safetensors (or shards
+ model.safetensors.index.json) with HF-style names, embed_tokens / lm_head included (frozen
copies of the target's). Training leftovers (train_config.py, training_state.rank*.pt) are ignored.

How DeepSpec's classes map onto ours (docs/deepspec-checkpoints.md has the line-by-line comparison):
  * Qwen3DSparkModel, markov_rank > 0 -> DSparkDrafter: fc -> context_proj, hidden_norm ->
    context_norm, norm -> final_norm, q/k/v_proj -> qkv_proj (rows stacked), gate/up_proj ->
    gate_up_proj, markov_w1 -> head.w1, markov_w2ᵀ -> head.w2 (our W2 is [r, N]),
    joint_proj -> head.joint (rnn), gate_proj -> head.gate (gated), confidence_head.proj ->
    confidence_head.proj; head types vanilla -> "markov", rnn, gated; confidence_head_with_markov
    -> DSparkConfig.confidence_reads_prev.
  * Qwen3DSparkModel, markov_rank = 0, no confidence head (DeepSpec's DFlash) -> DFlashDrafter
    with anchor_predicts=True (DeepSpec's block is DSpark's [x_0, mask × (γ-1)], not [x_0, mask × γ]).
  * Qwen3Eagle3Model (one layer) -> Eagle3Drafter with entry_layout="feature": input_layernorm ->
    embed_norm, hidden_norm -> feature_norm, norm -> final_norm, fc -> fc.
  * embed_tokens / lm_head are not loaded: our drafters use the served target's own tensors. They
    are compared with them instead (relative RMS difference <= SHARED_COPY_TOLERANCE): a
    checkpoint trained for another target of the same shapes fails loudly, not silently.
Not supported (ValueError naming it): Gemma 4 drafters, target layer -1 (the embedding output),
a DSpark checkpoint without a confidence head, an EAGLE-3 with more than one layer, activations
other than SiLU, attention biases, sliding-window layers, RoPE types other than default / llama3.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from dspark.drafters.checkpoint_io import CONFIG_FILE, WEIGHTS_FILE
from dspark.drafters.shared import SharedWeights
from dspark.model.config import ModelConfig

INDEX_FILE = "model.safetensors.index.json"  # sharded save_pretrained output
DSPARK_CLASSES = ("Qwen3DSparkModel",)  # DeepSpec's DSpark / DFlash class (one class, heads switched by config)
EAGLE3_CLASSES = ("Qwen3Eagle3Model",)
UNSUPPORTED_CLASSES = ("Gemma4DSparkModel", "Gemma4Eagle3Model")
HEAD_TYPES = {"vanilla": "markov", "rnn": "rnn", "gated": "gated"}  # DeepSpec markov_head_type -> DSparkConfig.head_type
# embed_tokens / lm_head are frozen copies of the target's, stored in bf16: a bf16 copy of the
# target differs by < 0.4 % RMS, a quantized (Q8 / Q4) target by a few %, another target by ~140 %
SHARED_COPY_TOLERANCE = 0.1
IGNORED_TENSORS = ("rotary_emb.inv_freq",)  # derived from the config (a non-persistent buffer; absent in practice)


# ---- detection ----------------------------------------------------------------------------------


def is_deepspec_config(data: Any) -> bool:
    """Whether a parsed config.json is DeepSpec's: an HF config naming a DeepSpec draft class and
    no "algo" (our own checkpoints carry "algo" or, for DSpark, no "architectures")."""
    if not isinstance(data, dict) or "algo" in data:
        return False
    archs = data.get("architectures") or []
    return isinstance(archs, list) and any(isinstance(a, str) and a.endswith(("DSparkModel", "Eagle3Model")) for a in archs)


def is_deepspec_checkpoint(directory: str | Path) -> bool:
    path = Path(directory) / CONFIG_FILE
    return path.exists() and is_deepspec_config(json.loads(path.read_text()))


def deepspec_family(data: dict, *, source: str | Path = CONFIG_FILE) -> str:
    """Our family for a DeepSpec config: "dspark" (Markov head), "dflash" (DSpark's class with no
    heads: DeepSpec's DFlash) or "eagle3"; ValueError for the classes we do not map."""
    arch = next(a for a in data["architectures"] if a.endswith(("DSparkModel", "Eagle3Model")))
    if arch in UNSUPPORTED_CLASSES:
        raise ValueError(f"{source}: a DeepSpec {arch} checkpoint; only Qwen3-target drafters "
                         f"({', '.join(DSPARK_CLASSES + EAGLE3_CLASSES)}) are supported")
    if arch in EAGLE3_CLASSES:
        return "eagle3"
    if arch in DSPARK_CLASSES:
        return "dspark" if int(data.get("markov_rank", 0)) > 0 else "dflash"
    raise ValueError(f"{source}: unknown DeepSpec draft class {arch!r}; expected one of {DSPARK_CLASSES + EAGLE3_CLASSES}")


def _read_json(directory: str | Path) -> dict:
    path = Path(directory) / CONFIG_FILE
    if not path.exists():
        raise FileNotFoundError(f"{directory} is not a drafter checkpoint: no {CONFIG_FILE}")
    data = json.loads(path.read_text())
    if not is_deepspec_config(data):
        raise ValueError(f"{path}: not a DeepSpec checkpoint (no DeepSpec class in \"architectures\")")
    return data


# ---- config -------------------------------------------------------------------------------------


def _geometry(data: dict, source: str | Path) -> tuple[ModelConfig, dict[str, Any]]:
    """The draft layers' geometry (DeepSpec's draft config IS the target's HF config with the draft's
    layer count), read as our target configs are (RoPE parameters of either transformers major),
    after refusing what our draft layers do not compute."""
    if data.get("model_type") != "qwen3":
        raise ValueError(f"{source}: model_type {data.get('model_type')!r}; DeepSpec drafters of Qwen3 targets only")
    if data.get("hidden_act", "silu") != "silu":
        raise ValueError(f"{source}: hidden_act {data['hidden_act']!r} (our draft layers use SiLU)")
    if data.get("attention_bias", False):
        raise ValueError(f"{source}: attention_bias is set (our draft layers have no q/k/v/o biases)")
    if data.get("use_sliding_window", False) or any(t != "full_attention" for t in data.get("layer_types") or []):
        raise ValueError(f"{source}: sliding-window draft layers are not supported (layer_types {data.get('layer_types')})")
    layers = [int(x) for x in data["target_layer_ids"]]
    if any(x < 0 for x in layers):
        raise ValueError(f"{source}: target_layer_ids {layers} read layer -1 (the embedding output), "
                         "which the target runtime does not capture")
    try:
        geo = ModelConfig.from_hf_dict(data)
    except ValueError as e:
        raise ValueError(f"{source}: {e}") from None
    common = {
        "vocab_size": geo.vocab_size, "hidden_size": geo.hidden_size, "target_layer_ids": tuple(layers),
        "num_heads": geo.num_heads, "num_kv_heads": geo.num_kv_heads, "head_dim": geo.head_dim,
        "intermediate_size": geo.intermediate_size, "rms_norm_eps": geo.rms_norm_eps, "rope_theta": geo.rope_theta,
        "rope_scaling": geo.rope_scaling, "qk_norm": True,  # Qwen3 attention: per-head q/k RMSNorm
    }
    return geo, common


def config_from_dict(data: dict, *, algo: str, source: str | Path = CONFIG_FILE):
    """Our family config for a DeepSpec config.json (parsed); `algo` is the family asked for."""
    found = deepspec_family(data, source=source)
    if found != algo:
        raise ValueError(f"{source} holds a DeepSpec drafter that maps onto {found!r}, not {algo!r}; use --drafter {found}")
    geo, common = _geometry(data, source)
    if algo == "eagle3":
        from dspark.drafters.eagle3.config import Eagle3Config

        if geo.num_layers != 1:
            raise ValueError(f"{source}: an EAGLE-3 drafter with {geo.num_layers} layers; "
                             "ours has one (as DeepSpec's evaluator requires)")
        return Eagle3Config(**common, block_size=int(data["ttt_length"]), step_decay=float(data.get("step_loss_decay", 0.8)),
                            entry_layout="feature")
    confidence = bool(data.get("enable_confidence_head", False))
    block = {"mask_token_id": int(data["mask_token_id"]), "num_layers": geo.num_layers, "block_size": int(data["block_size"])}
    if algo == "dflash":
        from dspark.drafters.dflash.config import DFlashConfig

        if confidence:
            raise ValueError(f"{source}: a DeepSpec drafter with a confidence head but no Markov head is not supported")
        return DFlashConfig(**common, **block, anchor_predicts=True)
    from dspark.drafters.dspark.config import DSparkConfig

    head = str(data.get("markov_head_type", "")).lower()
    if head not in HEAD_TYPES:
        raise ValueError(f"{source}: unknown markov_head_type {data.get('markov_head_type')!r}; supported: {sorted(HEAD_TYPES)}")
    if not confidence:
        raise ValueError(f"{source}: a DeepSpec DSpark drafter without a confidence head is not supported "
                         "(ours always proposes confidences)")
    return DSparkConfig(**common, **block, head_type=HEAD_TYPES[head], markov_rank=int(data["markov_rank"]),
                        confidence_reads_prev=bool(data.get("confidence_head_with_markov", False)))


def read_config(directory: str | Path, *, algo: str):
    return config_from_dict(_read_json(directory), algo=algo, source=Path(directory) / CONFIG_FILE)


def check_target(directory: str | Path, target: ModelConfig) -> None:
    """ValueError unless the checkpoint was trained for a target shaped as `target`: same hidden
    size and vocabulary (the embedding / LM head are shared), same number of layers
    (`num_target_layers`: the layer ids mean the same layers), every target layer id in range."""
    data = _read_json(directory)
    source = Path(directory) / CONFIG_FILE
    if target.model_type != "qwen3":
        raise ValueError(f"{source}: a DeepSpec drafter of a Qwen3 target, served with a {target.model_type!r} target")
    mine = {"hidden_size": target.hidden_size, "vocab_size": target.vocab_size, "num_target_layers": target.num_layers}
    theirs = {k: data.get(k) for k in mine}
    if theirs != mine:
        raise ValueError(f"{source}: trained for a target with {theirs}, served with {mine}")
    if any(int(x) < 0 for x in data["target_layer_ids"]):
        _geometry(data, source)  # names layer -1 (the embedding output)
    bad = [int(x) for x in data["target_layer_ids"] if not 0 <= int(x) < target.num_layers]
    if bad:
        raise ValueError(f"{source}: target_layer_ids {bad} out of range for a {target.num_layers}-layer target")


# ---- weights ------------------------------------------------------------------------------------


def read_tensors(directory: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint, as stored: model.safetensors, or the shards its index names."""
    directory = Path(directory)
    if (directory / WEIGHTS_FILE).exists():
        files = [directory / WEIGHTS_FILE]
    elif (directory / INDEX_FILE).exists():
        files = [directory / f for f in sorted(set(json.loads((directory / INDEX_FILE).read_text())["weight_map"].values()))]
    else:
        raise FileNotFoundError(f"{directory} is not a drafter checkpoint: no {WEIGHTS_FILE} or {INDEX_FILE}")
    state: dict[str, torch.Tensor] = {}
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (a safetensors handle, not a dict)
                state[name] = f.get_tensor(name)
    return state


def _relative_rms(saved: torch.Tensor, served: torch.Tensor) -> float:
    # saved, served: [V, d] -> ||saved - served|| / ||served||, in row chunks (no V x d fp32 temporaries)
    num = den = 0.0
    for a, b in zip(saved.split(8192), served.split(8192)):
        a, b = a.double(), b.double()
        num += float(((a - b) ** 2).sum())
        den += float((b**2).sum())
    return (num / max(den, 1e-30)) ** 0.5


def check_shared_copies(state: dict[str, torch.Tensor], shared: SharedWeights, *, source: str | Path) -> None:
    """The checkpoint's embed_tokens / lm_head against the served target's (which our drafters
    use instead): same shape, and equal up to bf16 / quantization rounding."""
    for name, served in (("embed_tokens.weight", shared.embed), ("lm_head.weight", shared.lm_head)):
        if name not in state:
            continue  # a checkpoint saved without its frozen copies: nothing to compare
        saved = state[name]
        if tuple(saved.shape) != tuple(served.shape):
            raise ValueError(f"{source}: {name} is {list(saved.shape)}, the served target's is {list(served.shape)}")
        diff = _relative_rms(saved, served)
        if diff > SHARED_COPY_TOLERANCE:
            raise ValueError(f"{source}: {name} differs from the served target's by {diff:.3g} (relative RMS, tolerance "
                             f"{SHARED_COPY_TOLERANCE}): the drafter was trained against another target")


class _Reader:
    """Takes tensors out of a DeepSpec state dict by name (fp32), remembering which were read, so
    that a tensor the mapping does not know is an error rather than silently dropped."""

    def __init__(self, state: dict[str, torch.Tensor], source: str | Path):
        self.state, self.source, self.used = state, source, set()

    def __call__(self, name: str) -> torch.Tensor:
        if name not in self.state:
            raise ValueError(f"{self.source}: missing tensor {name!r} (not a DeepSpec checkpoint of this kind?)")
        self.used.add(name)
        return self.state[name].float()

    def check_all_used(self) -> None:
        left = sorted(set(self.state) - self.used - {"embed_tokens.weight", "lm_head.weight", *IGNORED_TENSORS})
        if left:
            raise ValueError(f"{self.source}: tensors the mapping does not know: {left[:8]}{' ...' if len(left) > 8 else ''}")


def _qwen3_attention(get: _Reader, p: str, ours: dict[str, torch.Tensor], q: str) -> None:
    # DeepSpec's layer p ("layers.{i}.") -> our layer prefix q: q/k/v stacked by rows as our qkv_proj [q + 2 kv, in]
    a, mlp = p + "self_attn.", p + "mlp."
    ours[q + "qkv_proj.weight"] = torch.cat([get(a + "q_proj.weight"), get(a + "k_proj.weight"), get(a + "v_proj.weight")])
    ours[q + "o_proj.weight"] = get(a + "o_proj.weight")  # [hidden, q_size]
    ours[q + "q_norm"] = get(a + "q_norm.weight")  # [head_dim]
    ours[q + "k_norm"] = get(a + "k_norm.weight")
    # [2 I, hidden]: gate rows first, as our chunk(2) reads them
    ours[q + "gate_up_proj.weight"] = torch.cat([get(mlp + "gate_proj.weight"), get(mlp + "up_proj.weight")])
    ours[q + "down_proj.weight"] = get(mlp + "down_proj.weight")  # [hidden, I]
    ours[q + "post_attn_norm"] = get(p + "post_attention_layernorm.weight")  # [hidden]


def translate_state(state: dict[str, torch.Tensor], config, *, algo: str, source: str | Path = "") -> dict[str, torch.Tensor]:
    """DeepSpec's tensors -> our family's state_dict (names and layouts), fp32."""
    get = _Reader(state, source)
    ours: dict[str, torch.Tensor] = {}
    if algo == "eagle3":
        ours["fc.weight"] = get("fc.weight")  # [hidden, m * hidden], layer-major input as our fuse()
        ours["final_norm"] = get("norm.weight")
        ours["layer.embed_norm"] = get("layers.0.input_layernorm.weight")  # RMSNorm of embed(x), the first half of the input
        ours["layer.feature_norm"] = get("layers.0.hidden_norm.weight")  # RMSNorm of the feature, the second half
        _qwen3_attention(get, "layers.0.", ours, "layer.")
        get.check_all_used()
        return ours
    ours["context_proj.weight"] = get("fc.weight")  # W_c [hidden, m * hidden]
    ours["context_norm"] = get("hidden_norm.weight")
    ours["final_norm"] = get("norm.weight")
    for i in range(config.num_layers):
        p = f"layers.{i}."
        ours[p + "input_norm"] = get(p + "input_layernorm.weight")
        _qwen3_attention(get, p, ours, p)
    if algo == "dspark":
        ours["head.w1.weight"] = get("markov_head.markov_w1.weight")  # [V, r]
        ours["head.w2"] = get("markov_head.markov_w2.weight").t().contiguous()  # nn.Linear(r, V).weight [V, r] -> our W2 [r, V]
        if config.head_type == "rnn":  # same [s ; W1[x] ; h] input order and [gate ; candidate ; output] row split as ours
            ours["head.joint.weight"] = get("markov_head.joint_proj.weight")  # [3r, 2r + hidden]
            ours["head.joint.bias"] = get("markov_head.joint_proj.bias")
        elif config.head_type == "gated":  # input [h ; W1[x]] as ours
            ours["head.gate.weight"] = get("markov_head.gate_proj.weight")  # [r, hidden + r]
            ours["head.gate.bias"] = get("markov_head.gate_proj.bias")
        ours["confidence_head.proj.weight"] = get("confidence_head.proj.weight")  # [1, hidden (+ r)]
        ours["confidence_head.proj.bias"] = get("confidence_head.proj.bias")
    get.check_all_used()
    return ours


def load(directory: str | Path, *, algo: str, shared: SharedWeights) -> tuple[Any, dict[str, torch.Tensor]]:
    """Our family config and state_dict for the DeepSpec checkpoint in `directory`, after checking
    its embed_tokens / lm_head against the served target's (`shared`)."""
    config = read_config(directory, algo=algo)
    state = read_tensors(directory)
    check_shared_copies(state, shared, source=directory)
    return config, translate_state(state, config, algo=algo, source=directory)


__all__ = [
    "SHARED_COPY_TOLERANCE", "check_shared_copies", "check_target", "config_from_dict", "deepspec_family",
    "is_deepspec_checkpoint", "is_deepspec_config", "load", "read_config", "read_tensors", "translate_state",
]
