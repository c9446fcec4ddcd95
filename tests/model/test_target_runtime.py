"""TargetRuntime: validation at the boundary, the forward's outputs (logits rows, captured hidden
states), capture-layer defaults, and (slow) the real default model against transformers."""

from __future__ import annotations

import json

import pytest
import torch

from dspark.model.config import ModelConfig
from dspark.model.target_runtime import TargetConfig, default_capture_layers

# ---- bad input is a ValueError that says what was wrong, and changes nothing ---------------


@pytest.fixture
def runtime_with_request(tiny_runtime):
    """The tiny runtime with request "a" (capacity 16) holding a 4-token prefix."""
    tiny_runtime.add_request("a", 16)
    tiny_runtime.forward(["a"], torch.tensor([1, 2, 3, 4]), [4])
    return tiny_runtime


@pytest.mark.parametrize("bad_token", [256, 10_000, -1])
def test_a_token_id_outside_the_vocabulary_is_rejected(runtime_with_request, bad_token):
    with pytest.raises(ValueError, match=r"token ids must be in \[0, 256\)"):
        runtime_with_request.forward(["a"], torch.tensor([5, bad_token]), [2])
    assert runtime_with_request.context_len("a") == 4


def test_token_count_must_equal_the_sum_of_query_lengths(runtime_with_request):
    with pytest.raises(ValueError, match=r"sum\(query_lens\)=3 entries, got shape \(2,\)"):
        runtime_with_request.forward(["a"], torch.tensor([5, 6]), [3])
    with pytest.raises(ValueError, match="1-D"):
        runtime_with_request.forward(["a"], torch.tensor([[5, 6]]), [2])
    assert runtime_with_request.context_len("a") == 4


def test_one_query_length_per_request_is_required(runtime_with_request):
    with pytest.raises(ValueError, match="1 request ids but 2 query lengths"):
        runtime_with_request.forward(["a"], torch.tensor([5, 6]), [1, 1])


def test_a_query_length_of_zero_is_rejected(runtime_with_request):
    runtime_with_request.add_request("b", 16)
    with pytest.raises(ValueError, match=r"request 'b': query length must be >= 1, got 0"):
        runtime_with_request.forward(["a", "b"], torch.tensor([5]), [1, 0])
    assert runtime_with_request.context_len("a") == 4


def test_a_request_may_appear_only_once_in_a_batch(runtime_with_request):
    with pytest.raises(ValueError, match="only once per forward"):
        runtime_with_request.forward(["a", "a"], torch.tensor([5, 6]), [1, 1])
    assert runtime_with_request.context_len("a") == 4


def test_a_forward_past_the_reserved_kv_capacity_is_rejected_before_writing(runtime_with_request):
    with pytest.raises(ValueError, match=r"request 'a': 4\+13 tokens exceed its reserved KV of 16"):
        runtime_with_request.forward(["a"], torch.arange(13), [13])
    assert runtime_with_request.context_len("a") == 4
    runtime_with_request.forward(["a"], torch.arange(12), [12])  # exactly full is fine
    assert runtime_with_request.context_len("a") == 16


def test_logits_rows_outside_the_batch_are_rejected_before_writing(runtime_with_request):
    with pytest.raises(ValueError, match="logits_indices"):
        runtime_with_request.forward(["a"], torch.tensor([5, 6]), [2], logits_indices=torch.tensor([2]))
    assert runtime_with_request.context_len("a") == 4


def test_token_ids_must_be_integers(runtime_with_request):
    with pytest.raises(ValueError):
        runtime_with_request.forward(["a"], torch.tensor([5.0, 6.0]), [2])


def test_a_request_longer_than_the_context_window_is_rejected(tiny_runtime_factory):
    runtime = tiny_runtime_factory(max_model_len=100)
    assert runtime.max_model_len == 100
    runtime.add_request("fits", 100)
    with pytest.raises(ValueError, match=r"request 'long' needs 101 tokens, the context window is 100"):
        runtime.add_request("long", 101)
    assert not runtime.has_request("long")
    assert runtime.kv.reserved_tokens == 100


def test_max_model_len_is_capped_by_the_models_position_embeddings(tiny_runtime_factory):
    assert tiny_runtime_factory().max_model_len == 512  # ModelConfig.tiny().max_position_embeddings
    assert tiny_runtime_factory(max_model_len=10_000).max_model_len == 512


def test_a_forward_for_an_unknown_request_names_it(tiny_runtime):
    with pytest.raises(KeyError, match="'ghost' has no KV cache"):
        tiny_runtime.forward(["ghost"], torch.tensor([1]), [1])


