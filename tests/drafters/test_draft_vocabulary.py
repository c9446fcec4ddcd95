"""DSpark with a draft vocabulary (FR-Spec): the drafter proposes only N of the target's V tokens.

Specification: the drafter's logits, Markov head and rows cover exactly the N draft tokens (p_d is
zero elsewhere) and its drafts are target ids inside the vocabulary; the verifier still works on
the full target vocabulary, so sampled output keeps exactly the target's distribution (chi-square,
dense and truncated rows) and greedy output equals plain decoding; a sampler that reports rows
other than the ones it sampled from is caught by the same chi-square test; the map survives a
checkpoint round trip; a full-vocabulary drafter's weights carry over onto a draft vocabulary.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from dspark.drafters.base import DraftProposal
from dspark.drafters.dspark.checkpoint import load_checkpoint, save_checkpoint, transfer_weights
from dspark.drafters.dspark.config import DSparkConfig
from dspark.drafters.dspark.model import BlockBatch, DSparkDrafter
from dspark.drafters.dspark.serving import DSparkServingDrafter
from dspark.drafters.shared import SharedWeights
from dspark.engine.speculative import GenerationRequest, SpeculativeEngine
from dspark.sampling.params import SamplingParams
from tests.conftest import SMALL_VOCAB_RUNTIME
from tests.distribution_checks import chi_square_pvalue, exact_sequence_probs
from tests.drafters.conftest import with_random_norms
from tests.drafters.engine_checks import assert_sampling_is_lossless, greedy_plain_and_speculative, totals


def make_drafter(runtime, d2t: list[int] | None, *, seed: int = 0, block_size: int = 2, w2_std: float = 0.5) -> DSparkDrafter:
    torch.manual_seed(seed)
    config = DSparkConfig.from_target(runtime.config, block_size=block_size, markov_rank=8, num_layers=1,
                                      target_layer_ids=runtime.capture_layers,
                                      draft_vocab_size=None if d2t is None else len(d2t))
    model = DSparkDrafter(config, shared=SharedWeights.from_target(runtime.model),
                          draft_to_target=None if d2t is None else torch.tensor(d2t))
    with torch.no_grad():  # a Markov head that actually moves the distribution (it starts at zero)
        model.head.w2.normal_(0.0, w2_std)
    return with_random_norms(model, seed=seed)


@pytest.fixture
def small_runtime(tiny_runtime_factory):
    # 8 tokens: exact sequence probabilities of 3-token continuations are cheap to enumerate
    return tiny_runtime_factory(**SMALL_VOCAB_RUNTIME)


DRAFT_VOCAB = [0, 2, 3, 5, 6]  # 5 of the 8 tokens


def test_drafts_and_rows_stay_inside_the_draft_vocabulary(small_runtime):
    drafter = make_drafter(small_runtime, DRAFT_VOCAB, block_size=3)
    engine = SpeculativeEngine(small_runtime, DSparkServingDrafter(drafter), num_speculative_tokens=3)
    proposals: list[DraftProposal] = []
    serving = engine.drafter
    propose = serving.propose
    serving.propose = lambda reqs: proposals.extend(out := propose(reqs)) or out  # record what the engine verifies
    engine.generate([GenerationRequest(f"r{i}", [1, 4, 7], 8, SamplingParams(temperature=1.0, seed=i)) for i in range(20)])
    assert proposals and sum(len(p) for p in proposals) > 20
    outside = [v for v in range(8) if v not in DRAFT_VOCAB]
    for p in proposals:
        if not len(p):
            continue
        assert set(p.token_ids.tolist()) <= set(DRAFT_VOCAB)
        rows = p.dense(8)  # [num_draft, V]
        assert torch.allclose(rows.sum(-1), torch.ones(len(p)), atol=1e-6)
        assert (rows[:, outside] == 0).all()
        assert (rows[:, DRAFT_VOCAB] > 0).all()  # the full softmax over D (no truncation asked)


@pytest.mark.parametrize(("drafter_top_k", "request_params"), [
    (0, {}), (3, {}), (0, {"temperature": 0.7, "top_k": 4}), (0, {"temperature": 1.5, "top_p": 0.8}),
], ids=["T1-all-draft-tokens", "T1-drafter-top3", "T0.7-request-top4", "T1.5-request-top0.8"])
def test_sampled_tokens_have_exactly_the_target_distribution(small_runtime, drafter_top_k, request_params):
    """Chi-square against the target's own distribution under the request's temperature and
    filters; the drafter truncates its rows by the request's filters too (below)."""
    serving = DSparkServingDrafter(make_drafter(small_runtime, DRAFT_VOCAB, seed=2), top_k=drafter_top_k)
    assert_sampling_is_lossless(small_runtime, serving, num_samples=3000, **request_params)


