"""One device setting (model.device) carries the target to where it runs.

Specification: `resolve_device` turns auto / cpu / cuda / cuda:N into a torch device and refuses
a device torch cannot reach at start-up, with a message; off the CPU the target runs dense
weights, "varlen" attention (one SDPA per layer over the padded batch) and no fused CPU kernels,
and its KV cache, positions, masks and logits live on that device. The `device`-marked tests run
on pytest's --device (scripts/gpu_check.sh passes cuda); without it on the CPU, in the GPU's
modes, so that CI runs the GPU's code path (all but the device itself).
"""

from __future__ import annotations

import pytest
import torch

from dspark.model import target_runtime as tr
from dspark.model.target_runtime import TargetConfig, TargetRuntime, resolve_device
from dspark.serving_config import ModelSection
from tests.conftest import make_runtime_on, make_tiny_runtime

VARLEN_TOLERANCE = 1e-4  # max |logit difference| against the per-row CPU reference, fp32 weights


def test_auto_is_the_cpu_where_torch_sees_no_gpu(monkeypatch):
    monkeypatch.setattr(tr.torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto") == torch.device("cpu")
    assert resolve_device("cpu") == torch.device("cpu")


@pytest.mark.parametrize("name", ["cuda", "cuda:0", "cuda:3"])
def test_a_gpu_that_torch_cannot_reach_is_refused_at_start_up(monkeypatch, name):
    monkeypatch.setattr(tr.torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="sees no CUDA device"):
        resolve_device(name)


@pytest.mark.parametrize("name", ["gpu", "tpu", "cuda:x", ""])
def test_an_unknown_device_name_is_refused_by_the_configuration(name):
    with pytest.raises(ValueError, match="device must be"):
        ModelSection(device=name)
    with pytest.raises(ValueError, match="device must be"):
        TargetConfig(device=name)


def test_the_model_section_reaches_the_target_config_whole():
    section = ModelSection(name="m", dtype="float32", weights="dense", kv_budget_mb=7, max_model_len=99, device="cpu")
    assert TargetConfig.of(section, capture_layers=(1, 2)) == TargetConfig(
        model="m", dtype="float32", weights="dense", kv_budget_mb=7, max_model_len=99, device="cpu", capture_layers=(1, 2))
    assert TargetConfig.of(section, kv_budget_mb=1).kv_budget_mb == 1


def test_auto_dtype_is_bf16_on_a_gpu_and_follows_the_cpu_elsewhere(monkeypatch):
    monkeypatch.setattr(tr, "cpu_has_fast_bf16", lambda: False)
    assert tr.resolve_dtype("auto", "cuda") == "bfloat16"
    assert tr.resolve_dtype("auto", "cpu") == "float32"


def test_off_the_cpu_the_modes_are_the_gpus(device):
    runtime = make_runtime_on(device, compute_dtype=torch.float32)
    assert runtime.model.attention == "varlen" and not runtime.model.fused
    assert runtime.device == torch.device(device) and runtime.kv.device == torch.device(device)
    if torch.device(device).type != "cpu":
        assert "lm_head_packed" not in runtime.model.__dict__  # oneDNN packing is CPU-only


def _mixed_batch(runtime: TargetRuntime) -> torch.Tensor:
    """A prefill (5 tokens), a decode row (context 7) and a verification of 4 rows (context 4) in
    one forward, as a verifier round mixes them; returns the logits [10, vocab] on the CPU."""
    g = torch.Generator().manual_seed(0)
    prompts = {"decode": 7, "verify": 4}
    for rid, n in prompts.items():
        runtime.add_request(rid, 16)
        runtime.forward([rid], torch.randint(0, 256, (n,), generator=g), [n])
    runtime.add_request("prefill", 16)
    tokens = torch.randint(0, 256, (10,), generator=g)
    out = runtime.forward(["prefill", "decode", "verify"], tokens, [5, 1, 4])
    return out.logits.cpu()


@pytest.mark.device
def test_varlen_attention_on_the_device_matches_the_per_row_cpu_reference(device):
    reference = make_tiny_runtime(compute_dtype=torch.float32)
    reference.model.set_attention("per-row")
    reference.model.set_fused(False)
    on_device = make_runtime_on(device, compute_dtype=torch.float32)
    want, got = _mixed_batch(reference), _mixed_batch(on_device)
    assert got.shape == want.shape == (10, 256)
    assert (got - want).abs().max().item() < VARLEN_TOLERANCE
    assert torch.equal(got.argmax(-1), want.argmax(-1))


@pytest.mark.device
def test_a_padding_row_of_the_varlen_layout_cannot_leak_into_a_real_one(device):
    """The same verification rows alone and beside a longer prefill (more padding) agree."""
    alone = make_runtime_on(device, compute_dtype=torch.float32)
    beside = make_runtime_on(device, compute_dtype=torch.float32)
    tokens = torch.arange(3, 9)
    for runtime in (alone, beside):
        runtime.add_request("v", 32)
        runtime.forward(["v"], tokens, [6])
    draft = torch.tensor([11, 12, 13])
    a = alone.forward(["v"], draft, [3]).logits.cpu()
    beside.add_request("long", 32)
    b = beside.forward(["long", "v"], torch.cat([torch.arange(20, 40), draft]), [20, 3]).logits[20:].cpu()
    assert (a - b).abs().max().item() < VARLEN_TOLERANCE


@pytest.mark.device
def test_a_checkpoint_directory_loads_onto_the_device(device, tmp_path):
    """TargetRuntime.load with device=...: the weights, the KV cache and the logits there, and
    the logits those of the CPU's dense fp32 model."""
    transformers = pytest.importorskip("transformers")
    from tests.conftest import random_hf_state_dict

    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                   tie_word_embeddings=True, rms_norm_eps=1e-5)
    hf = transformers.LlamaForCausalLM(cfg)
    from dspark.model.config import ModelConfig
    sd = random_hf_state_dict(ModelConfig.from_hf_dict(cfg.to_dict()), seed=3)
    hf.load_state_dict(sd, strict=False)
    hf.save_pretrained(tmp_path)
    on_device = TargetRuntime.load(TargetConfig(model=str(tmp_path), dtype="float32", weights="dense",
                                                device=str(device), kv_budget_mb=1))
    on_cpu = TargetRuntime.load(TargetConfig(model=str(tmp_path), dtype="float32", weights="dense", device="cpu", kv_budget_mb=1))
    assert on_device.device.type == torch.device(device).type
    assert on_device.model.embed.weight.device.type == torch.device(device).type
    logits = []
    for runtime in (on_device, on_cpu):
        runtime.add_request("a", 16)
        out = runtime.forward(["a"], torch.tensor([1, 5, 9, 2]), [4])
        assert out.logits.device.type == runtime.device.type
        logits.append(out.logits.cpu())
    assert (logits[0] - logits[1]).abs().max().item() < VARLEN_TOLERANCE
