"""The rejection sampler: edge cases, losslessness (chi-square), reproducibility, validation.

The statistical tests simulate whole rounds with many independent requests in one batch and
check that the emitted tokens follow the TARGET distribution although drafts come from a
deliberately different p_d; deliberately wrong samplers must fail the very same tests.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from scipy.stats import chisquare, kstest

from dspark.sampling import (
    DraftProbs,
    RejectionBatch,
    RejectionResult,
    SamplingParams,
    draw_exp_noise,
    draw_rejection_randoms,
    draw_uniforms,
    logits_to_probs,
    rejection_sample,
    rejection_sample_batched,
)
from dspark.sampling import rejection_sampler
from dspark.sampling.rejection_sampler import (
    ROW_SUM_TOL,
    dense_exp_noise,
    draw_race_noise,
    exponentials,
    noise_support,
    prepare_batch,
    rejection_sample_reference,
)
from tests.sampling.conftest import LAST_UNIFORM_BELOW_ONE, make_mixed_batch, rounding_vocab

NEG_INF = float("-inf")


def _logits(*rows: list[float]) -> torch.Tensor:  # [len(rows), vocab]: log of the given probabilities
    return torch.tensor(rows, dtype=torch.float32).log()


def _one_hot_logits(token: int, vocab: int) -> torch.Tensor:  # [1, vocab]
    row = torch.full((1, vocab), NEG_INF)
    row[0, token] = 0.0
    return row


SAMPLED = SamplingParams(temperature=1.0)
GREEDY = SamplingParams(temperature=0.0)


# ---------------------------------------------------------------------------------------------
# Edge cases, with hand-set random numbers
# ---------------------------------------------------------------------------------------------


def test_all_drafts_accepted_emits_the_bonus_from_the_position_after_the_last_draft(batch_of):
    vocab = 5
    # p_d == p_t at the draft tokens: ratio 1, always accepted. Rows 0 and 1 would never emit 4.
    target = torch.cat([_logits([0.5, 0.5, 0, 0, 0]), _logits([0, 0.5, 0.5, 0, 0]), _one_hot_logits(4, vocab)])
    draft = torch.tensor([[0.5, 0.5, 0, 0, 0], [0, 0.5, 0.5, 0, 0]])
    batch = batch_of([(SAMPLED, [0, 2], target, draft)], uniforms=torch.tensor([0.999, 0.999]))
    result = rejection_sample(batch)
    assert result.output_token_ids.tolist() == [[0, 2, 4]]
    assert result.num_accepted.tolist() == [2]


def test_first_draft_rejected_emits_a_residual_draw_and_discards_the_rest(batch_of):
    # p_t = (.5, .5), p_d = (1, 0): draft 0 accepted iff u < .5; the residual is all on token 1.
    target = torch.cat([_logits([0.5, 0.5, 0]), _logits([0, 0, 1.0]), _logits([0, 0, 1.0])])
    draft = torch.tensor([[1.0, 0, 0], [0, 0, 1.0]])
    for u in (0.5, 0.75, 0.99):
        batch = batch_of([(SAMPLED, [0, 2], target, draft)], uniforms=torch.tensor([u, 0.0]))
        result = rejection_sample(batch)
        assert result.output_token_ids.tolist() == [[1, -1, -1]]
        assert result.num_accepted.tolist() == [0]
    accepted = rejection_sample(batch_of([(SAMPLED, [0, 2], target, draft)], uniforms=torch.tensor([0.49, 0.0])))
    assert accepted.output_token_ids.tolist() == [[0, 2, 2]]


def test_residual_puts_its_mass_where_the_draft_has_none(batch_of):
    # p_d(2) = 0 < p_t(2): every rejection must emit 2, whatever the exponential noise.
    target = _logits([0.25, 0.25, 0.5], [1 / 3, 1 / 3, 1 / 3])
    draft = torch.tensor([[0.5, 0.5, 0.0]])
    emitted, rejections = [], 0
    for seed in range(50):
        result = rejection_sample(batch_of([(SAMPLED, [seed % 2], target, draft)], seed=seed))
        if result.num_accepted.item() == 0:
            rejections += 1
            emitted.append(result.output_token_ids[0, 0].item())
    assert rejections > 10  # acceptance is 0.5: the test must not pass vacuously
    assert set(emitted) == {2}


def test_an_all_zero_residual_falls_back_to_a_draw_from_the_target(batch_of):
    # The drafter's row is the target's own (uniform over n tokens, fp32 entries summing below 1;
    # two more tokens have p_t = 0): renormalised, p_d >= p_t everywhere, so the residual is all
    # zero, and u = 1 - 2^-24 rejects the draft. The token then comes from p_t's race, never from
    # a token with p_t = 0.
    n = rounding_vocab(4)
    target = torch.cat([torch.zeros(2, n), torch.full((2, 2), NEG_INF)], 1)  # [2, n + 2]
    draft = logits_to_probs(target[:1], temperature=1.0)  # [1, n + 2], p_d = p_t
    for seed in range(20):
        batch = batch_of([(SAMPLED, [1], target, draft)], uniforms=torch.tensor([LAST_UNIFORM_BELOW_ONE]), seed=seed)
        result = rejection_sample(batch)
        assert result.num_accepted.item() == 0
        assert result.output_token_ids[0, 0].item() == int(torch.argmax(draft[0] / batch.exp_noise[0]))


@pytest.mark.parametrize("filter_kwargs", [{"top_p": 0.7}, {"top_k": 2}])
def test_target_top_p_and_top_k_hold_a_token_outside_them_is_rejected_and_never_emitted(batch_of, filter_kwargs):
    params = SamplingParams(temperature=1.0, **filter_kwargs)
    # Nucleus {0, 1} for top_p=0.7 (0.45 + 0.35 crosses 0.7) and for top_k=2. Token 3 lies outside.
    target = _logits([0.45, 0.35, 0.15, 0.05], [0.45, 0.35, 0.15, 0.05])
    draft = torch.tensor([[0.1, 0.1, 0.1, 0.7]])  # the drafter loves token 3
    outputs = []
    for seed in range(60):
        result = rejection_sample(batch_of([(params, [3], target, draft)], seed=seed))
        assert result.num_accepted.item() == 0  # p_t(3) = 0 after the filter: always rejected
        outputs.append(result.output_token_ids[0, 0].item())
    assert set(outputs) == {0, 1}


def test_greedy_accepts_the_argmax_and_breaks_ties_to_the_lowest_id(batch_of):
    tied = torch.tensor([[1.0, 5.0, 5.0, 0.0]])  # argmax 1 (ids 1 and 2 tie)
    target = torch.cat([tied, tied, tied])
    accepted_then_bonus = rejection_sample(batch_of([(GREEDY, [1, 1], target, None)]))
    assert accepted_then_bonus.output_token_ids.tolist() == [[1, 1, 1]]
    assert accepted_then_bonus.num_accepted.tolist() == [2]
    corrected = rejection_sample(batch_of([(GREEDY, [1, 2], target, None)]))  # 2 ties but is not the argmax
    assert corrected.output_token_ids.tolist() == [[1, 1, -1]]
    assert corrected.num_accepted.tolist() == [1]


def test_requests_without_drafts_draw_only_a_bonus_among_others(batch_of):
    vocab = 6
    requests = [
        (SAMPLED, [], _one_hot_logits(3, vocab), None),
        (SAMPLED, [1, 1], torch.cat([_one_hot_logits(t, vocab) for t in (1, 1, 5)]), torch.eye(vocab)[[1, 1]]),
        (GREEDY, [], _one_hot_logits(2, vocab), None),
        (SAMPLED, [4], torch.cat([_one_hot_logits(0, vocab), _one_hot_logits(1, vocab)]), torch.eye(vocab)[[4]]),
        (SAMPLED, [], _one_hot_logits(0, vocab), None),
    ]
    result = rejection_sample(batch_of(requests))
    assert result.output_token_ids.tolist() == [[3, -1, -1], [1, 1, 5], [2, -1, -1], [0, -1, -1], [0, -1, -1]]
    assert result.num_accepted.tolist() == [0, 2, 0, 0, 0]


def test_greedy_and_sampled_requests_mix_in_one_batch_without_crosstalk(batch_of):
    vocab = 5
    greedy_target = torch.tensor([[0.0, 3.0, 1.0, 0.0, 0.0], [2.0, 0.0, 0.0, 0.0, 0.0]])
    sampled_target = torch.cat([_logits([0.2, 0.2, 0.2, 0.2, 0.2]), _one_hot_logits(4, vocab)])
    garbage_rows = torch.zeros(1, vocab)  # greedy rows are never read nor validated
    requests = [
        (GREEDY, [1], greedy_target, garbage_rows),
        (SAMPLED, [2], sampled_target, torch.tensor([[0.2] * 5])),
        (GREEDY, [0], greedy_target, garbage_rows),
    ]
    result = rejection_sample(batch_of(requests, uniforms=torch.tensor([0.5, 0.5, 0.5])))
    assert result.output_token_ids.tolist() == [[1, 0], [2, 4], [1, -1]]
    assert result.num_accepted.tolist() == [1, 1, 0]


def test_an_all_greedy_batch_needs_no_draft_probs(batch_of):
    target = torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 1.0]])
    batch = batch_of([(GREEDY, [1], target, None)])
    assert batch.draft_probs is None
    assert rejection_sample(batch).output_token_ids.tolist() == [[1, 2]]


def test_plain_greedy_decoding_emits_each_rows_argmax_with_ties_to_the_lowest_id(batch_of):
    """The batched path's shortcut for rounds without drafts where every request is greedy:
    the reference's tokens, ties included."""
    g = torch.Generator().manual_seed(0)
    for num_requests in (1, 3, 8):
        rows = torch.randint(0, 4, (num_requests, 40), generator=g).float()  # many ties at the max
        batch = batch_of([(GREEDY, [], rows[r : r + 1], None) for r in range(num_requests)])
        prep = prepare_batch(batch)
        fast, ref = rejection_sample_batched(prep), rejection_sample_reference(prep)
        assert torch.equal(fast.output_token_ids, ref.output_token_ids)
        assert torch.equal(fast.num_accepted, ref.num_accepted)
        assert fast.output_token_ids.squeeze(1).tolist() == [int((row == row.max()).nonzero()[0]) for row in rows]


