"""The DSpark drafter inside the speculative engine (tiny random target and drafter).

Specification: greedy output equals plain decoding whatever the drafter's quality; sampled output
has exactly the target's distribution with dense and with truncated (sparse) draft rows; the
drafter's context-feature cache always covers exactly the verified positions; a seeded request
is reproducible; the drafter must read the layers the runtime captures.
"""

from __future__ import annotations

import pytest
import torch

from dspark.drafters.dspark.config import DSparkConfig
from dspark.drafters.dspark.model import DSparkDrafter
from dspark.drafters.dspark.serving import DSparkServingDrafter
from dspark.drafters.shared import SharedWeights
from dspark.engine.speculative import GenerationRequest, SpeculativeEngine
from dspark.sampling.params import SamplingParams
from tests.conftest import SMALL_VOCAB_RUNTIME, make_runtime_on
from tests.drafters.engine_checks import (
    GREEDY,
    assert_sampling_is_lossless,
    greedy_plain_and_speculative,
    steps_of_one_request,
    totals,
)


def make_serving_drafter(runtime, *, seed: int = 0, top_k: int = 0, block_size: int = 4) -> DSparkServingDrafter:
    torch.manual_seed(seed)
    config = DSparkConfig.from_target(
        runtime.config, block_size=block_size, markov_rank=8, num_layers=1, target_layer_ids=runtime.capture_layers
    )
    model = DSparkDrafter(config, shared=SharedWeights.from_target(runtime.model))
    with torch.no_grad():  # a Markov head that actually moves the distribution (it starts at zero)
        model.head.w2.normal_(0.0, 0.5)
    return DSparkServingDrafter(model.to(runtime.device), top_k=top_k)  # beside the target's shared weights


def test_greedy_output_with_the_dspark_drafter_equals_plain_decoding(tiny_runtime_factory):
    runtime = tiny_runtime_factory(capture_layers=(1, 3))
    plain, spec = greedy_plain_and_speculative(
        runtime, make_serving_drafter(runtime), [[5, 6, 7, 8, 9], [1, 2, 3, 1, 2, 3, 1, 2], list(range(40, 70))])
    assert [s.output_ids for s in spec] == [s.output_ids for s in plain]
    drafted, accepted = totals(spec)
    assert drafted > 0 and accepted > 0  # the drafter really proposed tokens, and some were accepted
    assert runtime.kv.reserved_tokens == 0


def test_the_context_cache_covers_exactly_the_verified_positions(tiny_runtime_factory):
    runtime = tiny_runtime_factory(capture_layers=(1, 3))
    drafter = make_serving_drafter(runtime)
    for state in steps_of_one_request(runtime, drafter):
        # KV holds prompt + output[:-1]; the drafter must hold features of the same positions
        assert drafter.context_len("a") == runtime.context_len("a") == len(state.all_token_ids) - 1
    assert drafter.context_len("a") == 0  # aborted: its cache is freed


@pytest.mark.parametrize("top_k", [0, 3], ids=["dense-rows", "sparse-top3-rows"])
def test_sampled_tokens_have_exactly_the_target_distribution(tiny_runtime_factory, top_k):
    runtime = tiny_runtime_factory(**SMALL_VOCAB_RUNTIME)
    assert_sampling_is_lossless(runtime, make_serving_drafter(runtime, seed=2, top_k=top_k, block_size=2), num_samples=3000)


def test_a_seeded_request_is_reproducible_alone_or_in_a_batch(tiny_runtime_factory):
    runtime = tiny_runtime_factory(capture_layers=(1, 3), compute_dtype=torch.float32)
    drafter = make_serving_drafter(runtime)
    params = SamplingParams(temperature=1.0, seed=42)
    alone = SpeculativeEngine(runtime, drafter, num_speculative_tokens=4).generate(
        [GenerationRequest("x", [5, 6, 7], 20, params)])[0].output_ids
    again = SpeculativeEngine(runtime, drafter, num_speculative_tokens=4).generate(
        [GenerationRequest("x", [5, 6, 7], 20, params)])[0].output_ids
    assert alone == again


