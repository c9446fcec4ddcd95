"""The speculative engine is lossless: whatever the drafter proposes, greedy output is plain
greedy decoding token for token, and sampled output has exactly the target's distribution.

Fast tests run a tiny random model; every speculative test asserts that drafts were made and
accepted (and rejected, where that path matters), so none can pass vacuously. The slow test at
the end runs the real default model on HumanEval prompts.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from dspark.drafters.base import Drafter, DrafterSpec, DraftProposal, DraftRequest
from dspark.drafters.ngram import NgramDrafter
from dspark.engine.speculative import GenerationRequest, RequestState, SpeculativeEngine
from dspark.evaluation.prompts import load_first_turns
from tests.distribution_checks import chi_square_pvalue, exact_sequence_probs
from dspark.model.kv_cache import KVBudgetExceeded
from dspark.sampling.params import SamplingParams

GREEDY = SamplingParams(temperature=0.0)

_g = torch.Generator().manual_seed(1234)
PROMPTS = [  # token ids for the tiny model (vocab 256): repetitive ones, random ones, one token
    [5, 6, 7, 8] * 4,
    [1, 2, 3, 1, 2, 3, 1, 2],
    torch.randint(0, 256, (13,), generator=_g).tolist(),
    [42],
    torch.randint(0, 256, (40,), generator=_g).tolist(),
    [9, 9, 9, 200, 9, 9, 9, 200, 9, 9],
]


# ---- test drafters ------------------------------------------------------------------------


class RandomTokenDrafter(Drafter):
    """Proposes uniformly random tokens as point masses: nearly always wrong."""

    spec = DrafterSpec(name="random")

    def __init__(self, vocab_size: int, seed: int):
        self.vocab_size = vocab_size
        self.generator = torch.Generator().manual_seed(seed)

    def propose(self, requests: list[DraftRequest]) -> list[DraftProposal]:
        return [
            DraftProposal.point_mass(torch.randint(0, self.vocab_size, (r.max_draft_tokens,), generator=self.generator).tolist())
            if r.max_draft_tokens else DraftProposal.empty()
            for r in requests
        ]


class OracleDrafter(Drafter):
    """Proposes the known greedy continuation of each prompt: every draft is right."""

    spec = DrafterSpec(name="oracle")

    def __init__(self, continuations: dict[tuple[int, ...], list[int]]):
        self.continuations = continuations

    def propose(self, requests: list[DraftRequest]) -> list[DraftProposal]:
        out = []
        for r in requests:
            reference = self.continuations[tuple(r.token_ids[: r.num_prompt_tokens])]
            done = len(r.token_ids) - r.num_prompt_tokens
            draft = reference[done : done + r.max_draft_tokens]
            out.append(DraftProposal.point_mass(draft) if draft else DraftProposal.empty())
        return out


class FixedDistributionDrafter(Drafter):
    """Samples every draft token iid from one fixed p_d (sparse: `ids` with `probs`), and
    reports that row: the rejection sampler must then correct towards the target exactly."""

    spec = DrafterSpec(name="fixed-distribution")

    def __init__(self, ids: list[int], probs: torch.Tensor, seed: int):
        self.ids = torch.tensor(ids, dtype=torch.long)  # [k]
        self.probs = probs.float()  # [k], sums to 1
        self.generator = torch.Generator().manual_seed(seed)
        self.proposed = 0

    def propose(self, requests: list[DraftRequest]) -> list[DraftProposal]:
        counts = [r.max_draft_tokens for r in requests]
        # one draw for the whole batch (thousands of requests), split per request
        picks = torch.multinomial(self.probs, sum(counts), replacement=True, generator=self.generator) if sum(counts) else torch.empty(0, dtype=torch.long)
        out = []
        for chunk, n in zip(picks.split(counts), counts):
            if n == 0:
                out.append(DraftProposal.empty())
                continue
            out.append(DraftProposal(
                token_ids=self.ids[chunk],
                prob_ids=self.ids.expand(n, -1).clone(),
                probs=self.probs.expand(n, -1).clone(),
            ))
        self.proposed += sum(counts)
        return out


# ---- helpers ------------------------------------------------------------------------------


def _generate(runtime, drafter, prompts, *, max_new_tokens=32, params=GREEDY, gamma=5, stop=frozenset(), prefix="r") -> list[RequestState]:
    engine = SpeculativeEngine(runtime, drafter, num_speculative_tokens=gamma)
    max_new = max_new_tokens if isinstance(max_new_tokens, list) else [max_new_tokens] * len(prompts)
    params = params if isinstance(params, list) else [params] * len(prompts)
    states = engine.generate([
        GenerationRequest(f"{prefix}{i}", p, n, q, stop_token_ids=frozenset(stop))
        for i, (p, n, q) in enumerate(zip(prompts, max_new, params))
    ])
    assert not engine.has_unfinished
    return states


def _plain_alone(runtime, prompts, **kwargs) -> list[list[int]]:
    """Plain decoding (no drafter), one request at a time: the reference output."""
    return [_generate(runtime, None, [p], **kwargs)[0].output_ids for p in prompts]


def _totals(states: list[RequestState]) -> tuple[int, int]:
    return sum(s.draft_tokens for s in states), sum(s.accepted_tokens for s in states)


# ---- greedy: speculative == plain, token for token ----------------------------------------


@pytest.mark.parametrize("gamma", [1, 3, 7])
def test_greedy_speculative_decoding_with_the_ngram_drafter_equals_plain_decoding(tiny_runtime, gamma):
    expected = _plain_alone(tiny_runtime, PROMPTS, max_new_tokens=40)
    states = _generate(tiny_runtime, NgramDrafter(), PROMPTS, max_new_tokens=40, gamma=gamma)
    assert [s.output_ids for s in states] == expected
    drafted, accepted = _totals(states)
    assert accepted > 0 and drafted > accepted  # drafts were accepted, and some rejected
    assert all(s.finish_reason == "length" for s in states)


def test_greedy_output_is_unchanged_by_a_drafter_that_proposes_random_tokens(tiny_runtime):
    expected = _plain_alone(tiny_runtime, PROMPTS, max_new_tokens=30)
    states = _generate(tiny_runtime, RandomTokenDrafter(256, seed=0), PROMPTS, max_new_tokens=30, gamma=4)
    assert [s.output_ids for s in states] == expected
    drafted, accepted = _totals(states)
    assert drafted > 100 and accepted < drafted / 4  # many drafts, nearly all rejected


def test_a_perfect_drafter_has_every_draft_accepted_and_changes_nothing(tiny_runtime):
    expected = _plain_alone(tiny_runtime, PROMPTS, max_new_tokens=30)
    oracle = OracleDrafter({tuple(p): out for p, out in zip(PROMPTS, expected)})
    states = _generate(tiny_runtime, oracle, PROMPTS, max_new_tokens=30, gamma=4)
    assert [s.output_ids for s in states] == expected
    for s in states:
        assert s.accepted_tokens == s.draft_tokens == 29 - s.rounds  # every round: its drafts + one bonus
        assert s.rounds == 6  # 29 tokens after the prefill, in rounds of 5, 5, 5, 5, 5, 4
        assert s.mean_accepted_length == pytest.approx(29 / 6)


# ---- request lifecycle --------------------------------------------------------------------


@pytest.mark.parametrize("drafter", [None, "ngram"])
def test_max_new_tokens_is_respected_exactly(tiny_runtime, drafter):
    longest = _plain_alone(tiny_runtime, PROMPTS[:3], max_new_tokens=23)
    for max_new in (1, 2, 3, 8, 23):
        states = _generate(tiny_runtime, NgramDrafter() if drafter else None, PROMPTS[:3], max_new_tokens=max_new, gamma=7)
        for s, full in zip(states, longest):
            assert s.output_ids == full[:max_new]
            assert s.finish_reason == "length"


@pytest.mark.parametrize("drafter", ["plain", "ngram", "oracle"])
def test_a_stop_token_ends_the_request_and_is_kept_in_the_output(tiny_runtime, drafter):
    prompts = [PROMPTS[1], PROMPTS[4]]
    full = _plain_alone(tiny_runtime, prompts, max_new_tokens=40)
    # stop at the first change of token in each output: a token that appears there for the first time
    stops = {}
    for p, out in zip(prompts, full):
        k = next(i for i in range(1, len(out)) if out[i] != out[i - 1] and out[i] not in out[:i])
        stops[tuple(p)] = (k, out[k])
    for p, out in zip(prompts, full):
        k, stop = stops[tuple(p)]
        d = {"plain": None, "ngram": NgramDrafter(), "oracle": OracleDrafter({tuple(p): out})}[drafter]
        (state,) = _generate(tiny_runtime, d, [p], max_new_tokens=40, gamma=6, stop={stop})
        assert state.output_ids == out[: k + 1]
        assert state.finish_reason == "stop"
    assert tiny_runtime.kv.reserved_tokens == 0


def test_several_requests_of_different_lengths_in_one_engine_all_complete_as_if_alone(tiny_runtime):
    max_new = [1, 7, 40, 13, 25, 2]
    expected = [out[:n] for out, n in zip(_plain_alone(tiny_runtime, PROMPTS, max_new_tokens=40), max_new)]
    states = _generate(tiny_runtime, NgramDrafter(), PROMPTS, max_new_tokens=max_new, gamma=5)
    assert [s.output_ids for s in states] == expected
    assert [len(s.output_ids) for s in states] == max_new
    assert _totals(states)[1] > 0


def test_a_request_admitted_while_others_are_decoding_gets_the_same_tokens(tiny_runtime):
    """Continuous batching: its prefill shares a forward with the others' verification."""
    expected = _plain_alone(tiny_runtime, PROMPTS[:3], max_new_tokens=30)
    engine = SpeculativeEngine(tiny_runtime, NgramDrafter(), num_speculative_tokens=4)
    states = {}
    for i, p in enumerate(PROMPTS[:3]):
        engine.add_request(GenerationRequest(f"r{i}", p, 30, GREEDY))
        states[i] = engine.running[f"r{i}"]
        for _ in range(3):
            engine.step()
    while engine.has_unfinished:
        engine.step()
    assert [states[i].output_ids for i in range(3)] == expected
    assert sum(s.accepted_tokens for s in states.values()) > 0