@pytest.mark.parametrize("seed", range(4))
def test_sparse_rows_give_the_same_result_as_the_same_distribution_dense(mixed_batch, seed):
    sparse = mixed_batch(seed, sparse=True)
    ids, probs = sparse.draft_probs.sparse_ids, sparse.draft_probs.sparse_probs
    dense = torch.zeros(ids.shape[0], sparse.vocab_size)
    dense.scatter_add_(1, ids.clamp_min(0), torch.where(ids >= 0, probs, 0.0))
    as_dense = replace(sparse, draft_probs=DraftProbs(dense=dense))
    a, b = rejection_sample(sparse), rejection_sample(as_dense)
    assert torch.equal(a.output_token_ids, b.output_token_ids)
    assert torch.equal(a.num_accepted, b.num_accepted)


# ---------------------------------------------------------------------------------------------
# Draft rows: renormalised before use, refused beyond the tolerance
# ---------------------------------------------------------------------------------------------


def _boundary_case(batch_of, scale: float, *, sparse: bool) -> RejectionBatch:
    """p_t = (.2, .3, .5), the drafter's row (.5, .25, .25) times `scale`, draft 0 and u just
    below p_t(0) / p_d(0) = 0.4: accepted against the normalised row, rejected against .5 * scale
    for any scale > 1 + 3e-6."""
    row = torch.tensor([[0.5, 0.25, 0.25]]) * scale
    batch = batch_of([(SAMPLED, [0], _logits([0.2, 0.3, 0.5], [0.2, 0.3, 0.5]), row)],
                     uniforms=torch.tensor([0.4 - 1e-6]), seed=3)
    if sparse:
        batch = replace(batch, draft_probs=DraftProbs(sparse_ids=torch.tensor([[0, 1, 2, -1]]),
                                                      sparse_probs=torch.cat([row, torch.zeros(1, 1)], 1)))
    return batch


