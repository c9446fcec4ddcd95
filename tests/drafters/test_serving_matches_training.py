"""Serving samples from exactly the distribution training fits, for every drafter family.

For the same context and anchor, the rows a serving drafter's `propose()` samples from, after
`observe()` of the target's captured layer outputs of the context positions (one call per
verified stretch, as dspark/engine/speculative.py `_hand_over_features` hands them over), equal
the teacher-forced training forward's distributions: the forward each family's objective
(dspark/drafters/<family>/objective.py) calls in its `loss`, on a batch from
dspark/training/anchors.py `build_batch` (several anchors of a sequence in one row), teacher-forced along the tokens serving actually
drafted, so that block position k > 1 conditions on the same x_1..x_{k-1}. Families: DSpark
(Markov and RNN heads), DFlash, EAGLE-3; each tiny random drafter is saved as training saves it
(the registry's `family(algo).save`) and served as `--drafter ALGO --drafter-path DIR` loads it
(`make_drafter`, whose LM head runs through the target's packed GEMM).

Both sides read the same numbers: the tiny target cache of tests/training/test_target_cache.py
(the tiny random target's captured outputs, rounded once to fp16; what the rounding does is that
file's business), and drafters that share that target's embedding and LM head. What differs is
the code path: serving's per-request caches (DSpark/DFlash: context keys/values projected per
observe(); EAGLE-3: fused features and its own KV cache, caught up round by round), padding of
several requests into one forward, drafting only as far as each request's max_draft_tokens,
the packed LM head.

Tolerance: rows agree to atol 1e-6 + rtol 1e-5 on probabilities, fp32 on both sides. The two
sides run the same fp32 ops on differently shaped tensors (one padded row per sequence holding
several blocks vs one block per request; a context projected in pieces vs at once; cached keys
vs one causal pass; a packed vs a plain LM head GEMM), so logits of magnitude <= 10 differ in
their last bits: measured, <= 6e-7 on a probability and <= 6e-6 on a log-probability (a
probability p moves by about p times its logit's error, hence the relative term), at most 0.15
of the tolerance. Real slips move rows by 1e-3 and more: a context position, RoPE offset or
anchor off by one, the anchor's output read as a draft, a wrong previous token, a frozen RNN
state, a misaligned EAGLE-3 feature, a lost cache entry each fail here (the serving code was
mutated by hand when this file was written). Greedy drafts are compared exactly: the point mass
sits on the teacher-forced argmax (argmax margins here are >= 8e-3, three orders above the
logits' rounding).

The untrained parallel backbones (DSpark, DFlash) would predict their mask token almost surely
(the masks' residual streams start at its embedding, the LM head is tied, and freshly initialised
draft layers add little); their layers' output projections are scaled up so that the rows are
neither point masses nor flat and greedy drafts vary (both asserted), so that equal rows mean
something.

    python -m pytest tests/drafters/test_serving_matches_training.py -q
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from dspark.drafters import make_drafter, registry
from dspark.drafters.base import DraftProposal, DraftRequest
from dspark.drafters.dflash import DFlashDrafter
from dspark.drafters.dspark.model import DSparkDrafter
from dspark.drafters.eagle3 import Eagle3Drafter
from dspark.drafters.shared import SharedWeights
from dspark.sampling.params import SamplingParams
from dspark.training.anchors import TrainBatch, build_batch
from dspark.training.target_cache import TargetCache
from tests.drafters import test_dflash_serving, test_dspark_serving, test_eagle3_serving
from tests.drafters.conftest import with_random_norms
from tests.training.test_target_cache import make_tiny_cache, tiny_runtime

GAMMA = 4  # every family's block_size in the serving tests' make_serving_drafter
RTOL, ATOL = 1e-5, 1e-6  # on probabilities (the module docstring says why)


# ---- the families ---------------------------------------------------------------------------------


def _lively_backbone(model: nn.Module) -> nn.Module:
    """A parallel backbone with random norms and its draft layers' output projections scaled up
    8x, so that the context, not the mask token's embedding, drives the rows."""
    with_random_norms(model, seed=2)
    with torch.no_grad():
        for layer in model.layers:
            layer.o_proj.weight.mul_(8.0)
            layer.down_proj.weight.mul_(8.0)
    return model


def build_dspark_markov(runtime) -> DSparkDrafter:
    return _lively_backbone(test_dspark_serving.make_serving_drafter(runtime, seed=1).model)


