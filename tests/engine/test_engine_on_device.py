"""The speculative engine with its target on a device (pytest --device; scripts/gpu_check.sh).

Specification: with the target's forward, KV cache, logits and rejection sampler on the device
(the Triton kernel on CUDA, chosen by `auto`; the torch reference elsewhere) and the engine's
request table on the host, speculative decoding stays lossless:
- greedy: token for token plain decoding's output. The device's attention ("varlen", one SDPA
  over the padded batch) is not batch-invariant, so on a GPU a verification row can round
  differently from the decode row it replaces; with fp32 weights such differences are ~1e-6 of a
  logit, and the test checks first that the reference output has no near-tie (top-2 margin
  under NEAR_TIE) where that could flip a token, so an inequality is a real bug;
- sampled: the joint distribution of the first tokens is the target's (chi-square, as in
  tests/engine/test_speculative_engine.py), at temperature 1 and at 0.7 with top-k and top-p.
Without --device these run on the CPU in the GPU's modes (tests/conftest.py make_runtime_on).
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from dspark.drafters.ngram import NgramDrafter
from dspark.engine.speculative import GenerationRequest, SpeculativeEngine
from dspark.sampling.params import SamplingParams
from tests.conftest import make_runtime_on
from tests.distribution_checks import P_PASS, exact_sequence_probs, losslessness_pvalue
from tests.engine.test_speculative_engine import PROMPTS, FixedDistributionDrafter, _generate, _totals

pytestmark = pytest.mark.device

NEAR_TIE = 1e-3  # a top-2 logit margin below this could flip under a 1e-6 rounding difference


def _min_margin(runtime, prompt: list[int], output: list[int]) -> float:
    """The smallest top-2 logit margin over the positions that chose `output` (teacher-forced)."""
    rid = "__margin"
    runtime.add_request(rid, len(prompt) + len(output) + 1)
    try:
        tokens = torch.tensor(prompt + output)
        logits = runtime.forward([rid], tokens, [len(tokens)]).logits[len(prompt) - 1 : -1]  # [len(output), vocab]
    finally:
        runtime.free_request(rid)
    top2 = logits.float().topk(2, dim=-1).values  # [len(output), 2]
    return float((top2[:, 0] - top2[:, 1]).min())


def test_greedy_speculative_decoding_on_the_device_equals_plain_decoding(device):
    runtime = make_runtime_on(device, compute_dtype=torch.float32)
    plain = [_generate(runtime, None, [p], max_new_tokens=32)[0].output_ids for p in PROMPTS]
    for prompt, out in zip(PROMPTS, plain):
        assert _min_margin(runtime, prompt, out) > NEAR_TIE  # no near-tie: any difference below is a bug
    states = _generate(runtime, NgramDrafter(), PROMPTS, max_new_tokens=32, gamma=5)
    assert [s.output_ids for s in states] == plain
    drafted, accepted = _totals(states)
    assert accepted > 0 and drafted > accepted  # drafts were accepted, and some rejected


def test_the_sampler_runs_beside_the_logits():
    """`auto` takes the Triton kernel exactly when the logits are on CUDA."""
    engine_device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    runtime = make_runtime_on(engine_device, compute_dtype=torch.float32)
    engine = SpeculativeEngine(runtime, None, num_speculative_tokens=2)
    assert engine.sampler_backend == ("triton" if engine_device.type == "cuda" else "torch")


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.7, top_k=6, top_p=0.9),
], ids=["t1", "t0.7-topk6-topp0.9"])
def test_sampled_tokens_on_the_device_have_exactly_the_target_distribution(device, params):
    """A vocab-8 target on the device, drafts iid from a fixed p_d far from it (leaving two
    tokens out): the first three tokens' joint distribution is the target's (chi-square)."""
    runtime = make_runtime_on(device, vocab_size=8, num_layers=1, embed_std=0.12, compute_dtype=torch.float32, seed=11)
    prompt, num_samples, num_tokens = [3, 1, 4, 1, 5], 3000, 3
    exact = exact_sequence_probs(runtime, prompt, num_tokens, temperature=params.temperature,
                                 top_k=params.top_k, top_p=params.top_p)
    p_d = torch.softmax(1.5 * torch.randn(6, generator=torch.Generator().manual_seed(3)), 0)
    drafter = FixedDistributionDrafter([0, 2, 3, 5, 6, 7], p_d, seed=5)
    engine = SpeculativeEngine(runtime, drafter, num_speculative_tokens=2)
    states = engine.generate([
        GenerationRequest(f"s{i}", prompt, num_tokens + 1, SamplingParams(
            temperature=params.temperature, top_k=params.top_k, top_p=params.top_p, seed=i))
        for i in range(num_samples)
    ])
    drafted, accepted = _totals(states)
    assert drafted >= 2 * num_samples and 0.05 * drafted < accepted < 0.95 * drafted
    samples = Counter(tuple(s.output_ids[:num_tokens]) for s in states)
    assert losslessness_pvalue(samples, exact, num_samples) > P_PASS
