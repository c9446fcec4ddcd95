"""Specification: a Qwen3 target (per-head q/k RMSNorm, head_dim != hidden / heads, RoPE θ = 1e6,
tied or untied LM head), loaded into our Transformer from transformers' weights, decodes greedily
exactly as transformers' own `generate(do_sample=False)` (fp32 on both sides). The forward
comparisons of tests/model/test_transformer.py check logits; this checks the whole plain-decoding
loop (prefill, KV cache, token-by-token steps, argmax) on many tokens.

    python -m pytest tests/model/test_qwen3_target.py -q
"""

from __future__ import annotations

import pytest
import torch

from dspark.model.config import ModelConfig

transformers = pytest.importorskip("transformers")

MAX_NEW = 40


def _qwen3(tied: bool):
    cfg = transformers.Qwen3Config(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, rms_norm_eps=1e-6, rope_theta=1000000.0, max_position_embeddings=512,
        tie_word_embeddings=tied,
    )
    cfg._attn_implementation = "eager"
    return cfg


@pytest.mark.parametrize("tied", [True, False])
def test_greedy_decoding_equals_transformers_generate_in_fp32(tied, hf_state_dict_for, transformer_from):
    from dspark.engine.speculative import GenerationRequest, SpeculativeEngine
    from dspark.model.target_runtime import TargetRuntime
    from dspark.sampling.params import SamplingParams

    hf_config = _qwen3(tied)
    config = ModelConfig.from_hf_dict(hf_config.to_dict())
    assert config.qk_norm and config.head_dim == 32 and config.tie_word_embeddings == tied
    # embed_std 1: peaked next-token distributions, so a greedy near-tie is not what decides the test
    sd = hf_state_dict_for(config, seed=4, embed_std=1.0)
    hf = transformers.Qwen3ForCausalLM(hf_config).eval()
    missing, unexpected = hf.load_state_dict(sd, strict=False)
    assert set(missing) <= {"lm_head.weight"} and not unexpected  # tied: lm_head is the embedding itself
    ours = transformer_from(config, sd, compute_dtype=torch.float32)

    g = torch.Generator().manual_seed(9)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (1, 7, 23)]
    expected = []
    for p in prompts:
        ids = torch.tensor([p])
        with torch.no_grad():
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=MAX_NEW,
                              min_new_tokens=MAX_NEW, eos_token_id=None, pad_token_id=0)
        expected.append(out[0, len(p):].tolist())

    engine = SpeculativeEngine(TargetRuntime(ours, kv_budget_tokens=1024), None)
    greedy = SamplingParams(temperature=0.0)
    states = engine.generate([GenerationRequest(f"q{i}", p, MAX_NEW, greedy) for i, p in enumerate(prompts)])
    got = [s.output_ids for s in states]
    assert all(len(e) == MAX_NEW for e in expected)
    assert got == expected
    assert len({tuple(e) for e in expected}) == len(expected)  # the prompts lead to different continuations
