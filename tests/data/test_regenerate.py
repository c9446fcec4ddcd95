"""Regeneration: batched = per-request plain decoding, resumable, torn lines handled."""

from __future__ import annotations

import json

import pytest

from dspark.data.prompt_sources import PromptRecord, prompt_id, split_of
from dspark.data.regenerate import RegenConfig, load_responses, record_seed, regenerate
from dspark.engine.speculative import GenerationRequest, SpeculativeEngine
from dspark.sampling.params import SamplingParams

STOP = frozenset({170})  # a token the tiny model emits ~4% of the time: some responses stop, some hit the length


class FakeTokenizer:
    """Bytes of the rendered chat, folded into the tiny model's 256-token vocabulary."""

    eos_token_ids = STOP

    def encode_chat(self, messages):
        text = "".join(f"<{m['role']}>{m['content']}" for m in messages) + "<assistant>"
        return list(text.encode("utf-8"))


def _prompts(n: int) -> list[PromptRecord]:
    out = []
    for i in range(n):
        messages = [{"role": "user", "content": f"question {i}: " + "why " * (i % 7)}]
        pid = prompt_id(messages)
        out.append(PromptRecord(id=pid, source="test", messages=messages, split=split_of(pid, 0.2)))
    return out


def _run(runtime, path, prompts, **kwargs):
    config = kwargs.pop("config", RegenConfig(batch_size=4, max_new_tokens=24, temperature=1.0, seed=5))
    return regenerate(runtime, FakeTokenizer(), prompts, path, config=config, target="tiny", progress=False, **kwargs)


def _by_id(path) -> dict[str, dict]:
    rows = load_responses(path)
    ids = [r["id"] for r in rows]
    assert len(ids) == len(set(ids)), "an id was written twice"
    return {r["id"]: r for r in rows}


@pytest.mark.parametrize("temperature", [1.0, 0.0])
def test_batched_regeneration_equals_plain_decoding_of_each_prompt_alone(tiny_runtime, tmp_path, temperature):
    prompts = _prompts(10)
    config = RegenConfig(batch_size=4, max_new_tokens=24, temperature=temperature, seed=5)
    stats = _run(tiny_runtime, tmp_path / "r.jsonl", prompts, config=config)
    rows = _by_id(tmp_path / "r.jsonl")
    assert stats.written == len(rows) == 10 and stats.generated_tokens == sum(len(r["response_ids"]) for r in rows.values())
    tok = FakeTokenizer()
    for p in prompts:
        ids = tok.encode_chat(p.messages)
        params = SamplingParams(temperature=temperature, seed=record_seed(5, p.id))
        (alone,) = SpeculativeEngine(tiny_runtime, None).generate([GenerationRequest("x", ids, 24, params, stop_token_ids=STOP)])
        row = rows[p.id]
        assert row["prompt_ids"] == ids and row["response_ids"] == alone.output_ids
        assert row["finish_reason"] == alone.finish_reason
        assert {k: row[k] for k in ("id", "source", "messages", "split")} == p.to_json()
        assert row["target"] == "tiny" and row["temperature"] == temperature
    assert {r["finish_reason"] for r in rows.values()} == {"stop", "length"} or temperature == 0.0
    assert tiny_runtime.kv.reserved_tokens == 0


def test_a_full_kv_budget_makes_requests_wait_instead_of_failing(tiny_runtime_factory, tmp_path):
    prompts = _prompts(8)
    _run(tiny_runtime_factory(), tmp_path / "ref.jsonl", prompts)
    small = tiny_runtime_factory(kv_budget_tokens=2 * (30 + 24))  # about two requests at a time, batch_size 4
    stats = _run(small, tmp_path / "r.jsonl", prompts)
    assert stats.written == 8 and _by_id(tmp_path / "r.jsonl") == _by_id(tmp_path / "ref.jsonl")


def test_resume_after_a_crash_writes_every_id_once_with_the_content_of_an_uninterrupted_run(tiny_runtime, tmp_path):
    prompts = _prompts(12)
    _run(tiny_runtime, tmp_path / "ref.jsonl", prompts)

    class Killed(Exception):
        pass

    written = []

    def kill_after_5(row):
        written.append(row["id"])
        if len(written) == 5:
            raise Killed

    with pytest.raises(Killed):
        _run(tiny_runtime, tmp_path / "r.jsonl", prompts, on_record=kill_after_5)
    assert len(_by_id(tmp_path / "r.jsonl")) == 5 and tiny_runtime.kv.reserved_tokens == 0
    stats = _run(tiny_runtime, tmp_path / "r.jsonl", prompts)
    assert stats.done_before == 5 and stats.written == 7
    assert _by_id(tmp_path / "r.jsonl") == _by_id(tmp_path / "ref.jsonl")