def test_the_drafter_truncates_its_rows_by_the_requests_top_k_and_top_p(small_runtime):
    from dspark.drafters.base import DraftRequest

    serving = DSparkServingDrafter(make_drafter(small_runtime, DRAFT_VOCAB, seed=2, block_size=3))
    small_runtime.add_request("ctx", 8)
    out = small_runtime.forward(["ctx"], torch.tensor([1, 4, 7, 2]), [4], logits_indices=torch.empty(0, dtype=torch.long),
                                capture=True)
    small_runtime.free_request("ctx")
    serving.observe("r", out.captured[:3])
    widths = {}
    for name, params in {"none": SamplingParams(temperature=1.0), "top_k=2": SamplingParams(temperature=1.0, top_k=2),
                         "top_p=0.3": SamplingParams(temperature=1.0, top_p=0.3)}.items():
        (p,) = serving.propose([DraftRequest("r", [1, 4, 7, 2], 3, params, 3, torch.Generator().manual_seed(0))])
        widths[name] = int((p.dense(8) > 0).sum(-1).max())
    assert widths["none"] == len(DRAFT_VOCAB) and widths["top_k=2"] == 2 and widths["top_p=0.3"] < len(DRAFT_VOCAB)


def test_greedy_output_equals_plain_decoding(tiny_runtime_factory):
    runtime = tiny_runtime_factory(capture_layers=(1, 3))
    d2t = list(range(0, runtime.config.vocab_size, 3))  # a third of the vocabulary
    plain, spec = greedy_plain_and_speculative(runtime, DSparkServingDrafter(make_drafter(runtime, d2t, block_size=4)),
                                               [[5, 6, 7, 8, 9], list(range(40, 70))])
    assert [s.output_ids for s in spec] == [s.output_ids for s in plain]
    drafted, accepted = totals(spec)
    assert drafted > 0 and accepted > 0


class RowsFromTheFullVocabulary(DSparkServingDrafter):
    """A broken sampler: draws from the draft vocabulary but tells the verifier its rows were the
    uniform distribution over it (as a bug that forgets which row a token came from would)."""

    def propose(self, requests):
        out = []
        for p in super().propose(requests):
            if len(p) and p.probs is not None:
                p = DraftProposal(token_ids=p.token_ids, prob_ids=p.prob_ids,
                                  probs=torch.full_like(p.probs, 1.0 / p.probs.shape[1]), confidences=p.confidences)
            out.append(p)
        return out


def test_the_chi_square_check_catches_rows_other_than_the_sampled_ones(small_runtime):
    """The losslessness test is not vacuous with a draft vocabulary: misreported rows fail it."""
    drafter = RowsFromTheFullVocabulary(make_drafter(small_runtime, DRAFT_VOCAB, seed=2, w2_std=3.0))
    prompt, num_tokens, n = [3, 1, 4, 1, 5], 3, 3000
    exact = exact_sequence_probs(small_runtime, prompt, num_tokens)
    states = SpeculativeEngine(small_runtime, drafter, num_speculative_tokens=2).generate(
        [GenerationRequest(f"s{i}", prompt, num_tokens + 1, SamplingParams(temperature=1.0, seed=i)) for i in range(n)])
    samples = Counter(tuple(s.output_ids[:num_tokens]) for s in states)
    assert chi_square_pvalue(samples, exact, n) < 1e-6