def test_step_reports_the_tokens_each_request_emitted(tiny_runtime):
    engine = SpeculativeEngine(tiny_runtime, NgramDrafter(), num_speculative_tokens=4)
    engine.add_request(GenerationRequest("a", PROMPTS[0], 12, GREEDY))
    state = engine.running["a"]
    streamed, reasons = [], []
    while engine.has_unfinished:
        (out,) = engine.step()
        assert out.request_id == "a" and 1 <= len(out.new_token_ids) <= 5
        streamed += out.new_token_ids
        reasons.append(out.finish_reason)
    assert streamed == state.output_ids and len(streamed) == 12
    assert reasons[-1] == "length" and set(reasons[:-1]) == {None}
    assert state.first_token_time is not None


def test_kv_is_freed_when_requests_finish_or_are_aborted(tiny_runtime):
    _generate(tiny_runtime, NgramDrafter(), PROMPTS, max_new_tokens=[3, 9, 1, 30, 12, 5])
    assert tiny_runtime.kv.reserved_tokens == 0 and not tiny_runtime.kv.requests

    engine = SpeculativeEngine(tiny_runtime, NgramDrafter())
    engine.add_request(GenerationRequest("a", PROMPTS[0], 50, GREEDY))
    engine.add_request(GenerationRequest("b", PROMPTS[1], 50, GREEDY))
    assert tiny_runtime.kv.reserved_tokens == len(PROMPTS[0]) + len(PROMPTS[1]) + 100
    engine.step()
    engine.abort("a")
    assert engine.running.keys() == {"b"} and not tiny_runtime.has_request("a")
    engine.abort("a")  # already gone: nothing to do
    while engine.has_unfinished:
        engine.step()
    assert tiny_runtime.kv.reserved_tokens == 0


