"""A serving drafter inside the speculative engine: the checks every drafter's tests run (greedy
output equals plain decoding, sampled output has exactly the target's distribution, the drafter's
per-request state follows the verified positions), built on tests/distribution_checks.py."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator

from dspark.engine.speculative import GenerationRequest, RequestState, SpeculativeEngine
from dspark.sampling.params import SamplingParams
from tests.distribution_checks import P_PASS, exact_sequence_probs, losslessness_pvalue

GREEDY = SamplingParams(temperature=0.0)


def totals(states) -> tuple[int, int]:
    """(draft tokens proposed, draft tokens accepted) over the finished requests."""
    return sum(s.draft_tokens for s in states), sum(s.accepted_tokens for s in states)


def greedy_plain_and_speculative(runtime, drafter, prompts: list[list[int]], *, max_tokens: int = 24):
    """The finished states of greedy decoding of `prompts`, without a drafter and with `drafter` (γ = 4)."""
    plain = SpeculativeEngine(runtime, None).generate(
        [GenerationRequest(f"p{i}", p, max_tokens, GREEDY) for i, p in enumerate(prompts)])
    spec = SpeculativeEngine(runtime, drafter, num_speculative_tokens=4).generate(
        [GenerationRequest(f"s{i}", p, max_tokens, GREEDY) for i, p in enumerate(prompts)])
    return plain, spec


def sample_continuations(engine: SpeculativeEngine, prompt: list[int], *, num_samples: int, num_tokens: int,
                         temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0) -> tuple[Counter, int, int]:
    """`num_samples` seeded continuations of `prompt` (seeds 0..n-1) through `engine`, in one
    batch: (counts of their first `num_tokens` tokens, drafts proposed, drafts accepted)."""
    params = lambda i: SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=i)  # noqa: E731
    states = engine.generate([GenerationRequest(f"s{i}", prompt, num_tokens + 1, params(i)) for i in range(num_samples)])
    drafted, accepted = totals(states)
    return Counter(tuple(s.output_ids[:num_tokens]) for s in states), drafted, accepted


def sampling_pvalue(runtime, drafter, *, num_samples: int, prompt=(3, 1, 4, 1, 5), num_tokens: int = 3,
                    temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0, gamma: int = 2) -> tuple[float, int, int]:
    """Seeded continuations with `drafter` (γ = `gamma`) under these settings, tested against the
    target's exact distribution under the same settings: (losslessness p-value, drafted, accepted)."""
    prompt = list(prompt)
    exact = exact_sequence_probs(runtime, prompt, num_tokens, temperature=temperature, top_k=top_k, top_p=top_p)
    engine = SpeculativeEngine(runtime, drafter, num_speculative_tokens=gamma)
    samples, drafted, accepted = sample_continuations(engine, prompt, num_samples=num_samples, num_tokens=num_tokens,
                                                      temperature=temperature, top_k=top_k, top_p=top_p)
    return losslessness_pvalue(samples, exact, num_samples), drafted, accepted


def assert_sampling_is_lossless(runtime, drafter, *, num_samples: int, prompt=(3, 1, 4, 1, 5), num_tokens: int = 3,
                                temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0) -> None:
    """Sample `num_samples` seeded continuations (γ = 2, the given temperature / top-k / top-p) with
    `drafter`: drafts were made and some but not all accepted (so the test is not vacuous), and the
    first `num_tokens` tokens pass a chi-square test against the target's exact distribution under
    the same settings (no sample outside its support)."""
    p_value, drafted, accepted = sampling_pvalue(runtime, drafter, num_samples=num_samples, prompt=prompt,
                                                 num_tokens=num_tokens, temperature=temperature, top_k=top_k, top_p=top_p)
    assert drafted >= 2 * num_samples and 0.05 * drafted < accepted < 0.95 * drafted
    assert p_value > P_PASS, f"p = {p_value}" + (": a sample outside the target's support, or far off" if p_value == 0 else "")


def steps_of_one_request(runtime, drafter, *, steps: int = 4) -> Iterator[RequestState]:
    """Greedy request "a" (prompt 5..9) through `steps` engine steps with `drafter` (γ = 4),
    yielding its state after each step; once the steps are consumed it is aborted."""
    engine = SpeculativeEngine(runtime, drafter, num_speculative_tokens=4)
    engine.add_request(GenerationRequest("a", [5, 6, 7, 8, 9], 30, GREEDY))
    for _ in range(steps):
        engine.step()
        yield engine.running["a"]
    engine.abort("a")
