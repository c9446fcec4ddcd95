"""Specification: a checkpoint in DeepSpec's released layout loads as it is, and our drafters then
compute what DeepSpec's own code computes from it (dspark/drafters/deepspec_format.py,
docs/deepspec-checkpoints.md).

The fixtures (tests/fixtures/deepspec/, made by scripts/make_deepspec_fixtures.py WITH DeepSpec's
modeling and eval code) are tiny random DSpark (vanilla / rnn / gated heads), DFlash and EAGLE-3
drafters of a tiny Qwen3 target, saved by DeepSpec's `save_pretrained` in bf16, plus fixed inputs
(target layer outputs, token ids, anchors) and the fp32 outputs DeepSpec's eval path computes from
them: greedy draft tokens, the logits they were drawn from, DSpark's confidence logits.

Tolerance: max |ours - DeepSpec| <= 1e-4 on logits of std ~2 (both fp32 from the same bf16
weights; what remains is summation order, measured <= 6e-6), and the greedy tokens exactly equal.

    python -m pytest tests/drafters/test_deepspec_checkpoints.py -q
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from dspark.drafters import deepspec_format, registry
from dspark.drafters.base import DraftRequest
from dspark.drafters.checkpoint_io import checkpoint_algo
from dspark.drafters.dspark.checkpoint import export_checkpoint, load_checkpoint
from dspark.drafters.dspark.model import BlockBatch
from dspark.drafters.registry import drafter_capture_layers, make_drafter
from dspark.drafters.shared import SharedWeights
from dspark.model.config import ModelConfig
from dspark.model.target_runtime import TargetRuntime
from dspark.sampling.params import SamplingParams
from tests.conftest import build_transformer, random_hf_state_dict

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "deepspec"
ATOL = 1e-4  # max abs difference of fp32 logits / confidence logits against DeepSpec's
GREEDY = SamplingParams(temperature=0.0)

DSPARK = ["dspark_qwen3_tiny_block7", "dspark_qwen3_tiny_rnn_block4", "dspark_qwen3_tiny_gated_block4"]
DFLASH = ["dflash_qwen3_tiny_block4"]
EAGLE3 = ["eagle3_qwen3_tiny_ttt4"]
FAMILY = {**dict.fromkeys(DSPARK, "dspark"), **dict.fromkeys(DFLASH, "dflash"), **dict.fromkeys(EAGLE3, "eagle3")}


def expected(name: str) -> dict[str, torch.Tensor]:
    return load_file(str(FIXTURES / f"{name}.expected.safetensors"))


def target_config(directory: Path) -> ModelConfig:
    """The target the checkpoint was trained for: DeepSpec's draft config IS the target's HF config
    with the draft's layer count, and `num_target_layers` the target's."""
    data = json.loads((directory / "config.json").read_text())
    return ModelConfig.from_hf_dict({**data, "num_hidden_layers": data["num_target_layers"]})


def runtime_for(directory: Path, *, seed: int = 0, embed_from_checkpoint: bool = True) -> TargetRuntime:
    """A tiny random Qwen3 target of that shape whose embedding and LM head are the ones the
    drafter was trained with (DeepSpec stores frozen copies of them in the checkpoint)."""
    cfg = target_config(directory)
    sd = random_hf_state_dict(cfg, seed=seed)
    if embed_from_checkpoint:
        tensors = deepspec_format.read_tensors(directory)
        sd["model.embed_tokens.weight"] = tensors["embed_tokens.weight"].float()
        sd["lm_head.weight"] = tensors["lm_head.weight"].float()
    model = build_transformer(cfg, sd, compute_dtype=torch.float32)
    return TargetRuntime(model, kv_budget_tokens=1024)


def blocks_at_anchors(exp: dict[str, torch.Tensor]) -> BlockBatch:
    """One row per anchor t: the target layer outputs at positions 0..t-1, anchor token x_t."""
    ctx, tokens = exp["context"], exp["token_ids"]  # [L, m, hidden], [L + 1]
    anchors = exp["anchor_positions"].tolist()
    return BlockBatch.from_sequences(contexts=[ctx[:t] for t in anchors], anchor_positions=[torch.tensor([t]) for t in anchors],
                                     anchor_tokens=[tokens[t : t + 1] for t in anchors])


def greedy_proposals(drafter, exp: dict[str, torch.Tensor], gamma: int):
    """The serving drafter's greedy proposal at each anchor, after observing the context before it."""
    out = []
    for i, t in enumerate(exp["anchor_positions"].tolist()):
        rid = f"r{i}"
        drafter.observe(rid, exp["context"][:t])
        out.append(drafter.propose([DraftRequest(rid, exp["token_ids"][: t + 1].tolist(), 1, GREEDY, gamma)])[0])
    return out


