"""Sampled output is exactly the target's, at any temperature and under top-k / top-p.

Specification: with a real drafter (DSpark, whose rows the request's filters truncate: sparse
rows), the first three tokens of 2,000 seeded continuations at T = 0.5, T = 1.5, top-k, top-p
and all three together pass a chi-square test against the target's exact filtered distribution,
computed independently (one target forward per prefix, `tests/distribution_checks.py`); drafts
were verified and some but not all accepted. Deliberately wrong verifiers fail the very same
test (p < 1e-6, or a sample outside the target's support): one that draws from p_t instead of
the residual max(0, p_t - p_d) after a rejection, one that ignores the temperature, ones that
ignore top-k or top-p. Significance levels: tests/distribution_checks.py.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from dspark.sampling import RejectionBatch, RejectionResult, rejection_sample
from dspark.sampling.rejection_sampler import exponential_race, prepare_batch, rejection_sample_reference
from tests.conftest import SMALL_VOCAB_RUNTIME
from tests.distribution_checks import P_PASS, P_WRONG
from tests.drafters.engine_checks import sampling_pvalue
from tests.drafters.test_dspark_serving import make_serving_drafter

NUM_SAMPLES = 2000  # every wrong verifier below gets p < 1e-29 at this size (or a sample outside the support)
SETTINGS = {
    "T0.5": {"temperature": 0.5},
    "T1.5": {"temperature": 1.5},
    "T1-top-k3": {"temperature": 1.0, "top_k": 3},
    "T1-top-p0.7": {"temperature": 1.0, "top_p": 0.7},
    "T0.7-top-k5-top-p0.8": {"temperature": 0.7, "top_k": 5, "top_p": 0.8},
}


@pytest.fixture
def small_runtime(tiny_runtime_factory):
    # 8 tokens: the 512 three-token continuations are cheap to enumerate exactly
    return tiny_runtime_factory(**SMALL_VOCAB_RUNTIME)


def pvalue(runtime, setting: str) -> float:
    """The losslessness p-value of SETTINGS[setting] with the DSpark drafter (γ = 2)."""
    p, drafted, accepted = sampling_pvalue(runtime, make_serving_drafter(runtime, seed=2, block_size=2),
                                           num_samples=NUM_SAMPLES, **SETTINGS[setting])
    assert drafted >= 2 * NUM_SAMPLES and 0.05 * drafted < accepted < 0.95 * drafted  # drafts verified, both outcomes
    return p


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_sampled_tokens_have_exactly_the_targets_distribution_under_the_requests_settings(small_runtime, setting):
    assert pvalue(small_runtime, setting) > P_PASS


# ---- deliberately wrong verifiers: the test above must reject each of them -------------------


def _draws_from_the_target_instead_of_the_residual(batch: RejectionBatch, *, backend: str = "torch") -> RejectionResult:
    """Accepts and rejects as it should, but replaces the token after a rejection by a draw from
    p_t (the same race, on p_t instead of max(0, p_t - p_d))."""
    prep = prepare_batch(batch)
    result = rejection_sample_reference(prep)
    out, cu = result.output_token_ids.clone(), prep.cu_num_draft.tolist()
    for r in range(len(cu) - 1):
        n, k = cu[r + 1] - cu[r], int(result.num_accepted[r])
        if k < n and not bool(prep.is_greedy[r]):
            p_t = prep.target[cu[r] + r + k]  # [vocab] the target row of the rejected position
            out[r, k] = exponential_race(p_t, p_t, prep.exp_noise[r])
    return RejectionResult(output_token_ids=out, num_accepted=result.num_accepted)


def _with_params(change):
    def wrong(batch: RejectionBatch, *, backend: str = "torch") -> RejectionResult:
        return rejection_sample(replace(batch, params=[p if p.is_greedy else change(p) for p in batch.params]), backend=backend)
    return wrong


WRONG_VERIFIERS = {
    "draws-from-p_t-not-the-residual": _draws_from_the_target_instead_of_the_residual,
    "ignores-the-temperature": _with_params(lambda p: replace(p, temperature=1.0)),
    "ignores-top-k": _with_params(lambda p: replace(p, top_k=0)),
    "ignores-top-p": _with_params(lambda p: replace(p, top_p=1.0)),
}


@pytest.mark.parametrize(("wrong", "setting"), [
    ("draws-from-p_t-not-the-residual", "T0.5"),
    ("draws-from-p_t-not-the-residual", "T1.5"),
    ("draws-from-p_t-not-the-residual", "T0.7-top-k5-top-p0.8"),
    ("ignores-the-temperature", "T1.5"),
    ("ignores-top-k", "T1-top-k3"),
    ("ignores-top-p", "T1-top-p0.7"),
])
def test_the_same_test_rejects_a_wrong_verifier(small_runtime, monkeypatch, wrong, setting):
    monkeypatch.setattr("dspark.engine.verifier.rejection_sample", WRONG_VERIFIERS[wrong])  # what LocalVerifier calls
    assert pvalue(small_runtime, setting) < P_WRONG
