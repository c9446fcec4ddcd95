"""Prompt sources: schema, deterministic split, decontamination against the benchmarks."""

from __future__ import annotations

import json

import pytest

from dspark.data.prompt_sources import (
    Decontaminator,
    PromptRecord,
    build_prompts,
    iter_json_array,
    normalize_words,
    prompt_id,
    read_prompts,
    sharegpt_first_turn,
    split_of,
    write_prompts,
)


def _user(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


CORPUS = {
    "a": [_user(f"Explain topic number {i} in simple words.") for i in range(300)],
    "b": [_user(f"Write a Python function that returns {i} squared.") for i in range(100)],
}
BENCH = [
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. How many clips did Natalia sell altogether in April and May?",
    "Rewrite your previous response. Start every sentence with the letter A.",
]


def test_records_have_the_schema_and_survive_a_jsonl_round_trip(tmp_path):
    records, stats = build_prompts(CORPUS, decontaminator=None, heldout_fraction=0.1, seed=3)
    assert stats.kept == len(records) == 400 and stats.per_source == {"a": 300, "b": 100}
    write_prompts(tmp_path / "prompts.jsonl", records)
    lines = [json.loads(line) for line in (tmp_path / "prompts.jsonl").read_text().splitlines()]
    for row in lines:
        assert set(row) == {"id", "source", "messages", "split"}
        assert len(row["id"]) == 16 and row["id"] == prompt_id(row["messages"])
        assert row["messages"][-1]["role"] == "user" and row["split"] in ("train", "heldout")
    assert read_prompts(tmp_path / "prompts.jsonl") == records


def test_a_record_not_ending_with_a_user_turn_is_rejected():
    with pytest.raises(ValueError, match="user turn"):
        PromptRecord(id="x", source="s", messages=[{"role": "assistant", "content": "hi"}], split="train")
    with pytest.raises(ValueError, match="split"):
        PromptRecord(id="x", source="s", messages=_user("hi"), split="test")


def test_the_split_depends_on_the_id_only_and_holds_out_about_the_requested_share():
    ids = [prompt_id(_user(f"prompt {i}")) for i in range(4000)]
    splits = [split_of(i, 0.05) for i in ids]
    assert splits == [split_of(i, 0.05) for i in ids]
    assert 0.035 < splits.count("heldout") / len(ids) < 0.065
    assert all(split_of(i, 0.0) == "train" for i in ids) and all(split_of(i, 1.0) == "heldout" for i in ids)
    # a larger fraction only moves prompts from train to heldout, never back
    assert all(split_of(i, 0.2) == "heldout" for i, s in zip(ids, splits) if s == "heldout")


def test_the_split_is_stable_across_seeds_max_prompts_and_source_order():
    full, _ = build_prompts(CORPUS, decontaminator=None, seed=0)
    other, _ = build_prompts(dict(reversed(list(CORPUS.items()))), decontaminator=None, seed=9, max_prompts=50)
    split = {r.id: r.split for r in full}
    assert len(other) == 50 and all(split[r.id] == r.split for r in other)
    again, _ = build_prompts(CORPUS, decontaminator=None, seed=0)
    assert again == full  # same seed, same order
    assert [r.id for r in other] != [r.id for r in full[:50]]


def test_duplicates_are_dropped_and_long_prompts_skipped():
    sources = {"a": [_user("same"), _user("same"), _user("x " * 50)], "b": [_user("same")]}
    records, stats = build_prompts(sources, decontaminator=None, count_tokens=lambda m: len(m[-1]["content"].split()),
                                   max_prompt_tokens=10)
    assert [r.messages for r in records] == [_user("same")]
    assert stats.duplicates == 2 and stats.too_long == 1


def test_decontamination_drops_exact_and_13_gram_matches_but_keeps_unrelated_prompts():
    d = Decontaminator(BENCH)
    assert d.is_contaminated(BENCH[0])
    assert d.is_contaminated("  natalia SOLD clips to 48 of her friends in April -- and then she sold half as many clips in May!")
    assert d.is_contaminated("Please help: " + BENCH[0][:90] + " thanks")  # a 13-word window inside
    assert d.is_contaminated("rewrite your previous response; start every sentence with the letter a.")  # short turn, exact words
    assert not d.is_contaminated("Natalia sold clips to her friends.")  # 6 words: too short to be evidence
    assert not d.is_contaminated("Explain photosynthesis to a child.")
    records, stats = build_prompts({"s": [_user(BENCH[0]), _user("Explain photosynthesis.")]}, decontaminator=d)
    assert [r.messages[-1]["content"] for r in records] == ["Explain photosynthesis."] and stats.contaminated == 1


def test_normalisation_ignores_case_punctuation_and_unicode_forms():
    assert normalize_words("Ｈello,  WORLD!\n1+1=2") == ["hello", "world", "1", "1", "2"]


def test_every_benchmark_prompt_is_caught_by_the_real_decontaminator():
    from dspark.evaluation.prompts import BENCHMARKS, load_turns

    try:
        d = Decontaminator.from_benchmarks()
    except FileNotFoundError as e:
        pytest.skip(f"benchmark prompts unavailable: {e}")
    for b in BENCHMARKS:
        for turns in load_turns(b, limit=20):
            assert d.is_contaminated(turns[0]), (b, turns[0][:80])
            assert d.is_contaminated("Question: " + turns[0] + "\nAnswer step by step.") or len(normalize_words(turns[0])) < 8


def test_sharegpt_keeps_the_first_user_turn_and_an_opening_system_turn():
    conv = [{"from": "gpt", "value": "leftover"}, {"from": "system", "value": "Be brief."},
            {"from": "human", "value": " Hi there "}, {"from": "gpt", "value": "Hello"}, {"from": "human", "value": "More"}]
    assert sharegpt_first_turn(conv) == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    assert sharegpt_first_turn([{"from": "gpt", "value": "only the model"}]) is None


def test_a_truncated_json_array_yields_its_complete_elements():
    assert list(iter_json_array('[{"a": 1}, {"b": [2, 3]},\n  {"c": "cut he')) == [{"a": 1}, {"b": [2, 3]}]
    assert list(iter_json_array("[1, 2]")) == [1, 2]


@pytest.mark.parametrize("name", ["sharegpt", "champ"])
def test_installed_sources_yield_user_prompts(name):
    from dspark.data.prompt_sources import SOURCES

    try:
        first = [m for _, m in zip(range(50), SOURCES[name]())]
    except FileNotFoundError as e:
        pytest.skip(str(e))
    assert len(first) == 50
    assert all(m[-1]["role"] == "user" and m[-1]["content"] for m in first)