def served(name: str):
    """Fixture `name` loaded by the registry path `dspark serve` takes, its expected numbers, and γ."""
    directory = FIXTURES / name
    drafter = make_drafter(FAMILY[name], runtime=runtime_for(directory), path=directory)
    exp = expected(name)
    return drafter, exp, exp["draft_tokens"].shape[1]


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.detach().float() - b.float()).abs().max())


# ---- the numbers: ours == DeepSpec's ---------------------------------------------------------------


@pytest.mark.parametrize("name", DSPARK)
def test_dspark_logits_and_confidences_equal_deepspecs(name):
    drafter, exp, gamma = served(name)
    assert drafter.spec.block_size == gamma and drafter.spec.provides_confidences

    # teacher-forced on DeepSpec's greedy tokens = the previous tokens its sampler conditioned on
    out = drafter.model(blocks_at_anchors(exp), target_tokens=exp["draft_tokens"].unsqueeze(1))
    assert exp["draft_logits"].std() > 1.0  # not a comparison of near-zero logits
    assert max_diff(out.logits[:, 0], exp["draft_logits"]) <= ATOL
    assert max_diff(out.confidence_logits[:, 0], exp["confidence_logits"]) <= ATOL

    # and served: the same greedy tokens, with confidences σ(logit) (no sts.json: uncalibrated)
    for proposal, tokens, conf in zip(greedy_proposals(drafter, exp, gamma), exp["draft_tokens"], exp["confidence_logits"]):
        assert proposal.token_ids.tolist() == tokens.tolist()
        assert max_diff(proposal.confidences, torch.sigmoid(conf)) <= ATOL


@pytest.mark.parametrize("name", DFLASH)
def test_dflash_logits_equal_deepspecs(name):
    drafter, exp, gamma = served(name)
    assert drafter.model.config.anchor_predicts and drafter.model.block_len == gamma  # DeepSpec's block: [x_0, mask × (γ-1)]
    logits = drafter.model(blocks_at_anchors(exp))[:, 0]  # [anchors, γ, V]
    assert exp["draft_logits"].std() > 1.0
    assert max_diff(logits, exp["draft_logits"]) <= ATOL
    for proposal, tokens in zip(greedy_proposals(drafter, exp, gamma), exp["draft_tokens"]):
        assert proposal.token_ids.tolist() == tokens.tolist()


@pytest.mark.parametrize("name", EAGLE3)
def test_eagle3_logits_equal_deepspecs(name):
    drafter, exp, gamma = served(name)
    assert drafter.model.config.entry_layout == "feature"
    # training-time test over the anchors, teacher-forced on DeepSpec's greedy chain (what it fed back)
    batch = blocks_at_anchors(exp)
    ctx_len = batch.context.shape[1]
    token_rows = torch.stack([exp["token_ids"][: ctx_len + 1] for _ in range(batch.num_rows)])  # [rows, L + 1]
    out = drafter.model(batch, context_token_ids=token_rows, target_tokens=exp["draft_tokens"].unsqueeze(1))
    assert exp["draft_logits"].std() > 1.0
    assert max_diff(out.logits[:, 0], exp["draft_logits"]) <= ATOL
    # and served (KV cache, catch-up step, chain): the same greedy tokens
    for proposal, tokens in zip(greedy_proposals(drafter, exp, gamma), exp["draft_tokens"]):
        assert proposal.token_ids.tolist() == tokens.tolist()