def test_a_request_that_does_not_fit_the_kv_budget_is_refused_without_side_effects(tiny_runtime_factory):
    runtime = tiny_runtime_factory(kv_budget_tokens=60)
    engine = SpeculativeEngine(runtime, NgramDrafter())
    engine.add_request(GenerationRequest("a", PROMPTS[0], 40, GREEDY))  # 16 + 40 tokens
    with pytest.raises(KVBudgetExceeded):
        engine.add_request(GenerationRequest("b", PROMPTS[1], 40, GREEDY))
    assert engine.running.keys() == {"a"} and runtime.kv.reserved_tokens == 56
    while engine.has_unfinished:
        engine.step()
    engine.add_request(GenerationRequest("b", PROMPTS[1], 40, GREEDY))  # admitted once "a" is done


# ---- bad input ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "prompt, max_new_tokens, message",
    [
        ([], 5, "the prompt is empty"),
        ([1] * 500, 13, r"prompt \(500 tokens\) \+ max_new_tokens \(13\) = 513 exceeds the context window of 512"),
        ([1, 256, 3], 5, r"prompt token ids must be in \[0, 256\), got \[256\]"),
        ([1, -1, 3], 5, r"prompt token ids must be in \[0, 256\), got \[-1\]"),
        ([1, 2, 3], 0, "max_new_tokens must be >= 1, got 0"),
        ([1, 2, 3], -4, "max_new_tokens must be >= 1, got -4"),
    ],
)
def test_bad_requests_are_rejected_with_a_value_error_before_anything_is_reserved(tiny_runtime, prompt, max_new_tokens, message):
    engine = SpeculativeEngine(tiny_runtime, NgramDrafter())
    with pytest.raises(ValueError, match=message):
        engine.add_request(GenerationRequest("bad", prompt, max_new_tokens, GREEDY))
    assert not engine.running and tiny_runtime.kv.reserved_tokens == 0


