"""The serving benchmark's prompt mix over ../shared/data/eval.

Specification: domains alternate (math, code, chat, math, ...) and within a domain its
benchmarks alternate, so any prefix of the mix is balanced; prompts over the length limit are
left out; names are domains or benchmarks, anything else is a clear error; the domain grouping
is the offline evaluation's.
"""

from __future__ import annotations

import pytest

from dspark.bench.serve_prompts import PROMPT_SETS, load_prompt_mix, resolve_sets, round_robin


def test_round_robin_takes_one_item_per_group_in_turn():
    assert round_robin([[1, 2, 3], ["a"], [10, 20]]) == [1, "a", 10, 2, 20, 3]
    assert round_robin([]) == []


def test_the_mix_alternates_domains_then_benchmarks_within_a_domain():
    prompts = load_prompt_mix(per_benchmark=4, max_chars=None)
    assert [p.domain for p in prompts[:6]] == ["math", "code", "chat"] * 2
    assert [p.benchmark for p in prompts[:9]] == ["gsm8k", "mbpp", "mt-bench", "math500", "humaneval", "arena-hard-v2",
                                                  "aime25", "livecodebench", "mt-bench"]
    assert len(prompts) == 8 * 4
    assert all(p.text for p in prompts)


def test_prompts_over_the_length_limit_are_left_out():
    prompts = load_prompt_mix(("code",), per_benchmark=5, max_chars=300)
    assert prompts and all(len(p.text) <= 300 for p in prompts)
    assert {p.domain for p in prompts} == {"code"}


def test_names_are_domains_or_benchmarks():
    assert resolve_sets(["chat", "gsm8k"]) == [("chat", "mt-bench"), ("chat", "arena-hard-v2"), ("math", "gsm8k")]
    with pytest.raises(ValueError, match="unknown prompt set 'poetry'"):
        resolve_sets(["poetry"])
    with pytest.raises(ValueError, match="per_benchmark"):
        load_prompt_mix(per_benchmark=0)
    with pytest.raises(ValueError, match="at most 1 characters"):
        load_prompt_mix(("mbpp",), max_chars=1)


def test_the_domains_are_the_offline_evaluations():
    from dspark.evaluation.offline_eval import DOMAINS

    assert PROMPT_SETS == DOMAINS
