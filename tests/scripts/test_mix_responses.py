"""scripts/mix_responses.py: one responses.jsonl from greedy and sampled regenerations, held-out
greedy records first (so a run's held-out τ is measured on the sequences earlier runs used)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "mix_responses.py"


def _write(folder: Path, records: list[dict]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "responses.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return folder


def _record(rid: str, split: str, prompt_len: int, temperature: float, **extra) -> dict:
    return {"id": rid, "split": split, "prompt_ids": [1] * prompt_len, "response_ids": [2] * 3, "temperature": temperature, **extra}


def _mix(tmp_path: Path, greedy: list[dict], sampled: list[dict], greedy_train: int) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), "--greedy", str(_write(tmp_path / "g", greedy)),
                           "--sampled", str(_write(tmp_path / "s", sampled)), "--greedy-train", str(greedy_train),
                           "--out", str(tmp_path / "out")], capture_output=True, text=True, check=False)


def test_held_out_greedy_records_come_first_then_the_shortest_greedy_prompts_then_the_sampled_ones(tmp_path):
    greedy = [_record("g-long", "train", 9, 0.0), _record("g-held-1", "heldout", 5, 0.0), _record("g-short", "train", 2, 0.0),
              _record("g-mid", "train", 4, 0.0), _record("g-held-2", "heldout", 1, 0.0)]
    sampled = [_record("s-1", "train", 7, 0.7, top_p=0.8), _record("s-held", "heldout", 3, 0.7, top_p=0.8)]
    done = _mix(tmp_path, greedy, sampled, greedy_train=2)
    assert done.returncode == 0, done.stderr
    rows = [json.loads(line) for line in (tmp_path / "out" / "responses.jsonl").read_text().splitlines()]
    assert [r["id"] for r in rows] == ["g-held-1", "g-held-2", "s-held", "g-short", "g-mid", "s-1"]
    assert [r["top_p"] for r in rows] == [1.0, 1.0, 0.8, 1.0, 1.0, 0.8]  # a record without the field was top_p 1
    stats = json.loads((tmp_path / "out" / "stats.json").read_text())
    assert stats["train_greedy"] == 2 and stats["train_sampled"] == 1 and stats["heldout_responses"] == 3
    assert stats["train_response_tokens_greedy"] == 6 and stats["train_response_tokens_sampled"] == 3


@pytest.mark.parametrize("greedy_t, sampled_t, message", [(0.7, 0.7, "greedy"), (0.0, 0.0, "sampled")])
def test_inputs_of_the_wrong_regime_are_refused(tmp_path, greedy_t, sampled_t, message):
    done = _mix(tmp_path, [_record("a", "train", 1, greedy_t)], [_record("b", "train", 1, sampled_t)], greedy_train=1)
    assert done.returncode != 0 and message in done.stderr


def test_a_prompt_in_both_inputs_is_refused(tmp_path):
    done = _mix(tmp_path, [_record("same", "train", 1, 0.0)], [_record("same", "train", 1, 1.0)], greedy_train=1)
    assert done.returncode != 0 and "both inputs" in done.stderr


def test_extra_sets_are_taken_whole_after_the_sampled_ones_in_each_split(tmp_path):
    greedy = [_record("g-held", "heldout", 5, 0.0), _record("g-train", "train", 2, 0.0), _record("g-cut", "train", 3, 0.0)]
    code = [_record("c-train", "train", 9, 0.0), _record("c-held", "heldout", 4, 0.0)]
    done = subprocess.run([sys.executable, str(SCRIPT), "--greedy", str(_write(tmp_path / "g", greedy)),
                           "--extra", str(_write(tmp_path / "c", code)), "--greedy-train", "1",
                           "--out", str(tmp_path / "out")], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
    rows = [json.loads(line) for line in (tmp_path / "out" / "responses.jsonl").read_text().splitlines()]
    assert [r["id"] for r in rows] == ["g-held", "c-held", "g-train", "c-train"]
    stats = json.loads((tmp_path / "out" / "stats.json").read_text())
    assert stats["train_sampled"] == 0
    assert stats["extra"][str(tmp_path / "c")] == {"train": 1, "heldout": 1, "train_response_tokens": 3, "settings": [[0.0, 1.0]]}