@pytest.mark.parametrize("name", DSPARK + DFLASH + EAGLE3)
def test_the_registry_reads_the_family_and_capture_layers_from_the_deepspec_config(name):
    directory = FIXTURES / name
    data = json.loads((directory / "config.json").read_text())
    assert checkpoint_algo(directory) == FAMILY[name]
    assert drafter_capture_layers(FAMILY[name], directory) == tuple(data["target_layer_ids"])
    family = registry.family(FAMILY[name])
    loaded = family.load(directory, shared=_shared(runtime_for(directory)))  # what `dspark train --init-from` style callers use
    assert isinstance(getattr(loaded, "drafter", loaded), family.model)


def _shared(runtime):
    return SharedWeights.from_target(runtime.model)


# ---- the tests can fail: a wrong mapping is caught ------------------------------------------------


def _copy(name: str, tmp_path: Path) -> Path:
    dst = tmp_path / name
    shutil.copytree(FIXTURES / name, dst)
    return dst


def _edit_tensors(directory: Path, edit) -> None:
    path = directory / "model.safetensors"
    tensors = load_file(str(path))
    edit(tensors)
    save_file(tensors, str(path), metadata={"format": "pt"})


@pytest.mark.parametrize("swap", [
    ("layers.0.mlp.gate_proj.weight", "layers.0.mlp.up_proj.weight"),  # gate / up halves of our gate_up_proj
    ("layers.0.input_layernorm.weight", "layers.0.post_attention_layernorm.weight"),
    ("hidden_norm.weight", "norm.weight"),  # context norm vs final norm
    ("layers.0.self_attn.q_norm.weight", "layers.0.self_attn.k_norm.weight"),
])
def test_a_swapped_tensor_changes_the_logits_beyond_the_tolerance(swap, tmp_path):
    name = DSPARK[0]
    directory = _copy(name, tmp_path)
    _edit_tensors(directory, lambda t: t.update({swap[0]: t[swap[1]], swap[1]: t[swap[0]]}))
    drafter = make_drafter("dspark", runtime=runtime_for(FIXTURES / name), path=directory)
    exp = expected(name)
    out = drafter.model(blocks_at_anchors(exp), target_tokens=exp["draft_tokens"].unsqueeze(1))
    assert max_diff(out.logits[:, 0], exp["draft_logits"]) > 100 * ATOL


def test_an_untransposed_markov_w2_changes_the_logits(tmp_path, monkeypatch):
    """W2 is [V, r] in DeepSpec (nn.Linear(r, V).weight) and [r, V] here: the transpose matters
    (a square r = V would hide it; here r = 16, V = 256, so check the values through a wrong map)."""
    name = DSPARK[0]
    real = deepspec_format.translate_state

    def wrong(state, config, **kw):
        ours = real(state, config, **kw)
        w2 = ours["head.w2"]  # [r, V]
        ours["head.w2"] = w2.reshape(w2.shape[1], w2.shape[0]).t().contiguous()  # same shape, wrong layout
        return ours

    monkeypatch.setattr(deepspec_format, "translate_state", wrong)
    directory = FIXTURES / name
    drafter = make_drafter("dspark", runtime=runtime_for(directory), path=directory)
    exp = expected(name)
    out = drafter.model(blocks_at_anchors(exp), target_tokens=exp["draft_tokens"].unsqueeze(1))
    assert max_diff(out.logits[:, 0], exp["draft_logits"]) > 100 * ATOL


def test_eagle3_with_our_own_entry_layout_does_not_match_deepspec(monkeypatch):
    """The featureless entry 0 and the RoPE offset are real differences: without
    entry_layout="feature" the same weights give other logits."""
    import dataclasses

    name = EAGLE3[0]
    real = deepspec_format.config_from_dict
    monkeypatch.setattr(deepspec_format, "config_from_dict",
                        lambda data, **kw: dataclasses.replace(real(data, **kw), entry_layout="token"))
    directory = FIXTURES / name
    drafter = make_drafter("eagle3", runtime=runtime_for(directory), path=directory)
    exp = expected(name)
    batch = blocks_at_anchors(exp)
    token_rows = torch.stack([exp["token_ids"][: batch.context.shape[1] + 1] for _ in range(batch.num_rows)])
    out = drafter.model(batch, context_token_ids=token_rows, target_tokens=exp["draft_tokens"].unsqueeze(1))
    assert max_diff(out.logits[:, 0], exp["draft_logits"]) > 100 * ATOL