def test_the_drafter_must_read_the_layers_the_runtime_captures(tiny_runtime_factory):
    runtime = tiny_runtime_factory(capture_layers=(1, 3))
    drafter = make_serving_drafter(tiny_runtime_factory(capture_layers=(0, 2)))
    with pytest.raises(ValueError, match="capture_layers"):
        SpeculativeEngine(runtime, drafter)


def test_cached_context_keys_values_give_the_same_drafts_as_recomputing_the_context(tiny_runtime_factory):
    """observe() projects each verified position once; a full encode over the raw features must
    give the same backbone output (up to fp32 rounding) and, greedily, the same draft tokens."""
    from dspark.drafters.base import DraftRequest
    from dspark.drafters.dspark.model import BlockBatch, DraftBlock

    runtime = tiny_runtime_factory(capture_layers=(1, 3), compute_dtype=torch.float32)
    drafter = make_serving_drafter(runtime, seed=3)
    gen = torch.Generator().manual_seed(0)
    features = {rid: torch.randn(n, 2, runtime.config.hidden_size, generator=gen) for rid, n in [("a", 9), ("b", 14)]}
    for rid, f in features.items():  # in uneven pieces, as rounds verify different numbers of tokens
        for lo, hi in [(0, 5), (5, 6), (6, len(f))]:
            drafter.observe(rid, f[lo:hi])
    tokens = {rid: list(range(3, 3 + len(f) + 1)) for rid, f in features.items()}  # anchor at position len(f)
    reqs = [DraftRequest(rid, tokens[rid], 2, GREEDY, 4, torch.Generator()) for rid in features]
    proposals = drafter.propose(reqs)

    for req, proposal in zip(reqs, proposals):
        f = features[req.request_id]
        block = DraftBlock(context=f, anchor_position=len(f), anchor_token=req.token_ids[-1])
        full = drafter.model.encode(BlockBatch.from_blocks([block]))[:, 0]  # [1, γ, hidden]
        cached = drafter.model.encode_with_context_kv(
            anchor_positions=torch.tensor([[len(f)]]), anchor_tokens=torch.tensor([[req.token_ids[-1]]]),
            context_kv=drafter._batched_context_kv([req.request_id], [len(f)]),
        )[:, 0]
        torch.testing.assert_close(cached, full, rtol=1e-5, atol=1e-5)
        expected = drafter.model.draft(BlockBatch.from_blocks([block]), temperature=0.0).tokens[0]  # [γ]
        assert proposal.token_ids.tolist() == expected.tolist()  # the padded two-request batch drafts the same


def test_a_requests_draft_does_not_depend_on_how_far_its_neighbours_draft(tiny_runtime_factory):
    """The heads run only as far as a request drafts (k), so a seeded request's tokens, rows and
    generator state are the same next to a neighbour drafting γ as alone."""
    from dspark.drafters.base import DraftRequest

    runtime = tiny_runtime_factory(capture_layers=(1, 3), compute_dtype=torch.float32)
    drafter = make_serving_drafter(runtime, seed=4)
    gen = torch.Generator().manual_seed(1)
    for rid in ("a", "b"):
        drafter.observe(rid, torch.randn(9, 2, runtime.config.hidden_size, generator=gen))
    tokens = list(range(3, 13))  # anchor at position 9
    params = SamplingParams(temperature=1.0)

    def draft_a(with_neighbour: bool):
        g = torch.Generator().manual_seed(7)
        reqs = [DraftRequest("a", tokens, 2, params, 2, g)]
        if with_neighbour:
            reqs.append(DraftRequest("b", tokens, 2, params, 4, torch.Generator().manual_seed(8)))
        return drafter.propose(reqs)[0], torch.rand(1, generator=g)

    (alone, next_alone), (batched, next_batched) = draft_a(False), draft_a(True)
    assert len(alone) == len(batched) == 2 and alone.confidences.shape == (2,)
    assert torch.equal(alone.token_ids, batched.token_ids)
    torch.testing.assert_close(alone.dense_probs, batched.dense_probs, rtol=1e-5, atol=1e-6)
    assert torch.equal(next_alone, next_batched)  # the same number of uniforms was drawn