@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "sparse"])
def test_a_row_off_by_rounding_is_verified_as_the_distribution_it_normalises_to(batch_of, sparse):
    """Drafters draw x ~ row / sum(row): a row whose sum is off by rounding (within ROW_SUM_TOL)
    must be verified as that normalised distribution, not taken at face value."""
    scale = 1 + 0.5 * ROW_SUM_TOL
    off, exact = _boundary_case(batch_of, scale, sparse=sparse), _boundary_case(batch_of, 1.0, sparse=sparse)
    got, want = rejection_sample(off), rejection_sample(exact)
    assert want.num_accepted.tolist() == [1]
    assert torch.equal(got.output_token_ids, want.output_token_ids) and torch.equal(got.num_accepted, want.num_accepted)
    # the control: the same row taken at face value rejects the draft (so the case has the power)
    prep = prepare_batch(off)
    unnormalised = replace(prep, draft_probs=torch.tensor([[0.5, 0.25, 0.25]]) * scale)
    assert rejection_sample_reference(unnormalised).num_accepted.tolist() == [0]


def test_rows_off_by_more_than_the_tolerance_are_refused(batch_of):
    for scale in (1 + 2 * ROW_SUM_TOL, 1 - 2 * ROW_SUM_TOL):
        with pytest.raises(ValueError, match=f"must sum to 1 \\(tol {ROW_SUM_TOL}\\)"):
            rejection_sample(_boundary_case(batch_of, scale, sparse=False))


@pytest.mark.parametrize("vocab", [49_152, 151_936], ids=["smollm2-vocab", "qwen-vocab"])
def test_fp32_softmax_rows_of_a_large_vocabulary_are_within_the_tolerance(vocab):
    """The tolerance is not tighter than real rows: dense softmax rows and top-p truncations of a
    real vocabulary's size, at several temperatures, pass the check (their sums are off by up to
    ~2e-5: the softmax normaliser's rounding)."""
    g = torch.Generator().manual_seed(0)
    logits = (4.0 * torch.randn(8, vocab, generator=g)).to(torch.bfloat16)  # [8, vocab] as a model emits them
    for params in (SamplingParams(temperature=0.3), SamplingParams(temperature=1.7), SamplingParams(temperature=1.0, top_p=0.9)):
        rows = logits_to_probs(logits, temperature=params.temperature, top_p=params.top_p)  # [8, vocab]
        draft = torch.multinomial(rows, 1, generator=g).squeeze(1)  # [8]
        lens = torch.ones(8, dtype=torch.int64)
        uniforms, exp_noise = draw_rejection_randoms(lens, vocab, [g] * 8)
        batch = RejectionBatch(draft_token_ids=draft, num_draft_tokens=lens, target_logits=logits.repeat_interleave(2, 0),
                               draft_probs=DraftProbs(dense=rows), params=[params] * 8, uniforms=uniforms, exp_noise=exp_noise)
        prep = prepare_batch(batch)  # raises beyond the tolerance
        assert (prep.draft_probs.sum(-1) - 1).abs().max() < 1e-6  # and the rows are renormalised


def test_result_layout_is_accepted_drafts_then_one_token_then_padding(mixed_batch):
    for seed in range(6):
        batch = mixed_batch(seed, sparse=seed % 2 == 1)
        result = rejection_sample(batch)
        lens = batch.num_draft_tokens
        assert result.output_token_ids.shape == (batch.num_requests, int(lens.max()) + 1)
        assert ((result.num_accepted >= 0) & (result.num_accepted <= lens)).all()
        starts = torch.cumsum(lens, 0) - lens
        for r in range(batch.num_requests):
            n_acc, row = int(result.num_accepted[r]), result.output_token_ids[r]
            assert row[:n_acc].tolist() == batch.draft_token_ids[starts[r] : starts[r] + n_acc].tolist()
            assert 0 <= row[n_acc] < batch.vocab_size
            assert (row[n_acc + 1 :] == -1).all()


# ---------------------------------------------------------------------------------------------
# Losslessness: the emitted tokens follow p_t whatever p_d is
# ---------------------------------------------------------------------------------------------

V = 6
N_ROUNDS = 30_000
P_MIN = 1e-3  # a correct sampler passes with this fixed seed
P_WRONG = 1e-6  # a wrong sampler must fail far below it


def _random_rows(gen: torch.Generator, *shape: int) -> torch.Tensor:  # [*shape, V], no cell below 0.2/V
    dirichlet = torch.empty(*shape, V).exponential_(generator=gen)
    return 0.8 * dirichlet / dirichlet.sum(-1, keepdim=True) + 0.2 / V