def test_target_config_rejects_unknown_dtypes_and_empty_budgets():
    with pytest.raises(ValueError, match="dtype must be one of"):
        TargetConfig(dtype="int8")
    with pytest.raises(ValueError, match="kv_budget_mb must be positive, got 0"):
        TargetConfig(kv_budget_mb=0)


def test_capture_layers_outside_the_model_are_rejected(tiny_runtime_factory):
    with pytest.raises(ValueError, match=r"capture layers \[4\] out of range for a 4-layer model"):
        tiny_runtime_factory(capture_layers=(0, 4))


# ---- what a forward returns ---------------------------------------------------------------


def test_logits_are_returned_only_for_the_requested_rows(tiny_runtime):
    tiny_runtime.add_request("a", 16)
    tiny_runtime.add_request("b", 16)
    tokens = torch.tensor([3, 1, 4, 1, 5, 9, 2])
    full = tiny_runtime.forward(["a", "b"], tokens, [4, 3])
    assert full.logits.shape == (7, 256) and full.logits.dtype == torch.float32
    assert full.hidden.shape == (7, 64)
    assert full.captured is None
    assert full.query_start == [0, 4]
    tiny_runtime.truncate("a", 0)
    tiny_runtime.truncate("b", 0)
    rows = torch.tensor([3, 6])  # the last token of each request
    some = tiny_runtime.forward(["a", "b"], tokens, [4, 3], logits_indices=rows)
    assert some.logits.shape == (2, 256)
    torch.testing.assert_close(some.logits, full.logits[rows])


def test_captured_hidden_states_are_the_decoder_layer_outputs_as_in_transformers(
    tiny_runtime_factory, hf_state_dict_for
):
    """Output of decoder layer l == HF hidden_states[l + 1], in the order capture_layers lists them."""
    transformers = pytest.importorskip("transformers")
    capture = (2, 0, 1)
    runtime = tiny_runtime_factory(compute_dtype=torch.float32, capture_layers=capture, seed=4)
    config = runtime.config
    hf_config = transformers.LlamaConfig(
        vocab_size=config.vocab_size, hidden_size=config.hidden_size, intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_layers, num_attention_heads=config.num_heads,
        num_key_value_heads=config.num_kv_heads, head_dim=config.head_dim, rms_norm_eps=config.rms_norm_eps,
        rope_theta=config.rope_theta, max_position_embeddings=config.max_position_embeddings, tie_word_embeddings=True,
    )
    hf = transformers.LlamaForCausalLM(hf_config).eval()
    hf.load_state_dict(hf_state_dict_for(config, seed=4), strict=False)
    tokens = torch.randint(0, config.vocab_size, (9,), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        hf_hidden = hf(tokens[None], output_hidden_states=True).hidden_states  # num_layers + 1 of [1, 9, hidden]

    # prefill 6 tokens, then 3 more from the cache: captured rows follow the flattened batch
    runtime.add_request("a", 16)
    first = runtime.forward(["a"], tokens[:6], [6], capture=True).captured
    second = runtime.forward(["a"], tokens[6:], [3], capture=True).captured
    captured = torch.cat([first, second])
    assert captured.shape == (9, len(capture), config.hidden_size)
    for j, layer in enumerate(capture):
        torch.testing.assert_close(captured[:, j], hf_hidden[layer + 1][0], atol=1e-4, rtol=0)
    assert runtime.forward(["a"], torch.tensor([7]), [1]).captured is None  # capture=False


def test_default_capture_layers_are_used_when_none_are_given(tiny_runtime_factory):
    assert tiny_runtime_factory().capture_layers == default_capture_layers(4) == (0, 1, 2, 3)


@pytest.mark.parametrize(
    "num_layers, expected",
    [(36, (1, 9, 17, 25, 33)), (30, (1, 8, 14, 20, 27)), (8, (1, 2, 3, 4, 5))],
)
def test_default_capture_layers_spread_five_layers_from_the_second_to_the_third_to_last(num_layers, expected):
    assert default_capture_layers(num_layers) == expected


def test_default_capture_layers_are_five_distinct_increasing_layers_from_8_layers_up():
    for num_layers in range(8, 129):
        layers = default_capture_layers(num_layers)
        assert len(layers) == 5 and list(layers) == sorted(set(layers)), (num_layers, layers)
        assert layers[0] == 1 and layers[-1] == num_layers - 3, (num_layers, layers)


@pytest.mark.parametrize("num_layers", [1, 3, 5])
def test_a_model_of_at_most_five_layers_captures_every_layer(num_layers):
    assert default_capture_layers(num_layers) == tuple(range(num_layers))


@pytest.mark.parametrize("num_layers", [6, 7])
def test_default_capture_layers_never_repeat_a_layer(num_layers):
    layers = default_capture_layers(num_layers)
    assert len(set(layers)) == len(layers) == 5


# ---- the real default model (slow) --------------------------------------------------------


@pytest.mark.slow
def test_default_model_prefill_logits_match_transformers_in_fp32(load_real_runtime, real_tokenizer, real_hf_model):
    runtime = load_real_runtime("float32")
    prompt = real_tokenizer.encode_chat([{"role": "user", "content": "Name the planets of the solar system."}])
    with torch.no_grad():
        expected = real_hf_model(torch.tensor([prompt])).logits[0]  # [len(prompt), vocab]
    runtime.add_request("prefill-vs-hf", len(prompt))
    try:
        got = runtime.forward(["prefill-vs-hf"], torch.tensor(prompt), [len(prompt)]).logits
    finally:
        runtime.free_request("prefill-vs-hf")
    torch.testing.assert_close(got, expected, atol=2e-3, rtol=0)
    assert torch.equal(got.argmax(-1), expected.argmax(-1))


CHAT_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three prime numbers and explain why they are prime.",
    "Explain recursion to a child in two sentences.",
]