def test_a_request_exactly_filling_the_context_window_is_served(tiny_runtime):
    (state,) = _generate(tiny_runtime, NgramDrafter(), [[1] * 500], max_new_tokens=12)
    assert len(state.output_ids) == 12


@pytest.mark.parametrize("temperature", [-0.5, float("nan")])
def test_a_negative_or_nan_temperature_is_a_value_error(temperature):
    with pytest.raises(ValueError, match="temperature must be 0 \\(greedy\\) or a finite number"):
        SamplingParams(temperature=temperature)


def test_a_request_id_already_running_is_rejected(tiny_runtime):
    engine = SpeculativeEngine(tiny_runtime, None)
    engine.add_request(GenerationRequest("a", [1, 2], 5, GREEDY))
    with pytest.raises(ValueError, match="'a' is already running"):
        engine.add_request(GenerationRequest("a", [3, 4], 5, GREEDY))
    assert tiny_runtime.kv.reserved_tokens == 7


def test_a_negative_number_of_speculative_tokens_is_rejected(tiny_runtime):
    with pytest.raises(ValueError, match="num_speculative_tokens must be >= 0, got -1"):
        SpeculativeEngine(tiny_runtime, NgramDrafter(), num_speculative_tokens=-1)


def test_a_drafter_proposing_more_tokens_than_allowed_is_an_error(tiny_runtime):
    class Greedy(RandomTokenDrafter):
        def propose(self, requests):
            return [DraftProposal.point_mass([1] * (r.max_draft_tokens + 1)) for r in requests]

    engine = SpeculativeEngine(tiny_runtime, Greedy(256, seed=0), num_speculative_tokens=3)
    engine.add_request(GenerationRequest("a", [1, 2], 10, GREEDY))
    engine.step()  # prefill: the drafter is not asked
    with pytest.raises(RuntimeError, match="proposed 4 > 3 tokens"):
        engine.step()


# ---- sampling -----------------------------------------------------------------------------


@pytest.mark.parametrize("drafter", [None, "ngram"])
def test_seeded_sampling_is_reproducible_and_independent_of_the_rest_of_the_batch(tiny_runtime, drafter):
    make = lambda: NgramDrafter() if drafter else None  # noqa: E731
    params = SamplingParams(temperature=1.0, seed=2024)
    seeded = PROMPTS[5]
    alone = _generate(tiny_runtime, make(), [seeded], max_new_tokens=40, params=params)[0]
    again = _generate(tiny_runtime, make(), [seeded], max_new_tokens=40, params=params)[0]
    assert again.output_ids == alone.output_ids

    others = [SamplingParams(temperature=1.0, seed=7), GREEDY, SamplingParams(temperature=0.7, top_k=20, seed=8), SamplingParams(temperature=1.0)]
    crowd = _generate(
        tiny_runtime, make(), PROMPTS[1:5] + [seeded], max_new_tokens=[10, 40, 25, 3, 40], params=others + [params]
    )
    assert crowd[-1].output_ids == alone.output_ids
    if drafter:
        assert alone.draft_tokens > 0 and alone.accepted_tokens > 0

    outputs = {tuple(_generate(tiny_runtime, make(), [seeded], max_new_tokens=20, params=SamplingParams(temperature=1.0, seed=s))[0].output_ids) for s in range(5)}
    assert len(outputs) > 1  # the seed matters: temperature 1 does sample


