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


@pytest.mark.parametrize("name", ["sharegpt", "champ", "pycode", "pypkgs"])
def test_installed_sources_yield_user_prompts(name):
    from dspark.data.prompt_sources import SOURCES

    try:
        first = [m for _, m in zip(range(50), SOURCES[name]())]
    except FileNotFoundError as e:
        pytest.skip(str(e))
    assert len(first) == 50
    assert all(m[-1]["role"] == "user" and m[-1]["content"] for m in first)


# ---- pycode: coding requests from the standard library's documented functions ----------------

_MODULE = '''
def add_all(values, start=0) -> int:
    """Returns the sum of all the given values, starting from start.

    More detail that stays out of the one-line task.
    """
    secret_body_marker = 1
    return sum(values, start)


def short():
    """Too short to be a task."""


def _private(x):
    """Returns something private that nobody outside should ever call directly."""


class Queue:
    def push_item(self, item):
        """Appends an item to the end of the queue and wakes one waiting consumer."""
        secret_body_marker = 2

    def _internal(self):
        """Does internal bookkeeping that is not part of the public interface at all."""


class _Hidden:
    def visible(self):
        """Returns a value from a private class, which is not a public method at all."""
'''


def _tree(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "mod.py").write_text(_MODULE)
    for skipped in ("tests", "_vendor", "idlelib"):
        (tmp_path / skipped).mkdir()
        (tmp_path / skipped / "mod.py").write_text(_MODULE)
    (tmp_path / "broken.py").write_text("def (:\n")
    return tmp_path


def test_pycode_takes_public_documented_functions_and_methods_only(tmp_path):
    from dspark.data.prompt_sources import iter_python_functions

    fns = list(iter_python_functions(_tree(tmp_path)))
    assert [f.qualname for f in fns] == ["pkg.mod.add_all", "pkg.mod.Queue.push_item"]
    assert fns[0].signature == "add_all(values, start=0) -> int" and fns[0].cls is None
    assert fns[1].cls == "Queue" and fns[1].signature == "push_item(self, item)"


def test_pycode_turns_a_docstring_summary_into_an_imperative_task():
    from dspark.data.prompt_sources import _first_sentence, _imperative

    assert _first_sentence("Returns the sum. Then more.\n\nBody.") == "Returns the sum"
    assert _imperative("Returns the sum of values") == "return the sum of values"
    assert _imperative("Matches a pattern") == "match a pattern"
    assert _imperative("Copies the file") == "copy the file"
    assert _imperative("Process the queue") == "process the queue"
    assert _imperative("Is this a valid name") is None
    assert _imperative("add(a, b) -> number") is None


def test_pycode_prompts_are_deterministic_and_never_show_a_body(tmp_path):
    from dspark.data.prompt_sources import PythonFunction, iter_python_functions, pycode_prompt

    fns = list(iter_python_functions(_tree(tmp_path)))
    prompts = [pycode_prompt(f) for f in fns]
    assert prompts == [pycode_prompt(f) for f in iter_python_functions(tmp_path)]
    assert all("secret_body_marker" not in p for p in prompts)
    # Every phrasing names the task; a docstring that opens with no verb is shown whole as a stub.
    styles = set()
    for i in range(60):
        fn = PythonFunction(f"m.f{i}", None, f"f{i}", f"f{i}(x)", "Returns the square of x for every x that the caller gives.")
        p = pycode_prompt(fn)
        assert "square of x" in p
        styles.add(p.split()[0] + p.split()[2])
    assert len(styles) == 3
    stub = pycode_prompt(PythonFunction("m.C.g", "C", "g", "g(self)", "Is the queue empty, as seen by a consumer right now?"))
    assert stub.startswith("Implement this Python method:\n```python\nclass C:\n    def g(self):")
    assert stub.rstrip().endswith("```")


def test_pycode_prompts_pass_through_decontamination(tmp_path):
    from dspark.data.prompt_sources import iter_python_functions, pycode_prompt

    sources = {"pycode": [_user(pycode_prompt(f)) for f in iter_python_functions(_tree(tmp_path))]}
    records, stats = build_prompts(sources, decontaminator=Decontaminator(BENCH, n=8), heldout_fraction=0.5, seed=0)
    assert stats.per_source == {"pycode": 2} and len(records) == 2


# ---- pypkgs: the same requests from permissively licensed installed libraries ----------------


def test_pypkgs_reads_the_listed_installed_libraries_with_their_package_names(tmp_path):
    from dspark.data.prompt_sources import load_pypkgs

    for name in ("alpha", "beta", "unlisted"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "mod.py").write_text(_MODULE)
    prompts = [m[0]["content"] for m in load_pypkgs(tmp_path, packages=("beta", "missing", "alpha"))]
    assert len(prompts) == 4  # two functions each from beta and alpha; "missing" is skipped
    # The package name is part of the qualified name, so phrasings differ between packages...
    from dspark.data.prompt_sources import iter_python_functions

    assert [f.qualname for f in iter_python_functions(tmp_path / "alpha", package="alpha")] == [
        "alpha.mod.add_all", "alpha.mod.Queue.push_item"]
    # ...and a site without any of them is an error, not an empty data set.
    with pytest.raises(FileNotFoundError, match="none of"):
        list(load_pypkgs(tmp_path, packages=("missing",)))


def test_instruction_boilerplate_shared_by_many_benchmark_turns_is_not_evidence_of_contamination():
    instruction = "Please reason step by step, and put your final answer within a box at the end."
    problems = [f"Problem {i}: a farmer has {i} cows and buys {i + 3} more cows at the market on day {i}." for i in range(25)]
    d = Decontaminator([p + " " + instruction for p in problems], boilerplate_turns=20)
    # a new problem ending with the shared instruction is kept ...
    assert not d.is_contaminated("How many legs do 7 spiders have? " + instruction)
    # ... a benchmark problem is still caught by its own content, with or without the instruction
    assert d.is_contaminated(problems[3])
    assert d.is_contaminated("Solve: " + problems[17] + " " + instruction)
    # below the threshold the instruction's n-grams still count
    few = Decontaminator([p + " " + instruction for p in problems[:5]], boilerplate_turns=20)
    assert few.is_contaminated("How many legs do 7 spiders have? " + instruction)


def test_mathword_problems_are_seeded_and_varied():
    from dspark.data.math_word_problems import TEMPLATES, word_problem
    from dspark.data.prompt_sources import load_mathword

    assert word_problem(0, 41) == word_problem(0, 41) and word_problem(0, 41) != word_problem(1, 41)
    problems = [m[0]["content"] for m in load_mathword(400)]
    assert len(problems) == 400 and len(set(problems)) >= 390
    assert all(m.strip().endswith(("?", ".", "}.")) for m in problems)
    import random

    for template in TEMPLATES:  # every template asks one question about numbers it states
        text = template(random.Random(7))
        assert text.endswith("?") and any(ch.isdigit() for ch in text), (template.__name__, text)
