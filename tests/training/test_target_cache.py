"""Specification tests of the target cache (dspark/training/target_cache.py).

A tiny random target (tests/conftest.py) over a handful of random token sequences: what the cache
reads back is what the runtime computed (rounded to the storage dtype), an interrupted build
resumes into a byte-identical cache, and incomplete caches are refused.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from dspark.training.target_cache import (
    SequenceRecord,
    LOGIT_STATS,
    TargetCache,
    add_logit_stats,
    build_cache,
    bytes_per_token,
    plan_shards,
    read_responses,
)
from tests.conftest import make_tiny_runtime

CAPTURE = (1, 3)  # DSparkConfig.tiny()'s target layers


def write_responses(path: Path, *, num_train: int = 6, num_heldout: int = 3, seed: int = 0, vocab: int = 256) -> Path:
    """responses.jsonl in `dspark data generate`'s format with random token ids."""
    rng = np.random.default_rng(seed)
    path.mkdir(parents=True, exist_ok=True)
    with (path / "responses.jsonl").open("w") as f:
        for i in range(num_train + num_heldout):
            p, r = int(rng.integers(3, 9)), int(rng.integers(6, 30))
            f.write(json.dumps({
                "id": f"s{i}", "source": "test", "split": "train" if i < num_train else "heldout",
                "messages": [{"role": "user", "content": "x"}],
                "prompt_ids": rng.integers(0, vocab, p).tolist(), "response_ids": rng.integers(0, vocab, r).tolist(),
                "finish_reason": "stop", "target": "tiny",
            }) + "\n")
    return path


def tiny_runtime(**kw):
    return make_tiny_runtime(capture_layers=CAPTURE, compute_dtype=torch.float32, **kw)


def make_tiny_cache(tmp: Path, *, dtype: str = "float16", **kw) -> TargetCache:
    records = read_responses(write_responses(tmp / "data"))
    build_cache(tiny_runtime(), records, tmp / "cache", dtype=dtype, shard_tokens=60, batch_tokens=50, progress=False, log=lambda s: None, **kw)
    return TargetCache(tmp / "cache")


def reference_outputs(runtime, record: SequenceRecord) -> tuple[torch.Tensor, torch.Tensor]:
    """The runtime's captured [T, m, d] and hidden [T, d] for one sequence, prefilled alone."""
    runtime.add_request("ref", record.length)
    try:
        out = runtime.forward(["ref"], torch.tensor(record.token_ids), [record.length], capture=True)
    finally:
        runtime.free_request("ref")
    return out.captured, out.hidden


@pytest.mark.parametrize("dtype,torch_dtype", [("float16", torch.float16), ("bfloat16", torch.bfloat16)])
def test_cache_reads_back_the_runtime_outputs_rounded_to_the_storage_dtype(tmp_path, dtype, torch_dtype):
    cache = make_tiny_cache(tmp_path, dtype=dtype)
    records = read_responses(tmp_path / "data")
    assert [s.id for s in cache.sequences] == [r.id for r in records]
    assert cache.meta["shards"] > 1  # several shards and several forwards per shard were exercised
    runtime = tiny_runtime()
    for i, r in enumerate(records):
        s = cache.sequences[i]
        assert (s.prompt_len, s.length, s.split) == (len(r.prompt_ids), r.length, r.split)
        assert cache.tokens(i).tolist() == r.token_ids
        captured, hidden = reference_outputs(runtime, r)
        assert cache.captured(i).dtype == torch_dtype
        # batched (varlen) vs single-sequence prefill agree to fp32 rounding; storage rounds once
        torch.testing.assert_close(cache.captured(i), captured.to(torch_dtype), rtol=1e-2, atol=1e-3)
        torch.testing.assert_close(cache.hidden(i), hidden.to(torch_dtype), rtol=1e-2, atol=1e-3)
        assert cache.captured(i, stop=3).shape == (3, len(CAPTURE), 64)
        rows = np.array([0, s.length - 1])
        torch.testing.assert_close(cache.hidden_rows(i, rows), cache.hidden(i)[rows])


