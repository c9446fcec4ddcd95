"""Specification tests of the held-out evaluation (training/heldout.py) and its place in training.

Tiny random target and drafters, the tiny cache of test_target_cache (6 train + 3 held-out
sequences): τ equals 1 + Σ_k Π_{i≤k} c*_i computed by hand from the drafter's logits and the
target's p_t on the same blocks, results do not depend on how sequences are batched, and
evaluating changes neither the model's mode nor the training trace.
"""

from __future__ import annotations

import json

import pytest
import torch

from dspark.drafters.registry import family
from dspark.drafters.shared import SharedWeights
from dspark.training.anchors import sample_batch
from dspark.training.heldout import EVAL_EPOCH, evaluate_heldout
from dspark.training.losses import target_probs_from_hidden
from dspark.training.trainer import read_metrics
from tests.training.test_trainer import cache, run, target, tiny_config  # noqa: F401  (fixtures)


def build(algo_name: str, cache, target, **kw):  # noqa: F811
    config = tiny_config(algo=algo_name, **kw)
    torch.manual_seed(0)
    algo = family(algo_name).objective
    return algo, algo.build(config=config, target_config=target.config, cache=cache, shared=SharedWeights.from_target(target))


def test_tau_is_the_analytic_accepted_length_of_the_teacher_forced_drafts(cache, target):  # noqa: F811
    algo, model = build("dspark", cache, target)
    heldout = cache.indices("heldout")
    assert len(heldout) == 3
    batch = sample_batch(cache, heldout, anchors_per_seq=8, block_size=4, seed=0, epoch=EVAL_EPOCH)
    with torch.no_grad():
        model.eval()
        logits = model(batch.blocks, target_tokens=batch.target_tokens).logits  # [rows, nb, γ, V]
    valid = batch.blocks.block_valid
    p_d = torch.softmax(logits[valid].float(), -1)  # [n, γ, V]
    n, gamma, vocab = p_d.shape
    p_t = target_probs_from_hidden(batch.target_hidden[valid].reshape(n * gamma, -1), model.shared.lm_head).view(n, gamma, vocab)
    c_star = (1 - 0.5 * (p_d - p_t).abs().sum(-1)) * batch.label_mask[valid]  # [n, γ]; 0 past the sequence's end
    tau = float((1 + c_star.cumprod(-1).sum(-1)).mean())

    model.train()
    one_batch = evaluate_heldout(algo, model, cache, block_size=4, anchors_per_seq=8, batch_seqs=3, seed=0)
    per_sequence = evaluate_heldout(algo, model, cache, block_size=4, anchors_per_seq=8, batch_seqs=1, seed=0)
    assert model.training  # the mode is restored
    assert one_batch.sequences == 3 and one_batch.blocks == n and one_batch.labels == int(batch.label_mask.sum())
    assert one_batch.tau == pytest.approx(tau, abs=1e-5)
    assert 1.0 <= one_batch.tau <= 1.0 + gamma
    for field in ("tau", "acc", "tv"):  # batching changes only float rounding
        assert getattr(per_sequence, field) == pytest.approx(getattr(one_batch, field), rel=1e-3)
    assert per_sequence.acc_per_pos == pytest.approx(one_batch.acc_per_pos, abs=1e-4)  # the log rounds to 4 digits


@pytest.mark.parametrize("algo_name", ["dspark", "dflash", "eagle3"])
def test_evaluation_is_deterministic_and_leaves_the_global_rng_alone(cache, target, algo_name):  # noqa: F811
    algo, model = build(algo_name, cache, target)
    state = torch.get_rng_state()
    first = evaluate_heldout(algo, model, cache, block_size=4, anchors_per_seq=8, seed=0)
    assert torch.equal(torch.get_rng_state(), state)
    second = evaluate_heldout(algo, model, cache, block_size=4, anchors_per_seq=8, seed=0)
    assert first == second
    assert len(first.acc_per_pos) == 4 and all(0.0 <= a <= 1.0 for a in first.acc_per_pos)
    assert first.to_dict()["split"] == "heldout"


def test_an_empty_split_gives_none(cache, target):  # noqa: F811
    algo, model = build("dspark", cache, target)
    assert evaluate_heldout(algo, model, cache, block_size=4, max_sequences=0) is None


def test_training_logs_heldout_evaluations_without_changing_the_trace(cache, target, tmp_path):  # noqa: F811
    plain = run(tiny_config(steps=8), cache, target, tmp_path / "plain")
    evaluated = run(tiny_config(steps=8, eval_every=3), cache, target, tmp_path / "eval")
    assert evaluated.losses == plain.losses  # bit for bit: evaluation draws no training randomness
    log = read_metrics(tmp_path / "eval")
    evals = [e for e in log if e.get("event") == "eval"]
    assert [e["step"] for e in evals] == [3, 6, 8]  # every 3 steps and at the end
    assert all(e["split"] == "heldout" and e["tau"] >= 1.0 for e in evals)
    assert log[-1]["event"] == "end" and log[-1]["heldout"]["tau"] == evals[-1]["tau"]
    # without --eval-every the end line still carries the final held-out numbers
    assert read_metrics(tmp_path / "plain")[-1]["heldout"]["blocks"] > 0