def test_dflash_with_our_own_block_does_not_match_deepspec(monkeypatch):
    import dataclasses

    name = DFLASH[0]
    real = deepspec_format.config_from_dict
    monkeypatch.setattr(deepspec_format, "config_from_dict",
                        lambda data, **kw: dataclasses.replace(real(data, **kw), anchor_predicts=False))
    directory = FIXTURES / name
    drafter = make_drafter("dflash", runtime=runtime_for(directory), path=directory)
    exp = expected(name)
    assert max_diff(drafter.model(blocks_at_anchors(exp))[:, 0], exp["draft_logits"]) > 100 * ATOL


# ---- clear errors ---------------------------------------------------------------------------------


def test_a_target_of_another_shape_is_refused_before_loading():
    directory = FIXTURES / DSPARK[0]
    cfg = ModelConfig.tiny(model_type="qwen3", qk_norm=True, num_layers=6)
    wrong = TargetRuntime(build_transformer(cfg, random_hf_state_dict(cfg, seed=0), compute_dtype=torch.float32), kv_budget_tokens=256)
    assert (cfg.hidden_size, cfg.vocab_size) == (64, 256)  # same shapes as the checkpoint's target...
    with pytest.raises(ValueError, match="another target"):  # ...but other embedding / LM head weights
        make_drafter("dspark", runtime=wrong, path=directory)
    small = runtime_for(FIXTURES / DSPARK[1])  # hidden 32, 4 layers
    with pytest.raises(ValueError, match="trained for a target with"):
        make_drafter("dspark", runtime=small, path=directory)


def test_target_layer_ids_out_of_range_and_the_embedding_layer_are_refused(tmp_path):
    runtime = runtime_for(FIXTURES / DSPARK[0])
    for layers, message in (([1, 6], "out of range"), ([-1, 3], "embedding output")):
        directory = _copy(DSPARK[0], tmp_path / str(layers[0]))
        data = json.loads((directory / "config.json").read_text())
        (directory / "config.json").write_text(json.dumps({**data, "target_layer_ids": layers}))
        with pytest.raises(ValueError, match=message):
            make_drafter("dspark", runtime=runtime, path=directory)


@pytest.mark.parametrize("edit, message", [
    ({"markov_head_type": "transformer"}, "unknown markov_head_type"),
    ({"architectures": ["Gemma4DSparkModel"]}, "only Qwen3-target drafters"),
    ({"architectures": ["Llama3DSparkModel"]}, "unknown DeepSpec draft class"),
    ({"enable_confidence_head": False}, "without a confidence head"),
    ({"hidden_act": "gelu"}, "hidden_act"),
])
def test_unsupported_layouts_and_heads_are_refused_with_their_name(edit, message, tmp_path):
    directory = _copy(DSPARK[0], tmp_path)
    data = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**data, **edit}))
    with pytest.raises(ValueError, match=message):
        make_drafter("dspark", runtime=runtime_for(FIXTURES / DSPARK[0]), path=directory)


def test_a_deepspec_checkpoint_of_another_family_names_the_drafter_to_use():
    runtime = runtime_for(FIXTURES / DFLASH[0])
    with pytest.raises(ValueError, match="use --drafter dflash"):
        make_drafter("dspark", runtime=runtime, path=FIXTURES / DFLASH[0])