class ChainProblem:
    """Two-token generation: target p_t1(y1) p_t2(y2 | y1), bonus p_t3; a different drafter q.

    The drafter's q1 gives token 0 no mass at all, so the residual must supply it. With
    sparse=True the drafter samples from its top-3 truncation (plus a padding entry).
    """

    def __init__(self, seed: int = 0, *, sparse: bool = False, top_k: int = 0, noise_on_support: bool = False):
        g = torch.Generator().manual_seed(seed)
        self.top_k = top_k  # the target's own top-k (0 = none): rows with zeros, so a support smaller than V
        self.noise_on_support = noise_on_support  # exp_noise None: the sampler draws it where p_t > 0
        self.p1, self.p2, self.p3 = _random_rows(g), _random_rows(g, V), _random_rows(g)  # [V], [V, V], [V]
        q1, q2 = _random_rows(g), _random_rows(g, V)
        q1[0] = 0.0
        q1 /= q1.sum()
        self.q1, self.q2 = q1, q2
        if sparse:  # the drafter's top-3, renormalised
            self.q1, self.q2 = self._truncate(q1), self._truncate(q2)
        self.sparse = sparse
        self.gen = torch.Generator().manual_seed(seed + 1)

    @staticmethod
    def _truncate(rows: torch.Tensor) -> torch.Tensor:
        top = rows.topk(3, dim=-1)
        return torch.zeros_like(rows).scatter(-1, top.indices, top.values / top.values.sum(-1, keepdim=True))

    def _draft_probs(self, rows: torch.Tensor) -> DraftProbs:  # rows [num_draft_tokens, V]
        if not self.sparse:
            return DraftProbs(dense=rows)
        vals, ids = rows.topk(3, dim=-1)
        n = rows.shape[0]
        return DraftProbs(
            sparse_ids=torch.cat([ids, torch.full((n, 1), -1)], 1),
            sparse_probs=torch.cat([vals, torch.zeros(n, 1)], 1),
        )

    def _batch(
        self,
        lens: torch.Tensor,  # [n]
        target_rows: torch.Tensor,  # [sum(lens) + n, V] probabilities
        draft_ids: torch.Tensor,  # [sum(lens)]
        draft_rows: torch.Tensor,  # [sum(lens), V]
    ) -> RejectionBatch:
        n = lens.shape[0]
        return RejectionBatch(
            draft_token_ids=draft_ids,
            num_draft_tokens=lens,
            target_logits=target_rows.log(),
            draft_probs=self._draft_probs(draft_rows),
            params=[SamplingParams(temperature=1.0, top_k=self.top_k)] * n,
            uniforms=torch.rand(draft_ids.shape[0], generator=self.gen),
            exp_noise=None if self.noise_on_support else torch.empty(n, V).exponential_(generator=self.gen),
            noise_generators=[self.gen] * n if self.noise_on_support else None,
        )

    def generate_two_tokens(self, sampler, n: int = N_ROUNDS) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Rounds of speculative decoding until every sequence has 2 tokens.

        Returns y1 [n], y2 [n] and the bonus tokens drawn after 2 accepted drafts [num_bonus].
        """
        # Round 1: two drafts per sequence, x1 ~ q1, x2 ~ q2[x1].
        x1 = torch.multinomial(self.q1, n, replacement=True, generator=self.gen)
        x2 = torch.multinomial(self.q2[x1], 1, generator=self.gen).squeeze(1)
        target = torch.stack([self.p1.expand(n, V), self.p2[x1], self.p3.expand(n, V)], 1).reshape(3 * n, V)
        draft = torch.stack([self.q1.expand(n, V), self.q2[x1]], 1).reshape(2 * n, V)
        lens = torch.full((n,), 2, dtype=torch.int64)
        res = sampler(self._batch(lens, target, torch.stack([x1, x2], 1).flatten(), draft))
        y1, y2 = res.output_token_ids[:, 0], res.output_token_ids[:, 1].clone()
        bonus = [res.output_token_ids[res.num_accepted == 2, 2]]

        # Round 2 for sequences that got one token: alternately one draft x ~ q2[y1], or none.
        again = (res.num_accepted == 0).nonzero().squeeze(1)
        m = again.shape[0]
        ctx = y1[again]
        lens2 = torch.arange(m) % 2  # [m] 0 or 1
        with_draft = lens2 == 1
        if m:
            xd = torch.multinomial(self.q2[ctx[with_draft]], 1, generator=self.gen).squeeze(1)
            # Rows per sequence: p_t2[y1], then p_t3 if it has a draft.
            both = torch.stack([self.p2[ctx], self.p3.expand(m, V)], 1).reshape(2 * m, V)
            rows = both[torch.stack([torch.ones(m, dtype=torch.bool), with_draft], 1).flatten()]
            res2 = sampler(self._batch(lens2, rows, xd, self.q2[ctx[with_draft]]))
            y2[again] = res2.output_token_ids[:, 0]
            bonus.append(res2.output_token_ids[with_draft & (res2.num_accepted == 1), 1])
        return y1, y2, torch.cat(bonus)

    def target(self, rows: torch.Tensor) -> torch.Tensor:  # [..., V] what the sampler must emit from
        return logits_to_probs(rows.log(), temperature=1.0, top_k=self.top_k)

    def joint(self) -> torch.Tensor:  # [V * V] p(y1, y2), float64
        return (self.target(self.p1)[:, None] * self.target(self.p2)).flatten().double()


def _chi2_pvalue(samples: torch.Tensor, probs: torch.Tensor) -> float:
    counts = torch.bincount(samples, minlength=probs.numel()).double()
    expected = probs.double() / probs.double().sum() * counts.sum()
    cells = expected > 0
    assert (counts[~cells] == 0).all(), "a token without target mass was emitted"
    assert expected[cells].min() >= 5, "too few samples per cell for a chi-square test"
    return float(chisquare(counts[cells].numpy(), expected[cells].numpy()).pvalue)


def _lossless_pvalues(problem: ChainProblem, sampler) -> dict[str, float]:
    y1, y2, bonus = problem.generate_two_tokens(sampler)
    assert bonus.numel() > 2000  # the bonus path was really exercised
    return {
        "first token ~ p_t1": _chi2_pvalue(y1, problem.target(problem.p1)),
        "(y1, y2) ~ p_t1 p_t2": _chi2_pvalue(y1 * V + y2, problem.joint()),
        "bonus ~ p_t3": _chi2_pvalue(bonus, problem.target(problem.p3)),
    }


@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "sparse"])
def test_emitted_tokens_follow_the_target_distribution_not_the_drafts(sparse):
    problem = ChainProblem(seed=0, sparse=sparse)
    tv = 0.5 * (problem.q1 - problem.p1).abs().sum()
    assert tv > 0.15  # the drafter really is different
    pvalues = _lossless_pvalues(problem, rejection_sample)
    assert all(p > P_MIN for p in pvalues.values()), pvalues


@pytest.fixture
def compact_race(monkeypatch):
    """Race on gathered support columns whatever the support's width (the tests' vocabularies
    are too small for the 1/8 rule to pick it)."""
    monkeypatch.setattr(rejection_sampler, "COMPACT_RACE_FRACTION", 1)


@pytest.mark.parametrize("race", ["whole-rows", "compact"])
@pytest.mark.parametrize("top_k", [0, 4], ids=["full-support", "target-top-4"])
def test_noise_drawn_on_the_support_keeps_the_emitted_tokens_on_the_target_distribution(top_k, race, request):
    """The verifier's CPU path: no exp_noise in the batch, the sampler draws Exp(1) only where a
    request's rows have p_t > 0 (with the target's top-k, 4 of 6 tokens), and races either on
    whole rows or on the gathered support columns."""
    if race == "compact":
        request.getfixturevalue("compact_race")
    problem = ChainProblem(seed=0, top_k=top_k, noise_on_support=True)
    pvalues = _lossless_pvalues(problem, rejection_sample)
    assert all(p > P_MIN for p in pvalues.values()), pvalues


def test_the_support_noise_test_catches_a_sampler_that_races_on_the_wrong_support(compact_race):
    """Power check for the test above: each request's likeliest token left out of the support it
    draws noise on (it races with E = 1 instead of an Exp(1) draw). On narrow supports only: a
    wide one draws a whole vocabulary, where a support cannot be wrong."""
    def wrong(batch: RejectionBatch) -> RejectionResult:
        prep = prepare_batch(replace(batch, exp_noise=torch.ones(batch.num_requests, batch.vocab_size)))
        num_requests = prep.is_greedy.shape[0]
        anchor_rows = prep.cu_num_draft[:-1] + torch.arange(num_requests)  # [num_requests]
        support = noise_support(prep)
        support[torch.arange(num_requests), prep.target[anchor_rows].argmax(-1)] = False
        noise = draw_exp_noise(batch.vocab_size, batch.noise_generators, device="cpu", support=support)
        return rejection_sample_batched(replace(prep, exp_noise=noise))

    pvalues = _lossless_pvalues(ChainProblem(seed=0, top_k=4, noise_on_support=True), wrong)
    assert min(pvalues.values()) < P_WRONG, pvalues


# Deliberately wrong samplers: the test above must have the power to catch each of them.


def _accepts_every_draft(batch: RejectionBatch) -> RejectionResult:
    return rejection_sample(replace(batch, uniforms=torch.zeros_like(batch.uniforms)))


def _verifies_against_a_uniform_draft(batch: RejectionBatch) -> RejectionResult:
    """The classic bug: the verifier's p_d is not the row the drafter sampled from."""
    n = batch.draft_token_ids.shape[0]
    return rejection_sample(replace(batch, draft_probs=DraftProbs(dense=torch.full((n, V), 1.0 / V))))


