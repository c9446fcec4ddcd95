"""Per-request and per-point statistics of the serving benchmark, against hand-computed values.

Specification: a request's time per output token (TPOT) is (last token - first token) / (output
tokens - 1), undefined below two tokens, and its per-user speed 1 / TPOT; a point's per-user
speed is 1 / mean TPOT, so a request delivered in one burst cannot dominate it, and its p50 / p90
are 1 / p50 / p90 of TPOT (linear interpolation): p90 is the speed 90% of requests reach; aggregate throughput is measured tokens over the measured
window; the verification budget and τ are pooled over decode rounds; warm-up requests and
failed requests are in no statistic (failed ones are counted as errors).
"""

from __future__ import annotations

import pytest

from dspark.bench.serve_stats import RequestRecord, mean_in_flight, percentile, summarize, verify_budget


def rec(index, start, first, last, end, tokens, rounds=None, drafts=None, tau=None, *, warmup=False, error=None):
    return RequestRecord(index=index, benchmark="gsm8k", warmup=warmup, start_s=start, end_s=end, first_token_s=first,
                         last_token_s=last, output_tokens=tokens, rounds=rounds, draft_tokens=drafts, accepted_length=tau,
                         error=error)


# three measured requests; tokens = 1 (prefill) + τ · rounds for each
R0 = rec(0, 0.0, 0.5, 2.5, 2.6, 9, rounds=4, drafts=12, tau=2.0)  # TPOT 2.0 s / 8 = 0.25 s: 4 tok/s
R1 = rec(1, 0.1, 0.3, 1.3, 1.4, 11, rounds=5, drafts=5, tau=2.0)  # TPOT 1.0 s / 10 = 0.1 s: 10 tok/s
R2 = rec(2, 1.0, 1.5, 3.5, 4.0, 5, rounds=1, drafts=7, tau=4.0)  # TPOT 2.0 s / 4 = 0.5 s: 2 tok/s
WARM = rec(0, -5.0, -4.9, -1.0, -0.9, 100, rounds=50, drafts=350, tau=2.0, warmup=True)
FAILED = rec(3, 0.05, None, None, 0.06, 0, error="HTTP 400: max_tokens too large")


def test_percentile_interpolates_linearly_between_order_statistics():
    assert percentile([4.0, 1.0, 3.0, 2.0], 50) == pytest.approx(2.5)
    assert percentile([1.0, 2.0, 3.0, 4.0], 90) == pytest.approx(3.7)  # position 2.7
    assert percentile([1.0, 2.0, 3.0, 4.0], 10) == pytest.approx(1.3)  # position 0.3
    assert percentile([7.0], 90) == 7.0
    assert percentile([1.0, 2.0], 0) == 1.0 and percentile([1.0, 2.0], 100) == 2.0


def test_percentile_refuses_no_values_and_q_outside_0_100():
    with pytest.raises(ValueError, match="no values"):
        percentile([], 50)
    with pytest.raises(ValueError, match=r"\[0, 100\]"):
        percentile([1.0], 101)


def test_per_user_speed_is_the_decode_speed_after_the_first_token():
    assert R0.tpot_s == pytest.approx(0.25)
    assert R0.per_user_tok_s == pytest.approx(4.0)
    assert R0.ttft_s == pytest.approx(0.5)
    assert R0.latency_s == pytest.approx(2.6)
    assert R0.request_tok_s == pytest.approx(9 / 2.6)  # the whole-request speed, TTFT included


def test_per_user_speed_is_undefined_below_two_tokens_or_without_a_decode_interval():
    assert rec(0, 0.0, 0.5, 0.5, 0.6, 1).tpot_s is None  # one token
    assert rec(0, 0.0, 0.5, 0.5, 0.6, 4).tpot_s == 0.0  # all tokens in one chunk: no decode time
    assert rec(0, 0.0, 0.5, 0.5, 0.6, 4).per_user_tok_s is None
    assert rec(0, 0.0, None, None, 0.6, 4).per_user_tok_s is None  # no text seen
    assert rec(0, 0.0, None, None, 0.6, 4).ttft_s is None


def test_verification_budget_and_accepted_length_are_pooled_over_decode_rounds():
    budget, tau = verify_budget([R0, R1, R2])
    assert budget == pytest.approx((12 + 5 + 7) / (4 + 5 + 1))  # 2.4, not the mean of per-request ratios
    assert tau == pytest.approx((8 + 10 + 4) / 10)  # 2.2 = emitted tokens per round; the unpooled mean would be 2.67
    assert verify_budget([rec(0, 0, 0.1, 0.2, 0.3, 3)]) == (None, None)  # a server without the extension


def test_a_point_summary_counts_only_measured_successful_requests():
    s = summarize([WARM, R0, R1, R2, FAILED], policy="dspark", temperature=1.0, concurrency=2)
    assert (s.num_requests, s.num_errors) == (3, 1)
    assert s.duration_s == pytest.approx(4.0)  # first measured start (0.0) -> last end (4.0)
    assert s.output_tokens == 25
    assert s.throughput_tok_s == pytest.approx(25 / 4.0)
    assert s.per_user_tok_s == pytest.approx(1 / ((0.25 + 0.1 + 0.5) / 3))  # 3.53 tok/s: 1 / mean TPOT
    assert s.p50_per_user_tok_s == pytest.approx(1 / 0.25)
    assert s.p90_per_user_tok_s == pytest.approx(1 / 0.45)  # p90 of TPOTs [0.1, 0.25, 0.5]: position 1.8
    assert s.ttft_s == pytest.approx((0.5 + 0.2 + 0.5) / 3)
    assert s.p90_ttft_s == pytest.approx(0.5)
    assert s.verify_tokens_per_request == pytest.approx(2.4)
    assert s.accepted_length == pytest.approx(2.2)
    assert (s.policy, s.temperature, s.concurrency, s.rate_req_s, s.verifier_batch_tokens) == ("dspark", 1.0, 2, None, None)


def test_a_request_delivered_in_one_burst_does_not_dominate_the_per_user_speed():
    burst = rec(4, 0.0, 1.0, 1.001, 1.1, 11)  # ten tokens in a millisecond: 10,000 tok/s on its own
    s = summarize([R0, R1, R2, burst], policy="none", temperature=0.0, concurrency=4)
    assert s.per_user_tok_s == pytest.approx(1 / ((0.25 + 0.1 + 0.5 + 0.0001) / 4))  # 4.7 tok/s, not ~2,500
    assert s.p50_per_user_tok_s == pytest.approx(1 / 0.175)


def test_open_loop_concurrency_is_the_mean_number_in_flight():
    records = [WARM, R0, R1, R2]
    assert mean_in_flight(records) == pytest.approx((2.6 + 1.3 + 3.0) / 4.0)  # Little's law over the window
    s = summarize(records, policy="none", temperature=0.0, concurrency=None, rate_req_s=0.75)
    assert s.concurrency == pytest.approx(6.9 / 4.0)
    assert s.rate_req_s == 0.75


def test_a_point_of_only_warm_up_requests_is_refused():
    with pytest.raises(ValueError, match="no measured requests"):
        summarize([WARM], policy="none", temperature=0.0, concurrency=1)