def build_dspark_rnn(runtime) -> DSparkDrafter:
    """test_dspark_serving's drafter with the RNN head (docs/method.md §2, RNN head) in place of the Markov head."""
    config = dataclasses.replace(test_dspark_serving.make_serving_drafter(runtime, seed=1).model.config, head_type="rnn")
    torch.manual_seed(1)
    model = DSparkDrafter(config, shared=SharedWeights.from_target(runtime.model))
    with torch.no_grad():  # a head that actually moves the distribution (W2 starts at zero)
        model.head.w2.normal_(0.0, 0.5)
    return _lively_backbone(model)


def build_dflash(runtime) -> DFlashDrafter:
    return _lively_backbone(test_dflash_serving.make_serving_drafter(runtime, seed=1).model)


def build_eagle3(runtime) -> Eagle3Drafter:
    # lively as it is: its residual stream starts at the fused target feature, not at an embedding
    return with_random_norms(test_eagle3_serving.make_serving_drafter(runtime, seed=1).model, seed=2)


def dspark_teacher_forced(model: DSparkDrafter, batch: TrainBatch) -> torch.Tensor:  # as DSparkObjective.loss
    return model.forward_valid(batch.blocks, target_tokens=batch.target_tokens)[0]


def dflash_teacher_forced(model: DFlashDrafter, batch: TrainBatch) -> torch.Tensor:  # as DFlashObjective.loss
    return model(batch.blocks)[batch.blocks.block_valid]


def eagle3_teacher_forced(model: Eagle3Drafter, batch: TrainBatch) -> torch.Tensor:  # as Eagle3Objective.loss
    out = model(batch.blocks, context_token_ids=batch.context_token_ids, target_tokens=batch.target_tokens)
    return out.logits[batch.blocks.block_valid]


@dataclass(frozen=True)
class Family:
    algo: str  # `dspark train --algo` / `--drafter`
    build: Callable  # runtime -> the tiny random drafter model
    # (model, batch) -> logits [valid blocks, γ, V], row-major as batch.blocks.block_valid: the
    # forward the family's objective calls in its `loss` (dspark/drafters/<family>/objective.py)
    teacher_forced: Callable[[nn.Module, TrainBatch], torch.Tensor]
    conditions_on_drafts: bool  # whether row k depends on x_1..x_{k-1} (DFlash's rows do not)


FAMILIES = {
    "dspark-markov": Family("dspark", build_dspark_markov, dspark_teacher_forced, conditions_on_drafts=True),
    "dspark-rnn": Family("dspark", build_dspark_rnn, dspark_teacher_forced, conditions_on_drafts=True),
    "dflash": Family("dflash", build_dflash, dflash_teacher_forced, conditions_on_drafts=False),
    "eagle3": Family("eagle3", build_eagle3, eagle3_teacher_forced, conditions_on_drafts=True),
}


# ---- fixtures and helpers ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> TargetCache:
    """9 random sequences (prompts of 3-8 tokens, responses of 6-29) through the tiny target."""
    return make_tiny_cache(tmp_path_factory.mktemp("cache"))


@pytest.fixture(scope="module")
def runtime():
    """The target the cache was built with (same seed, fp32): the drafters share its embedding / LM head."""
    return tiny_runtime()


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, runtime) -> dict[str, Path]:
    """Every family's tiny drafter saved as training saves it (registry.family(algo).save)."""
    paths = {}
    for name, case in FAMILIES.items():
        paths[name] = tmp_path_factory.mktemp(name)
        registry.family(case.algo).save(paths[name], drafter=case.build(runtime))
    return paths


@pytest.fixture
def served(checkpoints, runtime) -> Callable:
    """`served(name)`: a fresh serving drafter of that family, loaded as `--drafter ALGO
    --drafter-path DIR` loads it (make_drafter: the LM head through the target's packed GEMM)."""
    return lambda name: make_drafter(FAMILIES[name].algo, runtime=runtime, path=checkpoints[name])


@dataclass(frozen=True)
class Block:
    """One draft block: sequence `seq` of the cache, anchor x_0 = its token at position `anchor`."""

    seq: int
    anchor: int
    max_draft_tokens: int = GAMMA