def _resamples_from_the_target_instead_of_the_residual(batch: RejectionBatch) -> RejectionResult:
    result = rejection_sample(batch)
    lens, n_acc = batch.num_draft_tokens, result.num_accepted
    rows = torch.cumsum(lens, 0) - lens + torch.arange(lens.shape[0]) + n_acc  # target row of the last token
    probs = logits_to_probs(batch.target_logits[rows], temperature=1.0)
    redraw = torch.multinomial(probs, 1, generator=torch.Generator().manual_seed(7)).squeeze(1)
    out = result.output_token_ids.clone()
    last = out[torch.arange(lens.shape[0]), n_acc]
    out[torch.arange(lens.shape[0]), n_acc] = torch.where(n_acc < lens, redraw, last)
    return RejectionResult(output_token_ids=out, num_accepted=n_acc)


@pytest.mark.parametrize(
    "wrong_sampler",
    [_accepts_every_draft, _verifies_against_a_uniform_draft, _resamples_from_the_target_instead_of_the_residual],
    ids=lambda f: f.__name__.strip("_"),
)
def test_the_losslessness_test_catches_a_wrong_sampler(wrong_sampler):
    pvalues = _lossless_pvalues(ChainProblem(seed=0), wrong_sampler)
    assert min(pvalues.values()) < P_WRONG, pvalues


# ---------------------------------------------------------------------------------------------
# Random numbers and reproducibility
# ---------------------------------------------------------------------------------------------


def test_same_generators_give_the_same_result(mixed_batch):
    for seed in range(3):
        a, b = rejection_sample(mixed_batch(seed)), rejection_sample(mixed_batch(seed))
        assert torch.equal(a.output_token_ids, b.output_token_ids)
        assert torch.equal(a.num_accepted, b.num_accepted)


def test_a_seeded_request_draws_the_same_randoms_whatever_else_is_in_the_batch():
    vocab = 9
    alone_u, alone_e = draw_rejection_randoms(torch.tensor([3]), vocab, [torch.Generator().manual_seed(42)])
    lens = torch.tensor([2, 3, 0])
    generators = [None, torch.Generator().manual_seed(42), torch.Generator().manual_seed(1)]
    u, e = draw_rejection_randoms(lens, vocab, generators)
    assert u.shape == (5,) and e.shape == (3, vocab)
    assert torch.equal(u[2:5], alone_u) and torch.equal(e[1], alone_e[0])
    assert ((u >= 0) & (u < 1)).all() and (e >= 0).all()


