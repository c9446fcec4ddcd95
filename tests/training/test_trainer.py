"""Specification tests of anchor sampling / batches (anchors.py) and the trainer (trainer.py).

Tiny random target and a 1-layer, γ = 4, rank 16 drafter on the CPU: the leakage rule is
checked against a hand-built example, training lowers the loss, `--resume` reproduces the
uninterrupted loss trace exactly, the final checkpoint loads with `load_checkpoint`, and the
end line reports the private memory a run needs apart from the cache pages it has mapped.
"""

from __future__ import annotations

import itertools
import json

import numpy as np
import pytest
import torch

from dspark.drafters.dspark import load_checkpoint
from dspark.drafters.shared import SharedWeights
from dspark.model.config import ModelConfig
from dspark.training.anchors import (
    block_labels,
    build_batch,
    plan_batches,
    sample_anchors,
    sample_batch,
)
from dspark.training.trainer import (
    TrainConfig,
    learning_rate,
    read_metrics,
    resident_mb,
    total_steps,
    train,
)
from tests.conftest import build_transformer, random_hf_state_dict
from tests.training.test_target_cache import make_tiny_cache


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return make_tiny_cache(tmp_path_factory.mktemp("cache"))


@pytest.fixture(scope="module")
def target():
    cfg = ModelConfig.tiny()
    return build_transformer(cfg, random_hf_state_dict(cfg, seed=0), compute_dtype=torch.float32)


def tiny_config(**kw) -> TrainConfig:
    base = {"steps": 12, "batch_seqs": 3, "anchors_per_seq": 8, "lr": 3e-3, "warmup": 0.1, "layers": 1, "block_size": 4,
            "markov_rank": 16, "checkpoint_every": 4, "seed": 0}
    base.update(kw)
    return TrainConfig(**base)


def run(config, cache, target, run_dir, **kw):
    return train(config, cache=cache, target_config=target.config, shared=SharedWeights.from_target(target),
                 run_dir=run_dir, progress=False, **kw)


# ---- anchors --------------------------------------------------------------------------------------


def test_block_labels_follow_the_leakage_rule_on_a_hand_built_example():
    # T = 10 tokens (prompt of 4), anchors t = 4, 7, 8, γ = 3
    tokens = torch.tensor([10, 11, 12, 13, 20, 21, 22, 23, 24, 25])
    labels, mask, rows = block_labels(tokens, torch.tensor([4, 7, 8]), 3)
    # block position k predicts the token at t + k; nothing exists beyond T - 1 = 9
    assert labels.tolist() == [[21, 22, 23], [24, 25, 0], [25, 0, 0]]
    assert mask.tolist() == [[True, True, True], [True, True, False], [True, False, False]]
    # p_t of position k comes from the target's hidden at t + k - 1 (clamped where masked)
    assert rows.tolist() == [[4, 5, 6], [7, 8, 9], [8, 9, 9]]


def test_anchors_lie_in_the_response_and_leave_a_label():
    rng = np.random.default_rng(0)
    a = sample_anchors(prompt_len=5, length=40, num=10, rng=rng)
    assert len(a) == 10 and len(set(a.tolist())) == 10 and (np.diff(a) > 0).all()
    assert a.min() >= 5 and a.max() <= 38
    assert sample_anchors(prompt_len=5, length=9, num=10, rng=rng).tolist() == [5, 6, 7]  # all when fewer exist
    assert sample_anchors(prompt_len=5, length=6, num=10, rng=rng).size == 0  # one response token: no label


def test_batch_rows_hold_the_right_context_labels_and_target_hidden(cache):
    seqs = [0, 2]
    anchors = [np.array([cache.sequences[0].prompt_len, cache.sequences[0].length - 2]), np.array([cache.sequences[2].prompt_len + 1])]
    b = build_batch(cache, seqs, anchors, block_size=4)
    assert b.blocks.anchor_positions.tolist()[0] == anchors[0].tolist()
    assert b.blocks.block_valid.tolist() == [[True, True], [True, False]]
    for r, i in enumerate(seqs):
        tokens, hidden = cache.tokens(i), cache.hidden(i).float()
        t_max = int(anchors[r].max())
        assert int(b.blocks.context_lens[r]) == t_max  # no context row at or after the last anchor is loaded
        torch.testing.assert_close(b.blocks.context[r, :t_max], cache.captured(i, stop=t_max).float())
        assert not b.blocks.context[r, t_max:].any()
        for j, t in enumerate(anchors[r]):
            assert int(b.blocks.anchor_tokens[r, j]) == int(tokens[t])
            labels, mask, rows = block_labels(tokens, torch.tensor([t]), 4)
            assert b.target_tokens[r, j].tolist() == labels[0].tolist()
            assert b.label_mask[r, j].tolist() == mask[0].tolist()
            torch.testing.assert_close(b.target_hidden[r, j], hidden[rows[0]])
    assert not b.label_mask[1, 1].any()  # padding block: no labels
    # the block at T-2 has exactly one label
    assert b.label_mask[0, 1].tolist() == [True, False, False, False]