def test_an_interrupted_build_resumes_into_the_same_cache_as_one_run(tmp_path):
    records = read_responses(write_responses(tmp_path / "data"))
    kw = {"shard_tokens": 60, "batch_tokens": 50, "progress": False, "log": lambda s: None}
    build_cache(tiny_runtime(), records, tmp_path / "one", **kw)
    stats = build_cache(tiny_runtime(), records, tmp_path / "two", max_shards=2, **kw)  # "interrupted" after 2 shards
    assert 0 < stats.written_tokens < stats.tokens
    with pytest.raises(ValueError, match="incomplete"):
        TargetCache(tmp_path / "two")
    # a half-written shard (arrays but no index.json) is rewritten, not trusted
    partial = tmp_path / "two" / "shard-00002"
    partial.mkdir()
    (partial / "tokens.npy").write_bytes(b"garbage")
    logs = []
    stats = build_cache(tiny_runtime(), records, tmp_path / "two", **{**kw, "log": logs.append})
    assert "2 shards already complete" in logs[0]
    assert stats.written_tokens < stats.tokens  # the first two shards were skipped
    one = sorted(p.relative_to(tmp_path / "one") for p in (tmp_path / "one").rglob("*") if p.is_file())
    two = sorted(p.relative_to(tmp_path / "two") for p in (tmp_path / "two").rglob("*") if p.is_file())
    assert one == two
    for rel in one:
        assert (tmp_path / "one" / rel).read_bytes() == (tmp_path / "two" / rel).read_bytes(), rel
    # a third run has nothing left to do
    assert build_cache(tiny_runtime(), records, tmp_path / "two", **kw).written_tokens == 0


def test_logit_stats_are_the_normaliser_and_argmax_of_the_stored_hidden_rows(tmp_path):
    runtime = tiny_runtime()
    head = runtime.model.lm_head_weight  # [V, d]
    cache = make_tiny_cache(tmp_path, lm_head_weight=head)
    assert cache.has_logit_stats
    for i, s in enumerate(cache.sequences):
        rows = np.arange(s.length)
        lse, argmax = cache.logit_stats_rows(i, rows)
        logits = cache.hidden(i).float() @ head.float().t()  # [T, V]: from the ROUNDED rows, as the trainer reads them
        torch.testing.assert_close(lse, torch.logsumexp(logits, -1), rtol=0, atol=1e-5)
        assert torch.equal(argmax, logits.argmax(-1))
    # a cache built without them lacks them, and add_logit_stats completes it to the same bytes
    plain = make_tiny_cache(tmp_path / "plain")
    assert not plain.has_logit_stats
    assert add_logit_stats(plain.path, head, progress=False) == plain.meta["shards"]
    assert add_logit_stats(plain.path, head, progress=False) == 0  # nothing left to do
    (plain.path / "shard-00001" / "logits_argmax.npy").unlink()  # "interrupted" between the two files
    assert add_logit_stats(plain.path, head, progress=False) == 1
    for shard in sorted(cache.path.glob("shard-*")):
        for name in LOGIT_STATS:
            assert (shard / f"{name}.npy").read_bytes() == (plain.path / shard.name / f"{name}.npy").read_bytes()
    with pytest.raises(ValueError, match="does not match"):
        add_logit_stats(plain.path, head[:, :8], progress=False)


def test_size_estimate_is_printed_before_writing(tmp_path):
    records = read_responses(write_responses(tmp_path / "data"))
    logs = []
    build_cache(tiny_runtime(), records, tmp_path / "c", progress=False, log=logs.append)
    bpt = bytes_per_token(num_layers=2, hidden_size=64, dtype="float16")
    assert bpt == 3 * 64 * 2 + 4
    assert f"{sum(r.length for r in records)} tokens x {bpt} B/token" in logs[0]


def test_cache_refuses_different_settings_in_the_same_directory(tmp_path):
    records = read_responses(write_responses(tmp_path / "data"))
    build_cache(tiny_runtime(), records, tmp_path / "c", progress=False, log=lambda s: None)
    with pytest.raises(ValueError, match="different settings"):
        build_cache(tiny_runtime(), records, tmp_path / "c", dtype="bfloat16", progress=False, log=lambda s: None)


def test_read_responses_filters_splits_and_validates(tmp_path):
    data = write_responses(tmp_path / "data", num_train=4, num_heldout=2)
    assert len(read_responses(data)) == 6
    assert [r.split for r in read_responses(data, split="heldout")] == ["heldout"] * 2
    (data / "responses.jsonl").write_text('{"id": "a", "split": "test", "prompt_ids": [1], "response_ids": [2]}\n')
    with pytest.raises(ValueError, match="split must be one of"):
        read_responses(data)


def test_shard_plan_is_a_pure_function_of_the_lengths():
    assert plan_shards([10, 10, 10, 10, 5], shard_tokens=20) == [[0, 1], [2, 3], [4]]
    assert plan_shards([30, 1], shard_tokens=20) == [[0], [1]]