@pytest.mark.slow
def test_default_model_greedy_decoding_in_fp32_equals_transformers_generate(load_real_runtime, real_tokenizer, real_hf_model):
    """Plain greedy decoding (our engine, no drafter, fp32 linear layers) == HF generate(do_sample=False).

    The bf16 runtime (the serving default) is run on the same prompts and only reported: bf16
    rounding may legitimately flip a near-tie against an fp32 reference."""
    from dspark.engine.speculative import GenerationRequest, SpeculativeEngine
    from dspark.sampling.params import SamplingParams

    max_new, stop = 48, real_tokenizer.eos_token_ids
    prompts = [real_tokenizer.encode_chat([{"role": "user", "content": c}]) for c in CHAT_PROMPTS]
    expected = []
    for p in prompts:
        ids = torch.tensor([p])
        with torch.no_grad():
            out = real_hf_model.generate(
                ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=max_new,
                eos_token_id=sorted(stop), pad_token_id=real_tokenizer.hf.pad_token_id,
            )
        expected.append(out[0, len(p) :].tolist())

    def ours(dtype: str) -> list[list[int]]:
        engine = SpeculativeEngine(load_real_runtime(dtype), None)
        states = engine.generate([
            GenerationRequest(f"hf-greedy-{dtype}-{i}", p, max_new, SamplingParams(temperature=0.0), stop_token_ids=stop)
            for i, p in enumerate(prompts)
        ])
        assert load_real_runtime(dtype).kv.reserved_tokens == 0
        return [s.output_ids for s in states]

    served = ours("auto")  # bf16 where the CPU has it: may drift from fp32 after some tokens
    matches = [b == e for b, e in zip(served, expected)]
    first_diff = [next((i for i, (x, y) in enumerate(zip(b, e)) if x != y), min(len(b), len(e))) for b, e in zip(served, expected)]
    print(f"\nserving-dtype runtime vs HF fp32 greedy: {sum(matches)}/{len(matches)} prompts identical; "
          f"first differing position per prompt: {[None if m else d for m, d in zip(matches, first_diff)]}")

    fp32 = ours("float32")
    for got, want, text in zip(fp32, expected, CHAT_PROMPTS):
        assert got == want, f"{text!r}: ours {real_tokenizer.decode(got)!r} != HF {real_tokenizer.decode(want)!r}"
    assert any(len(e) == max_new for e in expected) and any(e[-1] in stop for e in expected)


def test_auto_dtype_picks_bf16_only_where_the_hardware_multiplies_bf16_natively(monkeypatch):
    from dspark.model import target_runtime as tr

    assert tr.resolve_dtype("float32") == "float32" and tr.resolve_dtype("bfloat16") == "bfloat16"
    monkeypatch.setattr(tr.torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(tr, "cpu_has_fast_bf16", lambda: False)
    assert tr.resolve_dtype("auto") == "float32"
    monkeypatch.setattr(tr, "cpu_has_fast_bf16", lambda: True)
    assert tr.resolve_dtype("auto") == "bfloat16"
    with pytest.raises(ValueError, match="dtype must be one of"):
        tr.TargetConfig(dtype="int8")


def test_target_config_names_the_weight_formats_and_refuses_compact_with_bf16():
    from dspark.model.target_runtime import TargetConfig

    with pytest.raises(ValueError, match="weights must be one of"):
        TargetConfig(weights="int4")
    with pytest.raises(ValueError, match="compact weights compute in float32"):
        TargetConfig(dtype="bfloat16", weights="compact")


def save_tiny_checkpoint(directory, state_dict) -> None:
    """The tiny config's state dict as a Hugging Face checkpoint directory."""
    from safetensors.torch import save_file

    config = ModelConfig.tiny()
    fields = {"model_type": "llama", "vocab_size": config.vocab_size, "hidden_size": config.hidden_size,
              "intermediate_size": config.intermediate_size, "num_hidden_layers": config.num_layers,
              "num_attention_heads": config.num_heads, "num_key_value_heads": config.num_kv_heads,
              "head_dim": config.head_dim, "rms_norm_eps": config.rms_norm_eps, "rope_theta": config.rope_theta,
              "max_position_embeddings": config.max_position_embeddings, "tie_word_embeddings": True}
    directory.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in state_dict.items()}, str(directory / "model.safetensors"))
    (directory / "config.json").write_text(json.dumps(fields))