def test_batches_are_deterministic_given_the_seed(cache):
    idx = cache.indices("train")
    plan = plan_batches(cache, idx, batch_seqs=4, seed=3, epoch=1)
    assert plan == plan_batches(cache, idx, batch_seqs=4, seed=3, epoch=1)
    assert sorted(i for b in plan for i in b) == sorted(idx)
    assert all(len(b) <= 4 for b in plan)
    a = sample_batch(cache, plan[0], anchors_per_seq=5, block_size=4, seed=3, epoch=1)
    b = sample_batch(cache, plan[0], anchors_per_seq=5, block_size=4, seed=3, epoch=1)
    assert torch.equal(a.blocks.anchor_positions, b.blocks.anchor_positions) and torch.equal(a.target_hidden, b.target_hidden)
    c = sample_batch(cache, plan[0], anchors_per_seq=5, block_size=4, seed=4, epoch=1)
    assert not torch.equal(a.blocks.anchor_positions, c.blocks.anchor_positions)
    limited = plan_batches(cache, idx, batch_seqs=4, seed=3, epoch=1, max_batch_tokens=40)
    assert all(len(b) == 1 or sum(cache.sequences[i].length for i in b) <= 40 for b in limited)


# ---- trainer --------------------------------------------------------------------------------------


def test_learning_rate_warms_up_linearly_then_decays_by_cosine():
    lrs = [learning_rate(s, total_steps=100, base_lr=1.0, warmup=0.04) for s in range(100)]
    assert lrs[:4] == [0.25, 0.5, 0.75, 1.0]
    assert all(a >= b for a, b in itertools.pairwise(lrs[3:]))
    assert lrs[-1] < 1e-3


def test_a_few_steps_lower_the_loss_and_log_metrics(cache, target, tmp_path):
    result = run(tiny_config(steps=20), cache, target, tmp_path / "run")
    assert len(result.losses) == 20
    assert np.mean(result.losses[-4:]) < np.mean(result.losses[:4]) - 0.05
    log = read_metrics(tmp_path / "run")
    assert [e["step"] for e in log[:-1]] == list(range(1, 21))
    assert {"loss", "ce", "tv", "conf", "acc", "tau", "acc_per_pos", "lr", "labels"} <= log[0].keys()
    end = log[-1]
    assert end["event"] == "end" and end["steps"] == 20 and end["peak_rss_mb"] > 0 and end["label_tokens"] > 0
    if resident_mb():  # Linux: private memory is reported apart from mapped files, and within the peak RSS
        assert 0 < end["peak_private_mb"] <= end["peak_rss_mb"] and end["mapped_files_mb"] > 0


@pytest.mark.skipif(not resident_mb(), reason="needs /proc/self/status (Linux)")
def test_pages_of_a_mapped_cache_count_as_mapped_files_not_as_private_memory(tmp_path):
    np.save(tmp_path / "big.npy", np.ones(16 * 2**20, dtype=np.float32))  # 64 MiB, like a cache shard
    before = resident_mb()
    mapped = np.load(tmp_path / "big.npy", mmap_mode="r")
    assert float(mapped.sum(dtype=np.float64)) == 16 * 2**20  # every page read
    after = resident_mb()
    assert after["mapped_files_mb"] - before["mapped_files_mb"] > 48
    assert after["private_mb"] - before["private_mb"] < 16


def test_resume_reproduces_the_uninterrupted_loss_trace_exactly(cache, target, tmp_path):
    config = tiny_config()
    full = run(config, cache, target, tmp_path / "full")
    # "interrupted" after step 6: checkpoints at 4 and 6; pretend only step 4 survived
    run(config, cache, target, tmp_path / "cut", stop_after=6)
    ckpts = tmp_path / "cut" / "checkpoints"
    assert (ckpts / "step-0000004").exists()
    (ckpts / "latest").write_text("step-0000004")
    resumed = run(config, cache, target, tmp_path / "cut", resume=True)
    assert resumed.losses == full.losses[4:]  # bit for bit
    trace = [e["loss"] for e in read_metrics(tmp_path / "cut") if "loss" in e]
    assert trace == full.losses
    a = load_checkpoint(full.final_dir, shared=SharedWeights.from_target(target)).drafter.state_dict()
    b = load_checkpoint(resumed.final_dir, shared=SharedWeights.from_target(target)).drafter.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    with pytest.raises(ValueError, match="different settings"):
        run(tiny_config(lr=1e-3), cache, target, tmp_path / "cut", resume=True)


def test_final_checkpoint_loads_and_holds_no_pickle(cache, target, tmp_path):
    result = run(tiny_config(steps=3, checkpoint_every=2), cache, target, tmp_path / "run")
    ckpt = load_checkpoint(result.final_dir, shared=SharedWeights.from_target(target))
    assert ckpt.drafter.config.block_size == 4 and ckpt.drafter.config.target_layer_ids == cache.capture_layers
    assert ckpt.temperatures is None
    files = {p.name for p in (tmp_path / "run").rglob("*") if p.is_file()}
    assert {"optimizer.safetensors", "trainer_state.json", "model.safetensors", "config.json", "latest"} <= files
    assert not any(f.endswith((".pt", ".pth", ".pkl", ".bin")) for f in files)
    json.loads((tmp_path / "run" / "train_config.json").read_text())


def test_epochs_set_the_number_of_steps(cache):
    config = tiny_config(steps=None, epochs=2, batch_seqs=4)
    per_epoch = len(plan_batches(cache, cache.indices("train"), batch_seqs=4, seed=0, epoch=0))
    assert total_steps(config, cache) == 2 * per_epoch


def test_the_cli_registers_cache_train_and_calibrate():
    import argparse

    from dspark.training.cli import add_train_parsers

    parser = argparse.ArgumentParser()
    add_train_parsers(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["train", "--cache", "C", "--out", "R", "--steps", "5", "--resume"])
    assert (args.steps, args.resume, args.lr, args.block_size, args.markov_rank, args.algo) == (5, True, 6e-4, 7, 256, "dspark")
    assert parser.parse_args(["cache", "--data-dir", "D", "--out", "C"]).dtype == "float16"
    assert parser.parse_args(["calibrate", "--drafter", "R/final", "--cache", "C"]).split == "heldout"