def test_a_limit_then_the_full_set_equals_one_full_run(tiny_runtime, tmp_path):
    prompts = _prompts(9)
    _run(tiny_runtime, tmp_path / "ref.jsonl", prompts)
    _run(tiny_runtime, tmp_path / "r.jsonl", prompts[:4])
    _run(tiny_runtime, tmp_path / "r.jsonl", prompts)
    assert _by_id(tmp_path / "r.jsonl") == _by_id(tmp_path / "ref.jsonl")


def test_ctrl_c_stops_cleanly_keeping_finished_records(tiny_runtime, tmp_path):
    def interrupt(row):
        raise KeyboardInterrupt

    stats = _run(tiny_runtime, tmp_path / "r.jsonl", _prompts(6), on_record=interrupt)
    assert stats.interrupted and stats.written == 1 and len(_by_id(tmp_path / "r.jsonl")) == 1
    assert tiny_runtime.kv.reserved_tokens == 0 and "rerun to resume" in stats.summary()


def test_a_torn_last_line_is_dropped_cut_from_the_file_and_regenerated(tiny_runtime, tmp_path):
    prompts = _prompts(6)
    path = tmp_path / "r.jsonl"
    _run(tiny_runtime, path, prompts)
    full = _by_id(path)
    data = path.read_bytes()
    last_start = data.rstrip(b"\n").rfind(b"\n") + 1
    path.write_bytes(data[: last_start + (len(data) - last_start) // 2])  # killed mid-write
    assert len(load_responses(path, repair=False)) == 5
    stats = _run(tiny_runtime, path, prompts)
    assert stats.done_before == 5 and stats.written == 1
    assert _by_id(path) == full
    assert all(json.loads(line) for line in path.read_text().splitlines())  # no half line left in the middle


def test_a_complete_last_line_without_its_newline_is_treated_as_torn(tmp_path):
    path = tmp_path / "r.jsonl"
    path.write_text('{"id": "a"}\n{"id": "b"}')
    assert [r["id"] for r in load_responses(path)] == ["a"]
    assert path.read_text() == '{"id": "a"}\n'


def test_a_corrupt_line_before_the_end_is_an_error_not_silently_dropped(tmp_path):
    path = tmp_path / "r.jsonl"
    path.write_text('{"id": "a"}\n{"id": "b", \n{"id": "c"}\n')
    with pytest.raises(ValueError, match="corrupt"):
        load_responses(path)


def test_resuming_with_another_target_or_temperature_is_refused(tiny_runtime, tmp_path):
    prompts = _prompts(2)
    _run(tiny_runtime, tmp_path / "r.jsonl", prompts[:1])
    with pytest.raises(ValueError, match="temperature"):
        _run(tiny_runtime, tmp_path / "r.jsonl", prompts, config=RegenConfig(temperature=0.0))


def test_each_record_says_its_top_p_and_a_resume_with_another_is_refused(tiny_runtime, tmp_path):
    prompts = _prompts(2)
    path = tmp_path / "r.jsonl"
    _run(tiny_runtime, path, prompts[:1], config=RegenConfig(batch_size=2, max_new_tokens=8, temperature=0.7, top_p=0.8))
    assert [r["top_p"] for r in load_responses(path)] == [0.8]
    with pytest.raises(ValueError, match="top_p"):
        _run(tiny_runtime, path, prompts, config=RegenConfig(batch_size=2, max_new_tokens=8, temperature=0.7))
    _run(tiny_runtime, path, prompts, config=RegenConfig(batch_size=2, max_new_tokens=8, temperature=0.7, top_p=0.8))
    assert len(load_responses(path)) == 2


def test_records_from_before_top_p_was_recorded_read_as_top_p_1(tiny_runtime, tmp_path):
    prompts = _prompts(2)
    path = tmp_path / "r.jsonl"
    _run(tiny_runtime, path, prompts[:1])
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    path.write_text("".join(json.dumps({k: v for k, v in r.items() if k != "top_p"}) + "\n" for r in rows))
    _run(tiny_runtime, path, prompts)  # top_p 1 (the default): compatible
    assert len(load_responses(path)) == 2


def test_a_prompt_too_long_for_the_context_is_skipped_and_the_rest_served(tiny_runtime_factory, tmp_path):
    runtime = tiny_runtime_factory(max_model_len=64)
    long_msg = [{"role": "user", "content": "x" * 100}]
    prompts = _prompts(3) + [PromptRecord(id=prompt_id(long_msg), source="t", messages=long_msg, split="train")]
    stats = _run(runtime, tmp_path / "r.jsonl", prompts)
    assert stats.skipped == 1 and stats.written == 3


def test_bad_configs_are_rejected():
    for kwargs in ({"batch_size": 0}, {"max_new_tokens": 0}, {"temperature": -1.0}):
        with pytest.raises(ValueError):
            RegenConfig(**kwargs)


def test_the_cli_writes_prompts_then_responses(tiny_runtime, tmp_path, monkeypatch):
    import argparse

    import dspark.data.cli as data_cli
    from dspark.data import prompt_sources

    monkeypatch.setattr(prompt_sources, "SOURCES", {"fake": lambda: [[{"role": "user", "content": f"q{i}"}] for i in range(7)]})
    monkeypatch.setattr(prompt_sources.Decontaminator, "from_benchmarks", classmethod(lambda cls, **kw: cls(["a benchmark prompt"], **kw)))
    parser = argparse.ArgumentParser()
    data_cli.add_data_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["data", "prompts", "--out", str(tmp_path), "--sources", "fake", "--max-prompt-tokens", "0"])
    assert args.func(args) == 0
    assert len((tmp_path / "prompts.jsonl").read_text().splitlines()) == 7

    from dspark.model import target_runtime, tokenizer

    tiny_runtime.model_dir = "unused"
    monkeypatch.setattr(target_runtime.TargetRuntime, "load", classmethod(lambda cls, cfg: tiny_runtime))
    monkeypatch.setattr(tokenizer, "Tokenizer", lambda model_dir: FakeTokenizer())
    args = parser.parse_args(["data", "generate", "--data-dir", str(tmp_path), "--batch-size", "3", "--max-new-tokens", "8",
                              "--limit", "5", "--no-progress"])
    assert args.func(args) == 0
    rows = load_responses(tmp_path / "responses.jsonl")
    assert len(rows) == 5 and all(r["target"] == "smollm2-135m-instruct" for r in rows)


@pytest.mark.slow
def test_real_model_regeneration_stops_at_eos_and_equals_decoding_alone(real_runtime, real_tokenizer, tmp_path):
    texts = ["Name three primary colours.", "What is a prime number? One sentence.", "Say hi."]
    prompts = []
    for t in texts:
        messages = [{"role": "user", "content": t}]
        prompts.append(PromptRecord(id=prompt_id(messages), source="test", messages=messages, split="train"))
    # Greedy, so that short answers reliably end with the end-of-turn token within the limit
    # (temperature 1 batched == alone is covered on the tiny model above).
    config = RegenConfig(batch_size=3, max_new_tokens=48, temperature=0.0, seed=1)
    regenerate(real_runtime, real_tokenizer, prompts, tmp_path / "r.jsonl", config=config, target="smollm2", progress=False)
    rows = _by_id(tmp_path / "r.jsonl")
    for p in prompts:
        row = rows[p.id]
        params = SamplingParams(temperature=0.0, seed=record_seed(1, p.id))
        req = GenerationRequest("alone", row["prompt_ids"], 48, params, stop_token_ids=real_tokenizer.eos_token_ids)
        (alone,) = SpeculativeEngine(real_runtime, None).generate([req])
        assert row["response_ids"] == alone.output_ids
        if row["finish_reason"] == "stop":
            assert row["response_ids"][-1] in real_tokenizer.eos_token_ids
    assert any(r["finish_reason"] == "stop" for r in rows.values())
    assert real_runtime.kv.reserved_tokens == 0


def test_the_cli_turns_the_train_responses_into_a_datastore(tmp_path, monkeypatch):
    import argparse
    import types

    import dspark.data.cli as data_cli
    from dspark.drafters.datastore import NgramDatastore
    from dspark.model import model_store, tokenizer

    monkeypatch.setattr(model_store, "resolve_model_dir", lambda name: "unused")
    monkeypatch.setattr(tokenizer, "Tokenizer", lambda model_dir: types.SimpleNamespace(vocab_size=100))
    (tmp_path / "responses.jsonl").write_text("\n".join(json.dumps(r) for r in [
        {"split": "train", "response_ids": [1, 2, 3, 4]}, {"split": "heldout", "response_ids": [1, 2, 9]}]) + "\n")
    parser = argparse.ArgumentParser()
    data_cli.add_data_parser(parser.add_subparsers(dest="command"))
    out = tmp_path / "ckpt" / "ngram_datastore.npz"
    args = parser.parse_args(["data", "datastore", "--responses", str(tmp_path / "responses.jsonl"), "--out", str(out)])
    assert args.func(args) == 0
    store = NgramDatastore.load(out)
    assert store.chain([1, 2], 5) == ([3, 4], [1.0, 1.0])  # the held-out 9 stayed out
    args = parser.parse_args(["data", "datastore", "--responses", str(tmp_path / "missing.jsonl"), "--out", str(out)])
    assert args.func(args) == 2