def test_loading_asks_for_compact_weights_only_where_they_are_exact(tmp_path):
    """weights="compact" on a checkpoint no block format reproduces is an error naming the way
    out; "auto" quietly keeps dense weights there."""
    from dspark.model.target_runtime import TargetConfig, TargetRuntime
    from tests.conftest import compact_exact_state_dict, random_hf_state_dict

    sd = random_hf_state_dict(ModelConfig.tiny(), seed=0)
    for name, weights in (("dense-ckpt", sd), ("gguf-like", compact_exact_state_dict(sd))):
        save_tiny_checkpoint(tmp_path / name, weights)
    with pytest.raises(ValueError, match="weights='dense'"):
        TargetRuntime.load(TargetConfig(model=str(tmp_path / "dense-ckpt"), weights="compact", kv_budget_mb=1))
    assert TargetRuntime.load(TargetConfig(model=str(tmp_path / "dense-ckpt"), dtype="float32", kv_budget_mb=1)).linear_numerics == "float32"
    assert TargetRuntime.load(TargetConfig(model=str(tmp_path / "gguf-like"), kv_budget_mb=1)).linear_numerics == "compact"
    assert TargetRuntime.load(TargetConfig(model=str(tmp_path / "gguf-like"), weights="dense", dtype="float32",
                                           kv_budget_mb=1)).linear_numerics == "float32"


def test_compact_weights_asked_for_where_the_kernel_cannot_be_built_name_the_build_error(tmp_path, monkeypatch):
    """A compiler failure is not a silent fallback when compact weights were asked for: the
    error carries the build's message; "auto" keeps dense weights (and warned at build time)."""
    from dspark.model import compact_weights
    from dspark.model.target_runtime import TargetConfig, TargetRuntime
    from tests.conftest import compact_exact_state_dict, random_hf_state_dict

    save_tiny_checkpoint(tmp_path, compact_exact_state_dict(random_hf_state_dict(ModelConfig.tiny(), seed=0)))
    monkeypatch.setattr(compact_weights, "load", lambda: None)
    monkeypatch.setattr(compact_weights._LIBRARY, "error", "compact_gemm kernels unavailable (g++: not found)")
    with pytest.raises(ValueError, match=r"compact weights unavailable: compact_gemm kernels unavailable \(g\+\+: not found\)"):
        TargetRuntime.load(TargetConfig(model=str(tmp_path), weights="compact", kv_budget_mb=1))
    assert TargetRuntime.load(TargetConfig(model=str(tmp_path), dtype="float32", kv_budget_mb=1)).linear_numerics == "float32"


@pytest.mark.slow
@pytest.mark.parametrize("weights", ["auto", "dense"])
def test_default_model_verifying_a_block_of_40_tokens_gives_the_bits_of_decoding_them_one_by_one(load_real_runtime, weights):
    """Past 32 rows oneDNN switched bf16 kernels when weights were packed for batch 8 (rows
    changed in the last bit): a long verify block, or many requests' blocks together, no
    longer reproduced plain decoding. Also covers the fused layer kernels at real shapes, on
    the compact weights the default model is served with and on the dense ones."""
    real_runtime = load_real_runtime("auto", weights)
    g = torch.Generator().manual_seed(1)
    prompt, block = torch.randint(0, real_runtime.vocab_size, (50,), generator=g), torch.randint(0, real_runtime.vocab_size, (40,), generator=g)
    ids = ["block-step", "block-verify"]
    for rid in ids:
        real_runtime.add_request(rid, 91)
    try:
        for rid in ids:
            real_runtime.forward([rid], prompt, [50], logits_indices=torch.empty(0, dtype=torch.long))
        stepped = torch.cat([real_runtime.forward(["block-step"], block[i : i + 1], [1]).hidden for i in range(40)])
        verified = real_runtime.forward(["block-verify"], block, [40]).hidden
    finally:
        for rid in ids:
            real_runtime.free_request(rid)
    assert torch.equal(stepped, verified)