@pytest.mark.parametrize("params", [GREEDY, SamplingParams(temperature=0.8), SamplingParams(temperature=1.0, top_k=5)],
                         ids=["greedy", "T=0.8", "T=1-top-k"])
def test_requests_drafted_in_one_batch_get_what_each_gets_alone(tiny_runtime_factory, params):
    """The sequential head runs once for every request that samples alike (serving.py groups
    them), each with its own generator and draft count: tokens and generator state are exactly
    those of the request drafted alone, rows and confidences equal to fp32 rounding (the
    backbone pads the batch's contexts to the longest, which moves attention's last bits; as in
    test_a_requests_draft_does_not_depend_on_how_far_its_neighbours_draft)."""
    from dspark.drafters.base import DraftRequest

    runtime = tiny_runtime_factory(capture_layers=(1, 3), compute_dtype=torch.float32)
    drafter = make_serving_drafter(runtime, seed=5)
    gen = torch.Generator().manual_seed(2)
    lengths = {"a": 9, "b": 14, "c": 5, "d": 11}
    counts = {"a": 4, "b": 2, "c": 3, "d": 4}
    for rid, n in lengths.items():
        drafter.observe(rid, torch.randn(n, 2, runtime.config.hidden_size, generator=gen))

    def request(rid: str, seed: int) -> DraftRequest:
        tokens = [(3 * i + seed) % runtime.vocab_size for i in range(lengths[rid] + 1)]  # anchor at position lengths[rid]
        return DraftRequest(rid, tokens, 2, params, counts[rid], torch.Generator().manual_seed(seed))

    seeds = {rid: 10 + i for i, rid in enumerate(lengths)}
    alone = {rid: (drafter.propose([r := request(rid, seeds[rid])])[0], torch.rand(1, generator=r.generator)) for rid in lengths}
    batch = [request(rid, seeds[rid]) for rid in lengths]
    together = dict(zip(lengths, drafter.propose(batch)))
    for req in batch:
        rid = req.request_id
        (single, next_uniform), batched = alone[rid], together[rid]
        assert len(batched) == counts[rid]
        assert torch.equal(single.token_ids, batched.token_ids), rid
        torch.testing.assert_close(single.confidences, batched.confidences, rtol=1e-5, atol=1e-6)
        for field in ("dense_probs", "prob_ids", "probs"):
            a, b = getattr(single, field), getattr(batched, field)
            assert (a is None) == (b is None), (rid, field)
            if a is not None:
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        assert torch.equal(torch.rand(1, generator=req.generator), next_uniform), rid  # the same uniforms were drawn


@pytest.mark.device
def test_on_the_device_greedy_output_equals_plain_decoding(device):
    """Target and drafter on the device (pytest --device; the GPU's modes on the CPU otherwise),
    fp32 weights: the engine still emits plain decoding's tokens, with drafts accepted."""
    runtime = make_runtime_on(device, capture_layers=(1, 3), compute_dtype=torch.float32)
    drafter = make_serving_drafter(runtime)
    assert drafter.device == runtime.device
    plain, spec = greedy_plain_and_speculative(runtime, drafter, [[5, 6, 7, 8, 9], [1, 2, 3, 1, 2, 3, 1, 2], list(range(40, 70))])
    assert [s.output_ids for s in spec] == [s.output_ids for s in plain]
    drafted, accepted = totals(spec)
    assert drafted > 0 and accepted > 0


@pytest.mark.device
@pytest.mark.parametrize("top_k", [0, 3], ids=["dense-rows", "sparse-top3-rows"])
def test_on_the_device_sampled_tokens_have_exactly_the_target_distribution(device, top_k):
    runtime = make_runtime_on(device, **SMALL_VOCAB_RUNTIME)
    assert_sampling_is_lossless(runtime, make_serving_drafter(runtime, seed=2, top_k=top_k, block_size=2), num_samples=3000)