def test_teacher_forced_logits_have_one_column_per_draft_token(target):
    d2t = torch.tensor([0, 7, 31, 100, 255])
    cfg = DSparkConfig.tiny(draft_vocab_size=5)
    model = DSparkDrafter(cfg, shared=SharedWeights.from_target(target), draft_to_target=d2t).eval()
    batch = BlockBatch.from_sequences(contexts=[torch.randn(9, 2, cfg.hidden_size)], anchor_positions=[torch.tensor([3, 9])],
                                      anchor_tokens=[torch.tensor([4, 200])])
    out = model(batch, target_tokens=torch.zeros(1, 2, cfg.block_size, dtype=torch.long))
    assert out.logits.shape == (1, 2, cfg.block_size, 5)
    # U restricted to D is the full LM head's U on those columns
    hidden = out.hidden.reshape(-1, cfg.hidden_size)
    assert torch.allclose(model.base_logits(hidden), hidden @ target.lm_head_weight.t()[:, d2t], atol=1e-5)
    assert model.target_to_draft()[d2t].tolist() == [0, 1, 2, 3, 4]
    assert (model.target_to_draft() >= 0).sum() == 5


def test_the_map_survives_a_checkpoint_round_trip(target, tmp_path):
    d2t = torch.tensor([1, 2, 30, 64, 200, 201])
    model = DSparkDrafter(DSparkConfig.tiny(draft_vocab_size=6), shared=SharedWeights.from_target(target), draft_to_target=d2t)
    save_checkpoint(tmp_path, drafter=model, storage_dtype="bfloat16")
    loaded = load_checkpoint(tmp_path, shared=SharedWeights.from_target(target)).drafter
    assert loaded.draft_to_target.dtype == torch.long and torch.equal(loaded.draft_to_target, d2t)


def test_a_full_vocabulary_drafter_carries_over_onto_a_draft_vocabulary(target):
    shared = SharedWeights.from_target(target)
    torch.manual_seed(0)
    full = DSparkDrafter(DSparkConfig.tiny(), shared=shared).eval()
    with torch.no_grad():
        full.head.w2.normal_()
    d2t = torch.tensor([3, 9, 27, 81, 243])
    small = DSparkDrafter(DSparkConfig.tiny(draft_vocab_size=5), shared=shared, draft_to_target=d2t).eval()
    transfer_weights(full, small)
    batch = BlockBatch.from_sequences(contexts=[torch.randn(6, 2, 64)], anchor_positions=[torch.tensor([2, 5])],
                                      anchor_tokens=[torch.tensor([1, 2])])
    tokens = torch.randint(0, 256, (1, 2, 4))
    with torch.no_grad():
        expected = full(batch, target_tokens=tokens).logits[..., d2t]
        got = small(batch, target_tokens=tokens).logits
    assert torch.allclose(got, expected, atol=1e-5)


def test_a_draft_vocabulary_must_be_distinct_target_ids(target):
    cfg = DSparkConfig.tiny(draft_vocab_size=3)
    with pytest.raises(ValueError, match="distinct"):
        DSparkDrafter(cfg, shared=SharedWeights.from_target(target), draft_to_target=torch.tensor([1, 1, 2]))
    with pytest.raises(ValueError, match="in \\[0, 256\\)"):
        DSparkDrafter(cfg, shared=SharedWeights.from_target(target), draft_to_target=torch.tensor([1, 2, 256]))
    with pytest.raises(ValueError, match="draft_vocab_size"):
        DSparkConfig.tiny(draft_vocab_size=257)
