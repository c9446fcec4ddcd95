"""The draft vocabulary in training (draft_vocab.py, losses.py, trainer.py) and the greedy diagnostics.

Specification: the draft vocabulary is the N most frequent response tokens of the train split;
the DSpark loss over the N draft columns (plus the target's mass outside them) equals, in value
and gradient, the full-vocabulary loss of a drafter whose logits are -inf outside the vocabulary;
labels outside the vocabulary leave L_ce; training with a draft vocabulary (from scratch or from a
full-vocabulary checkpoint) lowers the loss and writes a checkpoint that keeps its map; the greedy
acceptance counts leading argmax matches.
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
import torch

from dspark.drafters.dspark import load_checkpoint
from dspark.drafters.shared import SharedWeights
from dspark.training.draft_vocab import coverage, frequent_tokens
from dspark.training.losses import dspark_loss, greedy_acceptance
from dspark.training.trainer import read_metrics
from tests.training.test_trainer import cache, run, target, tiny_config  # noqa: F401  (fixtures)


def test_the_draft_vocabulary_is_the_most_frequent_response_tokens(cache):  # noqa: F811
    counts = Counter()
    for i in cache.indices("train"):
        s = cache.sequences[i]
        counts.update(cache.tokens(i)[s.prompt_len :].tolist())
    d2t = frequent_tokens(cache, size=10)
    assert d2t.tolist() == sorted(d2t.tolist()) and len(set(d2t.tolist())) == 10
    threshold = min(counts[t] for t in d2t.tolist())
    assert all(counts[t] <= threshold for t in counts if t not in set(d2t.tolist()))
    with pytest.raises(ValueError, match="draft vocabulary size"):
        frequent_tokens(cache, size=0)


def test_coverage_of_the_whole_vocabulary_is_everything(cache, target):  # noqa: F811
    full = coverage(cache, torch.arange(cache.vocab_size), target.lm_head_weight, split="all")
    assert full.token_share == 1.0 and full.argmax_share == 1.0 and abs(full.target_mass - 1.0) < 1e-5
    part = coverage(cache, frequent_tokens(cache, size=16), target.lm_head_weight, split="all")
    assert 0 < part.target_mass < 1 and 0 < part.token_share < 1


def test_the_loss_over_the_draft_columns_equals_the_full_loss_with_minus_infinity_outside():
    torch.manual_seed(0)
    n, gamma, V = 6, 3, 40
    d2t = torch.tensor([0, 3, 4, 9, 17, 22, 31, 39])
    p_t = torch.softmax(torch.randn(n, gamma, V) * 2, dim=-1)
    labels = d2t[torch.randint(0, len(d2t), (n, gamma))]  # labels inside D: L_ce is finite in both forms
    conf = torch.randn(n, gamma)
    mask = torch.rand(n, gamma) > 0.2
    small = torch.randn(n, gamma, len(d2t), requires_grad=True)
    full = torch.full((n, gamma, V), -1e30)
    full[..., d2t] = small.detach()
    full.requires_grad_(True)
    t2d = torch.full((V,), -1, dtype=torch.long)
    t2d[d2t] = torch.arange(len(d2t))
    ref = dspark_loss(draft_logits=full, target_ids=labels, target_probs=p_t, confidence_logits=conf, mask=mask)
    got = dspark_loss(draft_logits=small, target_ids=t2d[labels], target_probs=p_t[..., d2t],
                      outside_mass=1 - p_t[..., d2t].sum(-1), confidence_logits=conf, mask=mask)
    for name in ("total", "ce", "tv", "conf", "c_star"):
        assert torch.allclose(getattr(got, name), getattr(ref, name), atol=1e-5), name
    got.total.backward()
    ref.total.backward()
    assert torch.allclose(small.grad, full.grad[..., d2t], atol=1e-6)


def test_labels_outside_the_draft_vocabulary_leave_the_cross_entropy():
    torch.manual_seed(1)
    logits = torch.randn(4, 2, 5, requires_grad=True)
    p_t = torch.softmax(torch.randn(4, 2, 5), dim=-1) * 0.9  # 10% of the target's mass lies outside
    ids = torch.tensor([[0, 1], [2, -1], [-1, -1], [4, 3]])
    loss = dspark_loss(draft_logits=logits, target_ids=ids, target_probs=p_t, outside_mass=torch.full((4, 2), 0.1),
                       confidence_logits=torch.zeros(4, 2))
    inside = ids >= 0
    keep = dspark_loss(draft_logits=logits[inside].view(1, -1, 5), target_ids=ids[inside].view(1, -1),
                       target_probs=p_t[inside].view(1, -1, 5), confidence_logits=torch.zeros(1, int(inside.sum())))
    weights = torch.exp(-torch.arange(2.0) / 4.0)
    nll = -torch.log_softmax(logits, -1).gather(-1, ids.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    expected_ce = (nll * weights * inside).sum() / (weights * inside).sum()
    assert torch.allclose(loss.ce, expected_ce, atol=1e-6)
    assert torch.isfinite(loss.total) and keep.ce > 0
    assert (loss.c_star <= 0.95 + 1e-6).all()  # 1 - ½ (Σ_D |p_d - p_t| + 0.1) <= 1 - 0.05


@pytest.mark.parametrize("init_from_full", [False, True], ids=["from-scratch", "from-a-full-vocabulary-drafter"])
def test_training_with_a_draft_vocabulary_lowers_the_loss_and_keeps_the_map(cache, target, tmp_path, init_from_full):  # noqa: F811
    init = None
    if init_from_full:
        init = str(run(tiny_config(steps=4), cache, target, tmp_path / "full").final_dir)
    result = run(tiny_config(steps=16, draft_vocab_size=24, init_from=init), cache, target, tmp_path / "small")
    log = [e for e in read_metrics(result.run_dir) if "step" in e and "event" not in e]
    assert np.mean([e["loss"] for e in log[-4:]]) < np.mean([e["loss"] for e in log[:4]])
    assert {"greedy_tau", "greedy_acc_per_pos"} <= log[-1].keys() and log[-1]["greedy_tau"] >= 1.0
    drafter = load_checkpoint(result.final_dir, shared=SharedWeights.from_target(target)).drafter
    assert torch.equal(drafter.draft_to_target, frequent_tokens(cache, size=24))
    assert drafter.head.w2.shape == (16, 24)


def test_the_cache_logit_stats_change_neither_the_loss_nor_its_metrics(cache, target, tmp_path):  # noqa: F811
    import shutil

    from dspark.drafters.dspark.objective import DSparkObjective
    from dspark.training.anchors import sample_batch
    from dspark.training.target_cache import TargetCache, add_logit_stats

    shutil.copytree(cache.path, tmp_path / "cache")
    add_logit_stats(tmp_path / "cache", target.lm_head_weight, progress=False)
    with_stats = TargetCache(tmp_path / "cache")
    assert with_stats.has_logit_stats and not cache.has_logit_stats
    init = run(tiny_config(steps=4, draft_vocab_size=24), cache, target, tmp_path / "run").final_dir
    drafter = load_checkpoint(init, shared=SharedWeights.from_target(target)).drafter
    results = []
    for c in (cache, with_stats):  # the full-vocabulary softmax, then the N rows and the cached normaliser
        batch = sample_batch(c, [0, 1, 2], anchors_per_seq=8, block_size=4, seed=0, epoch=0)
        assert (batch.target_lse is None) == (c is cache)
        drafter.zero_grad()
        result = DSparkObjective().loss(drafter, batch)
        result.total.backward()
        results.append((result, [p.grad.clone() for p in drafter.parameters() if p.grad is not None]))
    (full, full_grads), (fast, fast_grads) = results
    assert fast.total.item() == pytest.approx(full.total.item(), rel=1e-5)
    for key in ("tv", "ce", "conf", "tau", "acc"):
        assert fast.metrics[key] == pytest.approx(full.metrics[key], rel=1e-5, abs=1e-6), key
    for key in ("greedy_tau", "greedy_hits_per_pos", "greedy_tries_per_pos"):
        assert fast.metrics[key] == full.metrics[key], key
    for a, b in zip(fast_grads, full_grads):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-6)


def test_greedy_acceptance_counts_leading_argmax_matches():
    draft = torch.tensor([[1, 2, 3], [1, 9, 3], [9, 2, 3], [1, 2, 3]])
    target = torch.tensor([[1, 2, 3], [1, 2, 3], [1, 2, 3], [1, 2, 3]])
    mask = torch.tensor([[True, True, True], [True, True, True], [True, True, True], [True, True, False]])
    tau, hits, tries = greedy_acceptance(draft, target, mask)
    # accepted lengths 3, 1, 0, 2 (+ bonus): τ = 1 + 6/4
    assert float(tau) == pytest.approx(2.5)
    assert hits.tolist() == [3, 2, 1] and tries.tolist() == [4, 3, 1]