def test_resume_keeps_the_evaluations_logged_before_the_checkpoint(cache, target, tmp_path):  # noqa: F811
    config = tiny_config(steps=8, eval_every=2, checkpoint_every=4)
    full = run(config, cache, target, tmp_path / "full")
    run(config, cache, target, tmp_path / "cut", stop_after=6)
    (tmp_path / "cut" / "checkpoints" / "latest").write_text("step-0000004")
    run(config, cache, target, tmp_path / "cut", resume=True)
    steps = [e["step"] for e in read_metrics(tmp_path / "cut") if e.get("event") == "eval"]
    assert steps == [2, 4, 6, 8]
    cut = [e for e in read_metrics(tmp_path / "cut") if e.get("event") == "eval"]
    assert cut == [e for e in read_metrics(full.run_dir) if e.get("event") == "eval"]


def test_the_heldout_command_reproduces_the_numbers_training_logged(cache, target, tmp_path, capsys):  # noqa: F811
    from dspark.cli import main
    from tests.services.conftest import write_tiny_model_dir

    result = run(tiny_config(steps=4), cache, target, tmp_path / "run")
    logged = read_metrics(tmp_path / "run")[-1]["heldout"]
    model_dir = write_tiny_model_dir(tmp_path / "tiny-model")  # the same random weights as `target`
    argv = ["heldout", "--drafter", str(result.final_dir), "--cache", str(cache.path), "--model", str(model_dir),
            "--target-dtype", "float32", "--precision", "fp32", "--anchors-per-seq", "8", "--batch-seqs", "3"]
    assert main(argv) == 0
    printed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert printed["tau"] == logged["tau"] and printed["acc_per_pos"] == logged["acc_per_pos"]
    assert main(argv[:2] + [str(tmp_path / "missing")] + argv[3:]) == 2
    assert "cannot load" in capsys.readouterr().err


def test_the_runs_command_tabulates_plots_and_refuses_unfinished_runs(cache, target, tmp_path, capsys):  # noqa: F811
    from dspark.cli import main

    run(tiny_config(steps=4, eval_every=2), cache, target, tmp_path / "a")
    run(tiny_config(steps=4, eval_every=2, algo="dflash"), cache, target, tmp_path / "b")
    out, plot = tmp_path / "runs.json", tmp_path / "runs.png"
    assert main(["runs", f"one={tmp_path / 'a'}", f"two={tmp_path / 'b'}", "--reference", "two",
                 "--out", str(out), "--plot", str(plot)]) == 0
    table = capsys.readouterr().out
    assert "| one | dspark | 1 | 4 | 4 |" in table and "τ / two" in table
    payload = json.loads(out.read_text())
    assert [r["label"] for r in payload["runs"]] == ["one", "two"]
    assert [step for step, _ in payload["runs"][0]["curve"]] == [2, 4]
    assert plot.stat().st_size > 0
    run(tiny_config(steps=4), cache, target, tmp_path / "cut", stop_after=2)
    assert main(["runs", str(tmp_path / "cut")]) == 2
    assert "not finished" in capsys.readouterr().err
    assert main(["runs", str(tmp_path / "a"), "--reference", "nope"]) == 2


def test_runs_at_several_block_sizes_are_each_compared_with_the_reference_at_their_own_block_size(cache, target, tmp_path, capsys):  # noqa: F811
    from dspark.cli import main

    dirs = {}
    for algo in ("dspark", "dflash"):
        for gamma in (2, 4):
            dirs[f"{algo}-g{gamma}"] = tmp_path / f"{algo}-g{gamma}"
            run(tiny_config(steps=2, algo=algo, block_size=gamma), cache, target, dirs[f"{algo}-g{gamma}"])
    out, plot = tmp_path / "runs.json", tmp_path / "runs.png"
    assert main(["runs", *(f"{k}={v}" for k, v in dirs.items()), "--reference", "dflash-g2",
                 "--out", str(out), "--plot", str(plot)]) == 0
    assert "τ / dflash 1L, same γ" in capsys.readouterr().out
    runs = {r["label"]: r for r in json.loads(out.read_text())["runs"]}
    assert [runs[k]["block_size"] for k in dirs] == [2, 4, 2, 4]
    assert len(runs["dspark-g4"]["heldout_acc_per_pos"]) == 4
    for gamma in (2, 4):  # divided by DFlash at the same γ, never by DFlash at γ = 2 alone
        assert runs[f"dspark-g{gamma}"]["tau_over_reference"] == pytest.approx(
            runs[f"dspark-g{gamma}"]["heldout_tau"] / runs[f"dflash-g{gamma}"]["heldout_tau"])
        assert runs[f"dflash-g{gamma}"]["tau_over_reference"] == pytest.approx(1.0)
    assert runs["dspark-g2"]["markov_rank"] == 16 and runs["dflash-g2"]["markov_rank"] is None
    assert plot.stat().st_size > 0