def test_greedy_requests_draw_no_exponentials_and_leave_the_others_streams_alone():
    """Greedy rows never read their noise: drawing a vocabulary of it per round was ~1 ms of a
    ~14 ms CPU decoding step. Their rows are ones; a seeded sampled request beside them still
    gets exactly its own stream."""
    vocab = 9
    alone_u, alone_e = draw_rejection_randoms(torch.tensor([3]), vocab, [torch.Generator().manual_seed(42)])
    greedy_gen = torch.Generator().manual_seed(7)
    lens = torch.tensor([2, 3])
    u, e = draw_rejection_randoms(lens, vocab, [greedy_gen, torch.Generator().manual_seed(42)], greedy=[True, False])
    assert torch.equal(e[0], torch.ones(vocab)) and torch.equal(e[1], alone_e[0]) and torch.equal(u[2:], alone_u)
    assert torch.equal(greedy_gen.get_state(), torch.Generator().manual_seed(7).get_state())  # not consumed
    state = torch.get_rng_state()
    _, e = draw_rejection_randoms(torch.tensor([1, 4]), vocab, [None, None], greedy=[True, True])
    assert torch.equal(e, torch.ones(2, vocab))
    assert torch.equal(state, torch.get_rng_state())  # an all-greedy round draws nothing at all
    with pytest.raises(ValueError, match="one greedy flag per request"):
        draw_rejection_randoms(lens, vocab, [None, None], greedy=[True])


def _inverse_cdf_exponentials(n: int, gen: torch.Generator) -> torch.Tensor:  # [n] fp32
    """The definition of the sampler's Exp(1) draws: -log(1 - u), u 53-bit uniforms."""
    return (-torch.log1p(-torch.rand(n, dtype=torch.float64, generator=gen))).float()


def test_noise_on_a_narrow_support_is_each_seeded_requests_own_stream_and_ones_elsewhere(compact_race):
    vocab = 9
    support = torch.zeros(3, vocab, dtype=torch.bool)
    support[0, [1, 4]] = True
    support[1, [0, 2, 3, 8]] = True
    support[2, 5] = True
    alone = torch.Generator().manual_seed(42)
    torch.rand(3, generator=alone)  # its uniforms come first
    expected = _inverse_cdf_exponentials(4, alone)
    lens = torch.tensor([2, 3, 0])
    generators = [None, torch.Generator().manual_seed(42), torch.Generator().manual_seed(1)]
    u = draw_uniforms(lens, generators)
    e = draw_exp_noise(vocab, generators, device="cpu", support=support)
    assert torch.equal(e[1, [0, 2, 3, 8]], expected)
    assert torch.equal(e[~support], torch.ones(int((~support).sum())))
    assert (e[support] >= 0).all() and u.shape == (5,)
    u_old, _ = draw_rejection_randoms(lens, vocab, [None, torch.Generator().manual_seed(42), None])
    assert torch.equal(u_old[2:], u[2:])  # the uniforms are the stream draw_rejection_randoms gives
    # the compact form holds the same draws from the same streams
    seeded = torch.Generator().manual_seed(42)
    torch.rand(3, generator=seeded)  # its uniforms, as above
    race = draw_race_noise(support, [torch.Generator().manual_seed(5), seeded, torch.Generator().manual_seed(1)])
    assert torch.equal(race.dense_noise(vocab)[1], e[1])
    with pytest.raises(ValueError, match="support must be"):
        draw_exp_noise(vocab, generators, device="cpu", support=support[:2])


def test_a_request_with_a_wide_support_draws_a_whole_vocabulary_whatever_the_batch():
    """Temperature alone: the support is (nearly) every token, and the request draws Exp(1) for
    every id of the vocabulary, from its own stream after its uniforms, beside narrow requests
    or alone; its neighbour's support does not change a single draw."""
    vocab = 64  # wide: more than 64 // 8 = 8 tokens
    wide = torch.ones(vocab, dtype=torch.bool)
    wide[[3, 17]] = False  # p_t underflowed there: still a whole row
    narrow = torch.zeros(vocab, dtype=torch.bool)
    narrow[[2, 9, 40]] = True
    alone = torch.Generator().manual_seed(3)
    expected = _inverse_cdf_exponentials(vocab, alone)
    for neighbour in (narrow, wide):
        e = draw_exp_noise(vocab, [torch.Generator().manual_seed(8), torch.Generator().manual_seed(3)], device="cpu",
                           support=torch.stack([neighbour, wide]))
        assert torch.equal(e[1], expected)
    assert rejection_sampler.wide_supports(torch.stack([narrow, wide])) == [False, True]
    with pytest.raises(ValueError, match="narrow supports only"):
        draw_race_noise(wide.unsqueeze(0), [None])


def test_the_exponentials_are_exp1_distributed():
    """Kolmogorov-Smirnov against Exp(1) on 200,000 draws, and the mean; the inverse CDF's
    power check: uniforms passed through unchanged fail it."""
    e = exponentials(200_000, torch.Generator().manual_seed(0), device="cpu")
    assert e.dtype == torch.float32 and (e >= 0).all()
    e = e.double()
    assert kstest(e.numpy(), "expon").pvalue > 1e-3
    assert abs(float(e.mean()) - 1.0) < 0.01
    u = torch.rand(200_000, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    assert kstest(u.numpy(), "expon").pvalue < 1e-6


@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "sparse"])
def test_the_batched_torch_path_emits_exactly_the_references_tokens(sparse):
    """Same batch, same random numbers: token for token, count for count (many random rounds of
    greedy, plain, top-k and top-p requests, some without drafts)."""
    for seed in range(60):
        prep = prepare_batch(make_mixed_batch(seed, num_requests=1 + seed % 9, sparse=sparse))
        ref, fast = rejection_sample_reference(prep), rejection_sample_batched(prep)
        assert torch.equal(fast.output_token_ids, ref.output_token_ids), seed
        assert torch.equal(fast.num_accepted, ref.num_accepted), seed


