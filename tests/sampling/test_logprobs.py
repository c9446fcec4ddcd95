"""Log-probabilities of emitted tokens (dspark/sampling/logprobs.py): each emitted token's entry is
log_softmax of the target row that scored it; alternatives are the row's most likely tokens,
ties to the lowest id; requests that do not ask get padding, and a round where none asks, nothing."""

from __future__ import annotations

import pytest
import torch

from dspark.sampling.logprobs import NOT_ASKED, TokenLogprobs, round_logprobs, top_k_logprobs, top_k_logprobs_reference


@pytest.mark.parametrize(("vocab", "k"), [(7, 1), (7, 5), (7, 7), (256, 1), (256, 2), (256, 20), (4099, 5), (4099, 20)])
def test_top_k_equals_a_stable_sort_of_the_row_even_with_many_ties(vocab, k):
    g = torch.Generator().manual_seed(vocab * 100 + k)
    # values on a coarse grid: most rows have ties at the k-th value (bf16 logits tie often)
    rows = torch.log_softmax(torch.randint(0, 6, (64, vocab), generator=g).float(), dim=-1)  # [64, vocab]
    ids, values = top_k_logprobs(rows, k)
    ref_ids, ref_values = top_k_logprobs_reference(rows, k)
    assert torch.equal(ids, ref_ids)
    assert torch.equal(values, ref_values)
    assert bool((rows.gather(1, ids) == values).all())


def test_top_k_of_zero_alternatives_is_empty():
    ids, values = top_k_logprobs(torch.zeros(3, 10), 0)
    assert ids.shape == (3, 0) and values.shape == (3, 0)


def test_each_emitted_token_gets_log_softmax_of_the_row_that_scored_it():
    g = torch.Generator().manual_seed(0)
    vocab = 50
    # request 0: 3 drafts, 1 accepted (emits 2); request 1: does not ask; request 2: prefill (emits 1)
    num_drafts = torch.tensor([3, 2, 0])
    logits = 3 * torch.randn(int(num_drafts.sum()) + 3, vocab, generator=g)  # [8, vocab]
    out = torch.tensor([[11, 12, -1, -1], [1, 2, 3, -1], [40, -1, -1, -1]])
    accepted = torch.tensor([1, 2, 0])
    lp = round_logprobs(logits, output_token_ids=out, num_accepted=accepted, num_draft_tokens=num_drafts,
                        num_logprobs=torch.tensor([3, NOT_ASKED, 0]))
    reference = torch.log_softmax(logits, dim=-1)
    # rows: request 0 owns rows 0..3, request 1 rows 4..6, request 2 row 7
    assert lp.token_logprobs[0, 0] == reference[0, 11] and lp.token_logprobs[0, 1] == reference[1, 12]
    assert lp.token_logprobs[2, 0] == reference[7, 40]
    assert lp.token_logprobs[1].isnan().all()  # did not ask
    assert lp.token_logprobs[0, 2:].isnan().all() and lp.token_logprobs[2, 1:].isnan().all()  # past the emitted tokens
    assert torch.equal(lp.top_token_ids[0, 0], torch.sort(reference[0], descending=True, stable=True).indices[:3])
    assert torch.equal(lp.top_logprobs[0, 1], torch.sort(reference[1], descending=True).values[:3])

    first = lp.for_request(0, 2, 3)
    assert first.logprobs == [reference[0, 11].item(), reference[1, 12].item()]
    assert len(first.top_ids[0]) == 3 and first.top_ids[0][0] == int(reference[0].argmax())
    assert lp.for_request(2, 1, 0) == TokenLogprobs([reference[7, 40].item()], [[]], [[]])  # its own k: none


def test_a_round_where_no_request_asks_computes_nothing():
    out = round_logprobs(torch.randn(3, 9), output_token_ids=torch.tensor([[1, 2], [3, -1]]), num_accepted=torch.tensor([1, 0]),
                         num_draft_tokens=torch.tensor([1, 0]), num_logprobs=torch.tensor([NOT_ASKED, NOT_ASKED]))
    assert out is None


def test_token_logprobs_have_one_entry_per_token():
    with pytest.raises(ValueError, match="one entry per token"):
        TokenLogprobs([0.0, -1.0], [[1]], [[0.0]])
    lp = TokenLogprobs([-0.5, -1.5], [[1], [2]], [[-0.5], [-1.0]])
    assert lp.head(1) == TokenLogprobs([-0.5], [[1]], [[-0.5]]) and len(lp) == 2
    with pytest.raises(ValueError, match="same number of alternatives"):
        TokenLogprobs([-0.5], [[1, 2]], [[-0.5]])