@pytest.mark.parametrize("drafter", ["plain", "fixed-distribution"])
def test_sampled_tokens_have_exactly_the_target_distribution_whatever_the_draft_distribution(tiny_runtime_factory, drafter):
    """Temperature 1 on a vocab-8 model: the joint distribution of the first three tokens
    (prefill sample, then a round verifying 2 drafts from a fixed p_d far from the target, which
    leaves out 2 tokens entirely) matches the exact target distribution by chi-square."""
    runtime = tiny_runtime_factory(vocab_size=8, num_layers=1, embed_std=0.12, compute_dtype=torch.float32, seed=11)
    prompt, num_samples, num_tokens = [3, 1, 4, 1, 5], 3000, 3
    exact = exact_sequence_probs(runtime, prompt, num_tokens)
    first = {}
    for seq, p in exact.items():
        first[seq[:1]] = first.get(seq[:1], 0.0) + p
    assert max(first.values()) < 0.6  # a spread-out target, not a point mass

    p_d_ids = [0, 2, 3, 5, 6, 7]
    p_d = torch.softmax(1.5 * torch.randn(6, generator=torch.Generator().manual_seed(3)), 0)
    d = FixedDistributionDrafter(p_d_ids, p_d, seed=5) if drafter != "plain" else None
    engine = SpeculativeEngine(runtime, d, num_speculative_tokens=2)
    states = engine.generate([
        GenerationRequest(f"s{i}", prompt, num_tokens + 1, SamplingParams(temperature=1.0, seed=i))
        for i in range(num_samples)
    ])
    samples = Counter(tuple(s.output_ids[:num_tokens]) for s in states)
    if d is not None:
        drafted, accepted = _totals(states)
        assert drafted >= 2 * num_samples and 0.1 * drafted < accepted < 0.9 * drafted

    p_three = chi_square_pvalue(samples, exact, num_samples)
    two = Counter()
    exact_two: dict[tuple[int, ...], float] = {}
    for seq, p in exact.items():
        exact_two[seq[:2]] = exact_two.get(seq[:2], 0.0) + p
    for seq, c in samples.items():
        two[seq[:2]] += c
    p_two = chi_square_pvalue(two, exact_two, num_samples)
    print(f"\n{drafter}: chi-square p = {p_three:.3f} (first 3 tokens), {p_two:.3f} (first 2)")
    assert p_three > 1e-3 and p_two > 1e-3
    assert runtime.kv.reserved_tokens == 0


# ---- the real default model (slow) --------------------------------------------------------

@pytest.mark.slow
def test_greedy_ngram_speculation_on_humaneval_equals_plain_greedy_on_the_default_model(real_runtime, real_tokenizer):
    prompts = [real_tokenizer.encode_chat([{"role": "user", "content": text}]) for text in load_first_turns("humaneval", limit=4)]
    kwargs = dict(max_new_tokens=64, stop=real_tokenizer.eos_token_ids)
    plain = _generate(real_runtime, None, prompts, prefix="humaneval-plain-", **kwargs)
    spec = _generate(real_runtime, NgramDrafter(), prompts, gamma=5, prefix="humaneval-ngram-", **kwargs)
    for p, s in zip(plain, spec):
        assert s.output_ids == p.output_ids, real_tokenizer.decode(p.output_ids)
    drafted, accepted = _totals(spec)
    print(f"\nngram on HumanEval: {accepted}/{drafted} drafts accepted, "
          f"tau={[round(s.mean_accepted_length, 2) for s in spec]}, "
          f"rounds {sum(s.rounds for s in spec)} vs plain {sum(s.rounds for s in plain)}")
    assert accepted > 0
    assert real_runtime.kv.reserved_tokens == 0