def test_the_batched_torch_path_matches_the_reference_on_the_edge_cases(batch_of):
    """An all-zero residual (its fallback), zero noise (infinite scores: lowest id wins), ties."""
    vocab = rounding_vocab(40)
    p_t = logits_to_probs(torch.zeros(1, vocab), temperature=1.0)
    all_zero_residual = (SAMPLED, [3], torch.zeros(2, vocab), p_t.clone())
    tie = (GREEDY, [2, 5], torch.tensor([[0.0] * 2 + [1.0] * (vocab - 2)] * 3), None)
    noise = torch.ones(3, vocab)
    noise[0, 7] = noise[0, 9] = 0.0
    for requests in ([all_zero_residual, tie], [tie, all_zero_residual, (SAMPLED, [], torch.zeros(1, vocab), None)]):
        batch = batch_of(requests, uniforms=torch.full((3,), LAST_UNIFORM_BELOW_ONE), exp_noise=noise[: len(requests)])
        prep = prepare_batch(batch)
        ref, fast = rejection_sample_reference(prep), rejection_sample_batched(prep)
        assert torch.equal(fast.output_token_ids, ref.output_token_ids)
        assert torch.equal(fast.num_accepted, ref.num_accepted)


@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "sparse"])
def test_noise_outside_the_support_is_never_read(sparse):
    """The claim behind drawing noise on the support only (docs/method.md §1): whatever sits
    outside it, even zeros (infinite scores if they were read), the tokens are the same."""
    for seed in range(30):
        batch = make_mixed_batch(seed, sparse=sparse)
        prep = prepare_batch(batch)
        support = noise_support(prep)
        on_support = torch.where(support, prep.exp_noise, 1.0)
        poisoned = torch.where(support, prep.exp_noise, 0.0)
        a = rejection_sample_batched(replace(prep, exp_noise=on_support))
        b = rejection_sample_batched(replace(prep, exp_noise=poisoned))
        assert torch.equal(a.output_token_ids, b.output_token_ids), seed
        assert torch.equal(a.output_token_ids, rejection_sample_reference(replace(prep, exp_noise=poisoned)).output_token_ids)


@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "sparse"])
def test_the_compact_race_emits_exactly_the_tokens_of_the_race_on_whole_rows(sparse, compact_race):
    """prepare_batch without exp_noise keeps each request's noise on its support only
    (RaceSupport); the batched path then races on those columns and must emit what the
    reference emits with the same noise spread over whole rows (1 outside the support)."""
    raced = 0
    for seed in range(60):
        batch = make_mixed_batch(seed, num_requests=1 + seed % 9, sparse=sparse)
        gens = [torch.Generator().manual_seed(seed * 100 + r) for r in range(batch.num_requests)]
        prep = prepare_batch(replace(batch, exp_noise=None, noise_generators=gens))
        assert prep.race is not None and prep.exp_noise is None
        raced += int(prep.race.valid.any())
        ref, fast = rejection_sample_reference(prep), rejection_sample_batched(prep)
        assert torch.equal(fast.output_token_ids, ref.output_token_ids), seed
        assert torch.equal(fast.num_accepted, ref.num_accepted), seed
        copies = [torch.Generator().manual_seed(seed * 100 + r) for r in range(batch.num_requests)]
        by_hand = draw_exp_noise(batch.vocab_size, copies, device="cpu", greedy=prep.is_greedy.tolist(),
                                 support=noise_support(prep))
        assert torch.equal(dense_exp_noise(prep), by_hand), seed  # the same draws in the same places
    assert raced > 40  # most rounds had sampled requests


def test_the_compact_race_never_reads_its_padding(compact_race):
    """Padding columns hold id 0 and noise 1; give them a zero noise (an infinite score) and the
    likeliest token's id instead, and nothing may change."""
    for seed in range(30):
        batch = make_mixed_batch(seed)
        gens = [torch.Generator().manual_seed(seed * 100 + r) for r in range(batch.num_requests)]
        prep = prepare_batch(replace(batch, exp_noise=None, noise_generators=gens))
        race = prep.race
        likeliest = prep.target.argmax(-1)[prep.cu_num_draft[:-1] + torch.arange(batch.num_requests)]  # [R]
        poisoned = replace(race, ids=torch.where(race.valid, race.ids, likeliest[:, None]),
                           noise=torch.where(race.valid, race.noise, 0.0))
        a = rejection_sample_batched(prep)
        b = rejection_sample_batched(replace(prep, race=poisoned))
        assert torch.equal(a.output_token_ids, b.output_token_ids), seed


def test_a_wide_support_races_on_whole_rows_with_the_same_draws():
    """Temperature alone gives every token mass: past 1/8 of the vocabulary the noise is kept as
    whole rows (gathering would only add passes), drawn from the same streams."""
    batch = make_mixed_batch(3)
    gens = [torch.Generator().manual_seed(r) for r in range(batch.num_requests)]
    prep = prepare_batch(replace(batch, exp_noise=None, noise_generators=gens))
    assert prep.race is None and prep.exp_noise is not None
    copies = [torch.Generator().manual_seed(r) for r in range(batch.num_requests)]
    by_hand = draw_exp_noise(batch.vocab_size, copies, device="cpu", greedy=prep.is_greedy.tolist(),
                             support=noise_support(prep))
    assert torch.equal(prep.exp_noise, by_hand)


def test_a_batch_without_noise_draws_it_on_each_requests_support():
    """exp_noise None: the sampler draws after its uniforms, on noise_support, from each
    request's generator; the same as drawing it by hand with copies of those generators."""
    for seed in range(10):
        batch = make_mixed_batch(seed)
        gens = [torch.Generator().manual_seed(seed * 100 + r) for r in range(batch.num_requests)]
        copies = [torch.Generator().manual_seed(seed * 100 + r) for r in range(batch.num_requests)]
        lazy = rejection_sample(replace(batch, exp_noise=None, noise_generators=gens))
        prep = prepare_batch(batch)
        noise = draw_exp_noise(batch.vocab_size, copies, device="cpu", greedy=prep.is_greedy.tolist(),
                               support=noise_support(prep))
        by_hand = rejection_sample_reference(replace(prep, exp_noise=noise))
        assert torch.equal(lazy.output_token_ids, by_hand.output_token_ids), seed
    with pytest.raises(ValueError, match="noise_generators must hold one generator"):
        rejection_sample(replace(make_mixed_batch(0), exp_noise=None))


