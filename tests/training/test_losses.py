"""Specification tests of the DSpark training objective (dspark/training/losses.py).

Each term is checked against a value computed by hand on a 2-position, 3-token toy block; the
last test trains a tiny drafter for a few AdamW steps on features of the tiny random target.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from dspark.training.losses import (
    acceptance_rate,
    ce_loss,
    confidence_loss,
    dspark_loss,
    expected_acceptance,
    expected_accepted_length,
    label_positions,
    position_weights,
    target_hidden_positions,
    target_probs_from_hidden,
    target_probs_on_vocab,
    tv_loss,
    vocab_loss_terms,
)

# One block, γ = 2, V = 3. Draft logits give p_d; target rows are written as probabilities.
DRAFT_LOGITS = torch.tensor([[[math.log(2.0), 0.0, 0.0], [0.0, 0.0, 0.0]]])  # p_d = (.5, .25, .25), (1/3, 1/3, 1/3)
TARGET_PROBS = torch.tensor([[[0.7, 0.2, 0.1], [0.0, 0.5, 0.5]]])
TARGET_IDS = torch.tensor([[0, 2]])
W2 = math.exp(-1 / 4)  # w_2 with γ_w = 4 (w_1 = 1)


def test_position_weights_decay_exponentially_from_one():
    torch.testing.assert_close(position_weights(3, decay=4.0), torch.tensor([1.0, math.exp(-0.25), math.exp(-0.5)]))


def test_ce_loss_is_the_weighted_mean_negative_log_likelihood_of_the_labels():
    expected = (1.0 * -math.log(0.5) + W2 * -math.log(1 / 3)) / (1.0 + W2)
    got = ce_loss(DRAFT_LOGITS, TARGET_IDS, position_weights(2, decay=4.0))
    assert got.item() == pytest.approx(expected, rel=1e-6)


def test_tv_loss_is_the_weighted_mean_l1_distance():
    l1 = [abs(0.5 - 0.7) + abs(0.25 - 0.2) + abs(0.25 - 0.1), 1 / 3 + 2 * abs(1 / 3 - 0.5)]  # 0.4, 2/3
    expected = (1.0 * l1[0] + W2 * l1[1]) / (1.0 + W2)
    got = tv_loss(torch.softmax(DRAFT_LOGITS, -1), TARGET_PROBS, position_weights(2, decay=4.0))
    assert got.item() == pytest.approx(expected, rel=1e-6)


def test_c_star_is_one_minus_total_variation_and_equals_the_overlap_mass():
    p_d = torch.softmax(DRAFT_LOGITS, -1)
    c_star = acceptance_rate(p_d, TARGET_PROBS)
    torch.testing.assert_close(c_star, torch.tensor([[1 - 0.2, 1 - 1 / 3]]))  # 1 - ½‖p_d - p_t‖₁
    torch.testing.assert_close(c_star, torch.minimum(p_d, TARGET_PROBS).sum(-1))  # = Σ min(p_d, p_t)


def test_confidence_loss_is_bce_against_c_star():
    logits = torch.tensor([[0.5, -1.0]])
    c_star = torch.tensor([[0.8, 2 / 3]])
    c = torch.sigmoid(logits)[0].tolist()
    bce = [-(0.8 * math.log(c[0]) + 0.2 * math.log(1 - c[0])), -(2 / 3 * math.log(c[1]) + 1 / 3 * math.log(1 - c[1]))]
    expected = (bce[0] + W2 * bce[1]) / (1.0 + W2)
    assert confidence_loss(logits, c_star, position_weights(2, decay=4.0)).item() == pytest.approx(expected, rel=1e-6)


def test_total_loss_combines_the_terms_with_weights_0_1_0_9_1_0():
    conf_logits = torch.tensor([[0.5, -1.0]])
    out = dspark_loss(draft_logits=DRAFT_LOGITS, target_ids=TARGET_IDS, target_probs=TARGET_PROBS, confidence_logits=conf_logits)
    assert out.total.item() == pytest.approx(0.1 * out.ce.item() + 0.9 * out.tv.item() + 1.0 * out.conf.item(), rel=1e-6)
    torch.testing.assert_close(out.c_star, torch.tensor([[0.8, 2 / 3]]))
    w = position_weights(2, decay=4.0)
    assert out.conf.item() == pytest.approx(confidence_loss(conf_logits, out.c_star, w).item(), rel=1e-6)


def test_confidence_label_is_detached_so_l_conf_trains_only_the_confidence_head():
    logits = DRAFT_LOGITS.clone().requires_grad_(True)
    conf_logits = torch.tensor([[0.5, -1.0]], requires_grad=True)
    out = dspark_loss(draft_logits=logits, target_ids=TARGET_IDS, target_probs=TARGET_PROBS, confidence_logits=conf_logits,
                      ce_weight=0.0, tv_weight=0.0)
    out.total.backward()
    assert logits.grad is None or bool((logits.grad == 0).all())
    assert conf_logits.grad is not None and bool((conf_logits.grad != 0).all())


def test_masked_positions_do_not_count():
    mask = torch.tensor([[True, False]])
    out = dspark_loss(draft_logits=DRAFT_LOGITS, target_ids=TARGET_IDS, target_probs=TARGET_PROBS,
                      confidence_logits=torch.zeros(1, 2), mask=mask)
    assert out.ce.item() == pytest.approx(-math.log(0.5), rel=1e-6)
    assert out.tv.item() == pytest.approx(0.4, rel=1e-6)


def _plain_dspark_loss(logits, ids, p_t, conf_logits, mask):
    # the loss composed from the plain terms (ce_loss, tv_loss, acceptance_rate), autograd end to end
    w = position_weights(logits.shape[1], decay=4.0)
    p_d = torch.softmax(logits.float(), dim=-1)
    c_star = acceptance_rate(p_d, p_t).detach()
    return 0.1 * ce_loss(logits, ids, w, mask) + 0.9 * tv_loss(p_d, p_t, w, mask) + confidence_loss(conf_logits, c_star, w, mask)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_vocabulary_terms_match_the_plain_loss_in_value_and_gradient(dtype):
    g = torch.Generator().manual_seed(0)
    n, gamma, vocab = 5, 4, 300
    logits = (3 * torch.randn(n, gamma, vocab, generator=g)).to(dtype)
    p_t = torch.softmax(3 * torch.randn(n, gamma, vocab, generator=g), dim=-1)
    p_t[0, 0] = torch.softmax(logits[0, 0].float(), dim=-1)  # p_d == p_t: sign(0) = 0, as autograd's abs
    ids = torch.randint(0, vocab, (n, gamma), generator=g)
    mask = torch.rand(n, gamma, generator=g) > 0.2
    conf_logits = torch.randn(n, gamma, generator=g)
    nll, l1 = vocab_loss_terms(logits, p_t, ids)
    torch.testing.assert_close(nll, F.cross_entropy(logits.float().reshape(-1, vocab), ids.reshape(-1), reduction="none").view(n, gamma))
    torch.testing.assert_close(l1, (torch.softmax(logits.float(), -1) - p_t).abs().sum(-1))
    a, b = logits.clone().requires_grad_(True), logits.clone().requires_grad_(True)
    fused = dspark_loss(draft_logits=a, target_ids=ids, target_probs=p_t, confidence_logits=conf_logits, mask=mask)
    plain = _plain_dspark_loss(b, ids, p_t, conf_logits, mask)
    torch.testing.assert_close(fused.total, plain)
    fused.total.backward()
    plain.backward()
    assert a.grad.dtype == dtype
    tol = {"atol": 1e-6, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 1e-4, "rtol": 2e-2}  # bf16: one rounding vs two
    torch.testing.assert_close(a.grad.float(), b.grad.float(), **tol)


def test_loss_rejects_mismatched_shapes_naming_what_it_got():
    with pytest.raises(ValueError, match=r"expected target_probs \[1, 2, 3\], got \[1, 2, 4\]"):
        dspark_loss(draft_logits=DRAFT_LOGITS, target_ids=TARGET_IDS, target_probs=torch.zeros(1, 2, 4), confidence_logits=torch.zeros(1, 2))


def test_block_position_k_predicts_t_plus_k_from_the_target_output_at_t_plus_k_minus_1():
    anchors = torch.tensor([3, 10])
    assert label_positions(anchors, 3).tolist() == [[4, 5, 6], [11, 12, 13]]
    assert target_hidden_positions(anchors, 3).tolist() == [[3, 4, 5], [10, 11, 12]]


def test_target_probs_from_hidden_equal_the_softmax_of_the_target_logits(tiny_runtime_factory):
    runtime = tiny_runtime_factory(compute_dtype=torch.float32)
    runtime.add_request("a", max_tokens=16)
    out = runtime.forward(["a"], torch.arange(10, 20), [10])
    probs = target_probs_from_hidden(out.hidden[[2, 5]], runtime.model.lm_head_weight)
    torch.testing.assert_close(probs, torch.softmax(out.logits[[2, 5]], -1), atol=1e-6, rtol=1e-5)
    hot = target_probs_from_hidden(out.hidden[[2]], runtime.model.lm_head_weight, temperature=0.5)
    torch.testing.assert_close(hot, torch.softmax(out.logits[[2]] / 0.5, -1), atol=1e-6, rtol=1e-5)


def test_target_probs_on_a_draft_vocabulary_need_only_its_rows_and_the_normaliser():
    torch.manual_seed(0)
    hidden, head = torch.randn(5, 16), torch.randn(40, 16)  # [n, d], [V, d]
    vocab = torch.tensor([3, 0, 17, 39, 8, 21])  # D, N = 6
    logits = hidden @ head.t()  # [n, V]
    p, outside = target_probs_on_vocab(hidden, head[vocab], torch.logsumexp(logits, -1))
    full = torch.softmax(logits, -1)
    torch.testing.assert_close(p, full[:, vocab], rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(outside, 1 - full[:, vocab].sum(-1), rtol=1e-5, atol=1e-6)
    _, nothing_outside = target_probs_on_vocab(hidden, head, torch.logsumexp(logits, -1))  # D = V
    assert (nothing_outside >= 0).all() and float(nothing_outside.max()) < 1e-5


def test_expected_acceptance_diagnostics():
    c_star = torch.tensor([[0.8, 0.5], [0.6, 0.9]])
    torch.testing.assert_close(expected_acceptance(c_star), torch.tensor([0.7, 0.7]))
    torch.testing.assert_close(expected_acceptance(c_star, torch.tensor([[True, False], [True, True]])), torch.tensor([0.7, 0.9]))
    expected_tau = ((1 + 0.8 + 0.8 * 0.5) + (1 + 0.6 + 0.6 * 0.9)) / 2
    assert expected_accepted_length(c_star).item() == pytest.approx(expected_tau)


@pytest.mark.parametrize("head_type", ["markov", "rnn"])
def test_a_few_adamw_steps_on_a_fixed_tiny_batch_lower_the_loss(tiny_runtime_factory, head_type):
    """End to end on the tiny target: captured features -> drafter -> p_t from final hidden -> loss."""
    from dspark.drafters.dspark import (
        BlockBatch,
        DSparkConfig,
        DSparkDrafter,
    )
    from dspark.drafters.shared import SharedWeights

    cfg = DSparkConfig.tiny(head_type=head_type)
    runtime = tiny_runtime_factory(compute_dtype=torch.float32, capture_layers=cfg.target_layer_ids)
    tokens = torch.randint(0, cfg.vocab_size, (24,), generator=torch.Generator().manual_seed(0))
    runtime.add_request("s", max_tokens=24)
    out = runtime.forward(["s"], tokens, [24], capture=True)
    anchors = torch.tensor([0, 3, 7, 12, 19])  # t + γ <= 23: every label exists
    batch = BlockBatch.from_sequences(contexts=[out.captured], anchor_positions=[anchors], anchor_tokens=[tokens[anchors]])
    labels = tokens[label_positions(anchors, cfg.block_size)]  # [5, γ]
    p_t = target_probs_from_hidden(out.hidden[target_hidden_positions(anchors, cfg.block_size).flatten()],
                                   runtime.model.lm_head_weight).view(5, cfg.block_size, -1)

    torch.manual_seed(0)
    drafter = DSparkDrafter(cfg, shared=SharedWeights.from_target(runtime.model)).train()
    optimizer = torch.optim.AdamW(drafter.trainable_parameters(), lr=3e-3, weight_decay=0.0)

    def loss():
        fwd = drafter(batch, target_tokens=labels.unsqueeze(0))
        return dspark_loss(draft_logits=fwd.logits[0], target_ids=labels, target_probs=p_t, confidence_logits=fwd.confidence_logits[0])

    first = loss()
    for _ in range(15):
        optimizer.zero_grad()
        loss().total.backward()
        optimizer.step()
    last = loss()
    assert last.total.item() < 0.8 * first.total.item()
    assert last.tv.item() < first.tv.item()  # the draft moved towards the target
    assert expected_accepted_length(last.c_star).item() > expected_accepted_length(first.c_star).item()


def test_target_probs_stay_fp32_inside_a_bf16_autocast_region():
    """bf16 training (--precision bf16) must not round the labels: p_t is computed in fp32 anyway."""
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(4, 64, generator=g)  # [n, d]
    lm_head = torch.randn(1000, 64, generator=g)  # [V, d]
    exact = target_probs_from_hidden(hidden, lm_head)
    with torch.autocast(device_type="cpu", dtype=torch.bfloat16):
        under_autocast = target_probs_from_hidden(hidden, lm_head)
    assert under_autocast.dtype == torch.float32
    torch.testing.assert_close(under_autocast, exact, rtol=0, atol=0)
