"""Specification tests of training the baselines (`dspark train --algo dflash|eagle3`).

Tiny random target and cache (tests/training/test_target_cache.py), 1-layer drafters, γ = 4 on
the CPU: each loss equals its formula computed by hand, a few steps lower it, `--resume`
reproduces the loss trace, the final checkpoint is what `make_drafter` serves, and every
algorithm trains on exactly the same batches (the fairness rule of the comparison).
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from dspark.drafters import family, make_drafter
from dspark.drafters.dflash import DFlashConfig, DFlashDrafter
from dspark.drafters.eagle3 import Eagle3Config, Eagle3Drafter
from dspark.drafters.shared import SharedWeights
from dspark.model.config import ModelConfig
from dspark.training.anchors import build_batch
from dspark.training.trainer import TrainConfig, read_metrics, train
from tests.conftest import build_transformer, make_tiny_runtime, random_hf_state_dict
from tests.training.test_target_cache import CAPTURE, make_tiny_cache


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return make_tiny_cache(tmp_path_factory.mktemp("cache"))


@pytest.fixture(scope="module")
def target():
    cfg = ModelConfig.tiny()
    return build_transformer(cfg, random_hf_state_dict(cfg, seed=0), compute_dtype=torch.float32)


def tiny_config(algo: str, **kw) -> TrainConfig:
    base = {"algo": algo, "steps": 12, "batch_seqs": 3, "anchors_per_seq": 8, "lr": 3e-3, "warmup": 0.1, "layers": 1,
            "block_size": 4, "checkpoint_every": 4, "seed": 0}
    base.update(kw)
    return TrainConfig(**base)


def run(config, cache, target, run_dir, **kw):
    return train(config, cache=cache, target_config=target.config, shared=SharedWeights.from_target(target),
                 run_dir=run_dir, progress=False, **kw)


def a_batch(cache):
    seqs = [0, 2, 3]
    anchors = [np.array([cache.sequences[i].prompt_len, cache.sequences[i].prompt_len + 2, cache.sequences[i].length - 3])
               for i in seqs[:2]] + [np.array([cache.sequences[3].prompt_len + 1])]
    return build_batch(cache, seqs, anchors, block_size=4)


def target_probs(batch, target) -> torch.Tensor:  # [rows, nb, γ, V] p_t from the cached final hidden
    return torch.softmax(batch.target_hidden.double() @ target.lm_head_weight.double().t(), dim=-1)


# ---- the batch ----------------------------------------------------------------------------------


def test_a_batch_carries_the_context_tokens_eagle3_reads(cache):
    batch = a_batch(cache)
    ctx_len = batch.blocks.context.shape[1]
    assert batch.context_token_ids.shape == (3, ctx_len + 1)
    for r, i in enumerate(batch.sequence_indices):
        t_max = int(batch.blocks.anchor_positions[r][batch.blocks.block_valid[r]].max())
        assert batch.context_token_ids[r, : t_max + 1].tolist() == cache.tokens(i)[: t_max + 1].tolist()  # positions 0..t
        assert not batch.context_token_ids[r, t_max + 1 :].any()


# ---- the losses, by hand ------------------------------------------------------------------------


def test_the_dflash_loss_is_cross_entropy_weighted_by_exp_of_minus_k_minus_1_over_gamma_w(cache, target):
    torch.manual_seed(0)
    model = DFlashDrafter(DFlashConfig.tiny(num_layers=1, target_layer_ids=CAPTURE), shared=SharedWeights.from_target(target))
    batch = a_batch(cache)
    result = family("dflash").objective.loss(model, batch)
    with torch.no_grad():
        logits = model(batch.blocks).double()  # [rows, nb, γ, V]
    num = den = 0.0
    for r in range(3):
        for b in range(batch.blocks.blocks_per_row):
            for k in range(1, 5):  # block position k = 1..γ
                if batch.blocks.block_valid[r, b] and batch.label_mask[r, b, k - 1]:
                    w = math.exp(-(k - 1) / 4.0)  # DFlash Eq. 4 with γ_w = 4
                    label = int(batch.target_tokens[r, b, k - 1])
                    num += w * -float(torch.log_softmax(logits[r, b, k - 1], -1)[label])
                    den += w
    assert result.total.item() == pytest.approx(num / den, rel=1e-5)
    assert result.metrics["ce"] == result.metrics["loss"] and {"tv", "acc", "tau", "acc_per_pos"} <= result.metrics.keys()


def test_the_eagle3_loss_sums_the_steps_soft_cross_entropy_against_p_t_weighted_0_8_to_the_j(cache, target):
    torch.manual_seed(0)
    model = Eagle3Drafter(Eagle3Config.tiny(target_layer_ids=CAPTURE), shared=SharedWeights.from_target(target))
    batch = a_batch(cache)
    result = family("eagle3").objective.loss(model, batch)
    with torch.no_grad():
        out = model(batch.blocks, context_token_ids=batch.context_token_ids, target_tokens=batch.target_tokens)
    log_p_d, p_t = torch.log_softmax(out.logits.double(), -1), target_probs(batch, target)
    expected = 0.0
    for j in range(1, 5):  # TTT step j predicts x_j
        terms = [-float((p_t[r, b, j - 1] * log_p_d[r, b, j - 1]).sum())
                 for r in range(3) for b in range(batch.blocks.blocks_per_row)
                 if batch.blocks.block_valid[r, b] and batch.label_mask[r, b, j - 1]]
        expected += 0.8 ** (j - 1) * sum(terms) / len(terms)
    assert result.total.item() == pytest.approx(expected, rel=1e-5)


def test_the_logged_acceptance_is_one_minus_the_total_variation_distance(cache, target):
    torch.manual_seed(0)
    model = DFlashDrafter(DFlashConfig.tiny(num_layers=1, target_layer_ids=CAPTURE), shared=SharedWeights.from_target(target))
    batch = a_batch(cache)
    metrics = family("dflash").objective.loss(model, batch).metrics
    with torch.no_grad():
        p_d, p_t = torch.softmax(model(batch.blocks).double(), -1), target_probs(batch, target)
    keep = batch.blocks.block_valid.unsqueeze(-1) & batch.label_mask  # [rows, nb, γ]
    c_star = 1 - 0.5 * (p_d - p_t).abs().sum(-1)
    assert metrics["acc"] == pytest.approx(float(c_star[keep].mean()), rel=1e-4)


# ---- training -----------------------------------------------------------------------------------


@pytest.mark.parametrize("algo", ["dflash", "eagle3"])
def test_a_few_steps_lower_the_loss_and_log_the_shared_diagnostics(cache, target, tmp_path, algo):
    result = run(tiny_config(algo, steps=20), cache, target, tmp_path / "run")
    assert len(result.losses) == 20
    assert np.mean(result.losses[-4:]) < np.mean(result.losses[:4]) - 0.05
    log = read_metrics(tmp_path / "run")
    assert {"loss", "ce", "tv", "acc", "tau", "acc_per_pos", "lr", "labels"} <= log[0].keys()
    assert log[-1]["event"] == "end"


@pytest.mark.parametrize("algo", ["dflash", "eagle3"])
def test_resume_reproduces_the_uninterrupted_loss_trace_exactly(cache, target, tmp_path, algo):
    config = tiny_config(algo, steps=8)
    full = run(config, cache, target, tmp_path / "full")
    run(config, cache, target, tmp_path / "cut", stop_after=4)
    resumed = run(config, cache, target, tmp_path / "cut", resume=True)
    assert resumed.losses == full.losses[4:]  # bit for bit: model, optimizer moments and the batch schedule restored


def test_every_algorithm_trains_on_the_same_batches(cache, target, tmp_path):
    logs = {}
    for algo in ("dspark", "dflash", "eagle3"):
        run(tiny_config(algo, steps=3, markov_rank=8), cache, target, tmp_path / algo)
        logs[algo] = [(e["blocks"], e["labels"], e["context_tokens"]) for e in read_metrics(tmp_path / algo) if "step" in e]
    assert logs["dspark"] == logs["dflash"] == logs["eagle3"]


@pytest.mark.parametrize("algo, cls", [("dflash", "DFlashServingDrafter"), ("eagle3", "Eagle3ServingDrafter")])
def test_the_final_checkpoint_is_what_make_drafter_serves(cache, target, tmp_path, algo, cls):
    result = run(tiny_config(algo, steps=2), cache, target, tmp_path / "run")
    config = json.loads((result.final_dir / "config.json").read_text())
    assert config["algo"] == algo and tuple(config["target_layer_ids"]) == cache.capture_layers
    runtime = make_tiny_runtime(capture_layers=CAPTURE, compute_dtype=torch.float32)  # the cache's target (seed 0)
    drafter = make_drafter(algo, runtime=runtime, path=result.final_dir)
    assert type(drafter).__name__ == cls and drafter.spec.block_size == 4


def test_eagle3_is_a_one_layer_drafter():
    with pytest.raises(ValueError, match="EAGLE-3 is a one-layer drafter"):
        tiny_config("eagle3", layers=2)
    assert tiny_config("dflash", layers=3).layers == 3


def test_the_cli_offers_the_three_algorithms():
    import argparse

    from dspark.training.cli import add_train_parsers

    parser = argparse.ArgumentParser()
    add_train_parsers(parser.add_subparsers(dest="command"))
    for algo in ("dspark", "dflash", "eagle3"):
        args = parser.parse_args(["train", "--cache", "C", "--out", "R", "--algo", algo])
        assert args.algo == algo and args.layers is None  # depth resolved per algorithm (eagle3: 1, else 2)
    with pytest.raises(SystemExit):
        parser.parse_args(["train", "--cache", "C", "--out", "R", "--algo", "medusa"])