def test_an_unknown_tensor_or_a_missing_one_is_named(tmp_path):
    runtime = runtime_for(FIXTURES / DSPARK[0])
    extra = _copy(DSPARK[0], tmp_path / "extra")
    _edit_tensors(extra, lambda t: t.update({"markov_head.extra.weight": torch.zeros(2)}))
    with pytest.raises(ValueError, match="markov_head.extra.weight"):
        make_drafter("dspark", runtime=runtime, path=extra)
    missing = _copy(DSPARK[0], tmp_path / "missing")
    _edit_tensors(missing, lambda t: t.pop("layers.1.self_attn.k_norm.weight"))
    with pytest.raises(ValueError, match="layers.1.self_attn.k_norm.weight"):
        make_drafter("dspark", runtime=runtime, path=missing)


def test_sharded_weights_load_like_one_file(tmp_path):
    """save_pretrained shards big checkpoints (model-0000i-of-0000n.safetensors + an index)."""
    name = EAGLE3[0]
    directory = _copy(name, tmp_path)
    tensors = load_file(str(directory / "model.safetensors"))
    (directory / "model.safetensors").unlink()
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for file, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, str(directory / file), metadata={"format": "pt"})
    index = {"metadata": {}, "weight_map": {k: f for f, keys in shards.items() for k in keys}}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index))
    assert deepspec_format.read_tensors(directory).keys() == tensors.keys()
    drafter = make_drafter("eagle3", runtime=runtime_for(FIXTURES / name), path=directory)
    exp = expected(name)
    assert [p.token_ids.tolist() for p in greedy_proposals(drafter, exp, 4)] == exp["draft_tokens"].tolist()


def test_our_own_checkpoints_are_not_taken_for_deepspec_ones():
    from dspark.drafters.shipped import shipped_checkpoint

    shipped = shipped_checkpoint("dspark")
    if shipped is None:
        pytest.skip("no shipped checkpoint")
    assert not deepspec_format.is_deepspec_checkpoint(shipped) and checkpoint_algo(shipped) == "dspark"


@pytest.mark.parametrize("name", [DSPARK[0], DFLASH[0], EAGLE3[0]])
def test_greedy_speculative_decoding_with_a_deepspec_drafter_equals_plain_decoding(name):
    """What `dspark serve --drafter <family> --drafter-path DIR` runs: the engine with the loaded
    drafter (its capture layers read from DeepSpec's config) is lossless."""
    from dspark.engine.requests import GenerationRequest
    from dspark.engine.speculative import SpeculativeEngine

    directory = FIXTURES / name
    layers = drafter_capture_layers(FAMILY[name], directory)
    model = runtime_for(directory).model
    prompts = [[5, 17, 3, 99, 42, 7], [200, 1, 64]]

    def generate(drafter_name: str | None):
        runtime = TargetRuntime(model, kv_budget_tokens=1024, capture_layers=layers)
        drafter = None if drafter_name is None else make_drafter(drafter_name, runtime=runtime, path=directory)
        engine = SpeculativeEngine(runtime, drafter)
        requests = [GenerationRequest(f"{drafter_name}-{i}", p, 16, GREEDY) for i, p in enumerate(prompts)]
        return [s.output_ids for s in engine.generate(requests)]

    assert generate(FAMILY[name]) == generate(None)


def test_export_converts_a_deepspec_dspark_checkpoint_into_our_layout(tmp_path):
    """`dspark export` loads through the same translation and writes our own layout, which then
    drafts exactly as the DeepSpec directory did (its config has the options the mapping set)."""
    name = DSPARK[2]  # gated head, confidence on h_k alone: the new options round-trip through our JSON
    directory = FIXTURES / name
    shared = SharedWeights.from_target(runtime_for(directory).model)
    out = export_checkpoint(directory, tmp_path / "ours", storage_dtype="float32", shared=shared)
    assert checkpoint_algo(out) == "dspark" and not deepspec_format.is_deepspec_checkpoint(out)
    ours = load_checkpoint(out, shared=shared).drafter
    assert ours.config.head_type == "gated" and not ours.config.confidence_reads_prev
    exp = expected(name)
    with torch.no_grad():
        got = ours(blocks_at_anchors(exp), target_tokens=exp["draft_tokens"].unsqueeze(1))
    assert max_diff(got.logits[:, 0], exp["draft_logits"]) <= ATOL
    assert max_diff(got.confidence_logits[:, 0], exp["confidence_logits"]) <= ATOL
