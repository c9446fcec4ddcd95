"""`dspark eval` on a whole tiny model directory (random Llama + byte-level tokenizer).

Specification: a --limit 1 run writes the results JSON (the issue's schema), the figures, and
prints the Table 1 markdown; a rerun reads every benchmark from the work dir; bad input exits
with status 2 and a message, never a traceback.
"""

from __future__ import annotations

import json

import pytest

from dspark.cli import main


def eval_args(model_dir, tmp_path, *extra: str) -> list[str]:
    return ["eval", "--model", str(model_dir), "--limit", "1", "--max-new-tokens", "8", "--benchmarks", "humaneval,mt-bench",
            "--out", str(tmp_path / "results" / "offline_eval.json"), "--work-dir", str(tmp_path / "work"), "--no-progress",
            *extra]


def test_eval_writes_results_figures_and_prints_the_table(capsys, tmp_path, tiny_model_dir, tiny_model_dspark_checkpoint):
    args = eval_args(tiny_model_dir, tmp_path, "--drafter", f"dspark={tiny_model_dspark_checkpoint}", "--drafter", "ngram",
                     "--temperature", "0,1", "--gamma", "4", "--dtype", "float32")
    assert main(args) == 0
    out, err = capsys.readouterr()
    results = json.loads((tmp_path / "results" / "offline_eval.json").read_text())
    assert (results["target"], results["temperature"], results["block_size"], results["prompts_per_benchmark"]) == (
        str(tiny_model_dir), 1.0, 4, 1)
    assert set(results["tau"]) == {"dspark", "ngram"} and set(results["tau"]["dspark"]) == {"humaneval", "mt-bench"}
    assert "| drafter | T | γ | humaneval | mt-bench | mean |" in out
    assert f"| ngram | 1 | 4 | {results['tau']['ngram']['humaneval']:.2f} |" in out
    figures = sorted(p.name for p in (tmp_path / "results").glob("*.png"))
    assert figures == ["fig2_position_acceptance.png", "fig5_threshold_sweep.png", "fig6_reliability.png"]
    assert "τ=" in err  # progress lines of the benchmarks it ran

    assert main(args) == 0  # resumed: everything read back from the work dir
    out_again, err_again = capsys.readouterr()
    assert "τ=" not in err_again and out_again == out


@pytest.mark.parametrize("extra, message", [
    (["--drafter", "eagle3"], "give a checkpoint as NAME=PATH"),
    (["--drafter", "dspark=/nonexistent/ckpt"], "/nonexistent/ckpt"),
    (["--drafter", "ngram", "--benchmarks", "alpaca"], "unknown benchmarks"),
    (["--drafter", "dspark="], "[LABEL@]NAME[=PATH]"),
    (["--drafter", "ngram", "--limit", "0"], "limit must be >= 1"),
])
def test_bad_input_exits_with_a_message(capsys, tmp_path, tiny_model_dir, extra, message):
    args = eval_args(tiny_model_dir, tmp_path)
    args[args.index("--benchmarks") + 1 : args.index("--benchmarks") + 2] = ["humaneval"]
    assert main(args + extra) == 2
    assert message in capsys.readouterr().err


def test_unparseable_temperatures_are_an_argument_error(capsys, tmp_path, tiny_model_dir):
    with pytest.raises(SystemExit) as exit_info:
        main(eval_args(tiny_model_dir, tmp_path, "--drafter", "ngram", "--temperature", "hot"))
    assert exit_info.value.code == 2 and "comma-separated numbers" in capsys.readouterr().err


@pytest.mark.slow
def test_eval_on_the_default_model(capsys, tmp_path, real_model_dir):
    assert main(["eval", "--drafter", "ngram", "--limit", "1", "--max-new-tokens", "8", "--benchmarks", "humaneval",
                 "--temperature", "0", "--out", str(tmp_path / "r.json"), "--no-plots", "--no-cache", "--no-progress"]) == 0
    results = json.loads((tmp_path / "r.json").read_text())
    run = results["runs"][0]["benchmarks"]["humaneval"]
    assert results["target"] == "smollm2-135m-instruct" and run["requests"] == 1 and run["tokens"] <= 8
    assert run["rounds"] >= 1 and results["tau"]["ngram"]["humaneval"] >= 1.0