# ---------------------------------------------------------------------------------------------
# Validation at the boundary
# ---------------------------------------------------------------------------------------------


def _small_batch(batch_of) -> RejectionBatch:
    target = _logits([0.2, 0.3, 0.5], [0.2, 0.3, 0.5], [0.2, 0.3, 0.5])
    return batch_of([(SAMPLED, [1, 2], target, torch.tensor([[0.3, 0.3, 0.4], [0.1, 0.1, 0.8]]))])


def test_the_small_valid_batch_is_accepted(batch_of):
    """The batch every malformed case below breaks in one way is itself valid."""
    result = rejection_sample(_small_batch(batch_of))
    n_acc = int(result.num_accepted[0])
    assert result.output_token_ids.shape == (1, 3) and 0 <= n_acc <= 2
    assert result.output_token_ids[0, :n_acc].tolist() == [1, 2][:n_acc] and 0 <= result.output_token_ids[0, n_acc] < 3


def _dense(*rows: list[float]) -> DraftProbs:
    return DraftProbs(dense=torch.tensor(rows))


def _sparse(ids: list[list[int]]) -> DraftProbs:  # two entries of 0.5 per row
    return DraftProbs(sparse_ids=torch.tensor(ids), sparse_probs=torch.full((len(ids), 2), 0.5))


MALFORMED = {  # what is wrong: (how to break the small batch, what the message must say)
    "row sums to 1.1": (lambda b: replace(b, draft_probs=DraftProbs(dense=b.draft_probs.dense * 1.1)), "sum to 1"),
    "negative prob": (lambda b: replace(b, draft_probs=_dense([1.2, -0.2, 0.0], [0.1, 0.1, 0.8])), "non-negative"),
    "p_d(x) = 0": (lambda b: replace(b, draft_probs=_dense([0.5, 0.0, 0.5], [0.1, 0.1, 0.8])), "p_d\\(x\\) = 0"),
    "token id = vocab": (lambda b: replace(b, draft_token_ids=torch.tensor([1, 3])), "must be in \\[0, 3\\)"),
    "token id < 0": (lambda b: replace(b, draft_token_ids=torch.tensor([1, -1])), "draft_token_ids must be in"),
    "too few draft ids": (
        lambda b: replace(b, draft_token_ids=torch.tensor([1])),
        "draft_token_ids must be integer \\[num_draft_tokens\\] = \\[2\\]",
    ),
    "too few target rows": (lambda b: replace(b, target_logits=b.target_logits[:2]), "3 rows, got \\[2, 3\\]"),
    "lengths disagree": (lambda b: replace(b, num_draft_tokens=torch.tensor([3])), "draft_token_ids must be"),
    "negative length": (lambda b: replace(b, num_draft_tokens=torch.tensor([-1])), ">= 0"),
    "params per request": (lambda b: replace(b, params=[SAMPLED, SAMPLED]), "one SamplingParams per request"),
    "uniforms shape": (lambda b: replace(b, uniforms=torch.rand(3)), "uniforms must be float \\[num_draft_tokens\\]"),
    "uniform = 1": (lambda b: replace(b, uniforms=torch.tensor([0.5, 1.0])), "uniforms must lie in \\[0, 1\\)"),
    "exp_noise shape": (lambda b: replace(b, exp_noise=torch.ones(1, 4)), "exp_noise must be float \\[num_req"),
    "negative noise": (lambda b: replace(b, exp_noise=-torch.ones(1, 3)), "exp_noise must be >= 0"),
    "no draft probs": (lambda b: replace(b, draft_probs=None), "draft_probs is None"),
    "dense shape": (lambda b: replace(b, draft_probs=DraftProbs(dense=b.draft_probs.dense[:1])), "dense draft probs"),
    "no finite logit": (lambda b: replace(b, target_logits=torch.full((3, 3), NEG_INF)), "NaN"),
    "sparse id = vocab": (lambda b: replace(b, draft_probs=_sparse([[1, 5], [2, 0]])), "sparse_ids must be in"),
    "padding with mass": (lambda b: replace(b, draft_probs=_sparse([[1, -1], [2, 0]])), "padding"),
    "sparse p_d(x) = 0": (lambda b: replace(b, draft_probs=_sparse([[0, 2], [2, 0]])), "p_d\\(x\\) = 0"),
}


@pytest.mark.parametrize("mutate, message", MALFORMED.values(), ids=MALFORMED.keys())
def test_malformed_batches_raise_value_errors_that_say_what_is_wrong(batch_of, mutate, message):
    with pytest.raises(ValueError, match=message):
        rejection_sample(mutate(_small_batch(batch_of)))


def test_draft_probs_need_exactly_one_representation():
    with pytest.raises(ValueError, match="exactly one"):
        DraftProbs()
    with pytest.raises(ValueError, match="exactly one"):
        DraftProbs(dense=torch.ones(1, 2) / 2, sparse_ids=torch.zeros(1, 1, dtype=int), sparse_probs=torch.ones(1, 1))
    with pytest.raises(ValueError, match="both"):
        DraftProbs(sparse_ids=torch.zeros(1, 1, dtype=torch.int64))


def test_unknown_backend_raises(batch_of):
    with pytest.raises(ValueError, match="backend"):
        rejection_sample(_small_batch(batch_of), backend="cuda")


def test_negative_temperature_is_refused_when_the_params_are_built():
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1.0)