def blocks_of(cache: TargetCache, seqs: list[int]) -> list[Block]:
    """Per sequence, in order: the first anchor after the prefill (the prompt's length), one
    mid-response and the last one training samples (length - 2); the second block drafts only 2."""
    blocks = []
    for i in seqs:
        s = cache.sequences[i]
        for t in sorted({s.prompt_len, (s.prompt_len + s.length) // 2, s.length - 2}):
            blocks.append(Block(i, t, 2 if len(blocks) == 1 else GAMMA))
    return blocks


def request(cache: TargetCache, block: Block, request_id: str, *, temperature: float, seed: int) -> DraftRequest:
    return DraftRequest(request_id, cache.tokens(block.seq)[: block.anchor + 1].tolist(), cache.sequences[block.seq].prompt_len,
                        SamplingParams(temperature=temperature), block.max_draft_tokens, torch.Generator().manual_seed(seed))


def serve_in_one_call(drafter, cache: TargetCache, blocks: list[Block], *, temperature: float) -> list[DraftProposal]:
    """Each block as its own request whose prefill handed over the features of positions
    0..anchor-1 (one observe), all of them drafted in ONE propose() call."""
    reqs = []
    for r, b in enumerate(blocks):
        drafter.observe(f"r{r}", cache.captured(b.seq, stop=b.anchor))  # [anchor, m, hidden] fp16, as cached
        reqs.append(request(cache, b, f"r{r}", temperature=temperature, seed=r))
    proposals = drafter.propose(reqs)
    assert [len(p) for p in proposals] == [b.max_draft_tokens for b in blocks]
    return proposals


def training_forward(forward: Callable, model: nn.Module, cache: TargetCache, blocks: list[Block],
                     drafts: list[list[int]]) -> list[torch.Tensor]:
    """Per block, `forward`'s output [len(drafts[i]), ...] (a family's `teacher_forced`: logits
    [len(drafts[i]), V]) on ONE build_batch batch of all the blocks (one row per sequence holding
    that sequence's anchors), teacher-forced along `drafts`: x*_k = the k-th drafted token (0 past
    a block's drafts, which no earlier row reads)."""
    seqs = list(dict.fromkeys(b.seq for b in blocks))
    anchors = [[b.anchor for b in blocks if b.seq == i] for i in seqs]
    batch = build_batch(cache, seqs, [np.array(a) for a in anchors], block_size=GAMMA)
    target_tokens = torch.zeros_like(batch.target_tokens)  # [rows, nb, γ]
    valid_rank = torch.cumsum(batch.blocks.block_valid.flatten(), 0).view_as(batch.blocks.block_valid) - 1  # [rows, nb]
    ranks = []  # each block's index among the valid blocks (row-major), i.e. in the forward's output
    for b, d in zip(blocks, drafts):
        row = seqs.index(b.seq)
        col = anchors[row].index(b.anchor)
        target_tokens[row, col, : len(d)] = torch.tensor(d, dtype=torch.long)
        ranks.append(int(valid_rank[row, col]))
    with torch.no_grad():
        out = forward(model, dataclasses.replace(batch, target_tokens=target_tokens))  # [n, γ, ...]
    return [out[n, : len(d)] for n, d in zip(ranks, drafts)]


def assert_lively(rows: torch.Tensor) -> None:
    # rows: [n, V] probabilities; neither (nearly) point masses nor flat, so that equal rows mean something
    median_top = float(rows.max(dim=-1).values.median())
    assert 0.02 < median_top < 0.9, median_top


# ---- the specification ------------------------------------------------------------------------------


@pytest.mark.parametrize("name", FAMILIES)
def test_sampled_rows_are_the_softmax_of_the_teacher_forced_training_logits(name, cache, served):
    """Temperature 1, dense rows: 3 sequences (contexts of 3 to 27 positions), 3 anchors each,
    9 requests in one propose() call (one drafting 2, the others γ = 4)."""
    family = FAMILIES[name]
    drafter = served(name)
    blocks = blocks_of(cache, [0, 1, 4])
    proposals = serve_in_one_call(drafter, cache, blocks, temperature=1.0)
    drafts = [p.token_ids.tolist() for p in proposals]
    expected = training_forward(family.teacher_forced, drafter.model, cache, blocks, drafts)
    for block, proposal, logits in zip(blocks, proposals, expected):
        assert proposal.dense_probs is not None, block
        torch.testing.assert_close(proposal.dense_probs, torch.softmax(logits, dim=-1), rtol=RTOL, atol=ATOL,
                                   msg=lambda m, block=block: f"{block}: {m}")
    assert_lively(torch.cat([p.dense_probs for p in proposals]))
    if family.conditions_on_drafts:  # not vacuous: teacher forcing along other tokens moves the rows past k = 1
        own = [cache.tokens(b.seq)[b.anchor + 1 : b.anchor + 1 + len(d)].tolist() for b, d in zip(blocks, drafts)]
        own = [o + [0] * (len(d) - len(o)) for o, d in zip(own, drafts)]  # 0 past the sequence's end
        along_own = training_forward(family.teacher_forced, drafter.model, cache, blocks, own)
        moved = [float((p.dense_probs[1:] - torch.softmax(o[1:], dim=-1)).abs().max())
                 for p, o, d, w in zip(proposals, along_own, drafts, own) if d[:-1] != w[:-1]]
        assert moved and min(moved) > 1e3 * ATOL, moved


@pytest.mark.parametrize("name", FAMILIES)
def test_greedy_drafts_are_the_argmax_of_the_teacher_forced_training_logits(name, cache, served):
    """Temperature 0: each draft is a point mass on the argmax of the training forward's logits,
    teacher-forced along the greedy drafts themselves (token ids equal exactly)."""
    family = FAMILIES[name]
    drafter = served(name)
    blocks = blocks_of(cache, [0, 1, 4])
    proposals = serve_in_one_call(drafter, cache, blocks, temperature=0.0)
    drafts = [p.token_ids.tolist() for p in proposals]
    expected = training_forward(family.teacher_forced, drafter.model, cache, blocks, drafts)
    for block, proposal, d, logits in zip(blocks, proposals, drafts, expected):
        assert proposal.prob_ids.tolist() == [[x] for x in d] and proposal.probs.tolist() == [[1.0]] * len(d), block
        assert d == logits.argmax(dim=-1).tolist(), block
    assert len({x for d in drafts for x in d}) > 3  # not one token drafted everywhere


@pytest.mark.parametrize("name", ["dspark-markov", "dspark-rnn"])
def test_dspark_confidences_are_the_sigmoid_of_the_teacher_forced_confidence_logits(name, cache, served):
    """The scheduler's input (uncalibrated here: no STS temperatures): c_k = σ(confidence logit)
    of the training forward teacher-forced along the drafts, for every request of the batch."""
    drafter = served(name)
    blocks = blocks_of(cache, [0, 1, 4])
    proposals = serve_in_one_call(drafter, cache, blocks, temperature=1.0)
    drafts = [p.token_ids.tolist() for p in proposals]

    def confidence_logits(model: DSparkDrafter, batch: TrainBatch) -> torch.Tensor:  # [n, γ] as DSparkObjective.loss
        return model.forward_valid(batch.blocks, target_tokens=batch.target_tokens)[1]

    expected = training_forward(confidence_logits, drafter.model, cache, blocks, drafts)  # per block [k]
    for block, proposal, logits in zip(blocks, proposals, expected):
        torch.testing.assert_close(proposal.confidences, torch.sigmoid(logits), rtol=RTOL, atol=ATOL,
                                   msg=lambda m, block=block: f"{block}: {m}")


# Tokens accepted in each round of two requests (of sequences 0 and 2): after the prefill (the
# prompt's features), a round at anchor t that accepted a drafts hands over the features of t..t+a.
ACCEPTED = {0: (0, 2, 4, 1), 2: (4, 0, 3, 3)}


@pytest.mark.parametrize("name", FAMILIES)
def test_features_observed_round_by_round_give_the_rows_of_one_prefill(name, cache, served):
    """Two requests go through 5 rounds together, their features handed over as the engine does
    (the prompt, then each round's anchor and accepted drafts); in every round the rows of both
    equal those of a fresh drafter given all of the context in one observe() (same seeds: the
    same drafts), and those of the teacher-forced training forward. Temperature 1, dense rows."""
    family = FAMILIES[name]
    rounds = served(name)
    anchor = {i: cache.sequences[i].prompt_len for i in ACCEPTED}
    for i in ACCEPTED:
        rounds.observe(f"s{i}", cache.captured(i, stop=anchor[i]))  # the prefill: the prompt's positions
    for step in range(len(ACCEPTED[0]) + 1):
        blocks = [Block(i, anchor[i]) for i in ACCEPTED]
        proposals = rounds.propose([request(cache, b, f"s{b.seq}", temperature=1.0, seed=10 * step + b.seq) for b in blocks])

        prefill = served(name)  # the same weights, all of the context in one observe()
        for b in blocks:
            prefill.observe(f"s{b.seq}", cache.captured(b.seq, stop=b.anchor))
        fresh = prefill.propose([request(cache, b, f"s{b.seq}", temperature=1.0, seed=10 * step + b.seq) for b in blocks])
        drafts = [p.token_ids.tolist() for p in proposals]
        expected = training_forward(family.teacher_forced, rounds.model, cache, blocks, drafts)
        for b, p, f, logits in zip(blocks, proposals, fresh, expected):
            assert p.token_ids.tolist() == f.token_ids.tolist(), (step, b)
            torch.testing.assert_close(p.dense_probs, f.dense_probs, rtol=RTOL, atol=ATOL)
            torch.testing.assert_close(p.dense_probs, torch.softmax(logits, dim=-1), rtol=RTOL, atol=ATOL)
        if step < len(ACCEPTED[0]):  # verified this round: the anchor and the accepted drafts
            for i, accepted in ACCEPTED.items():
                rounds.observe(f"s{i}", cache.captured(i, stop=anchor[i] + accepted[step] + 1)[anchor[i] :])
                anchor[i] += accepted[step] + 1
