"""The offline evaluation end to end on the tiny target: n-gram and a tiny random DSpark drafter.

Specification: the results file starts with the issue's schema (target, temperature,
block_size, prompts_per_benchmark, tau per drafter and benchmark) and holds every number the
figures need; τ per benchmark is emitted / rounds; a drafter cannot draft past its trained block
(runs are capped, sweep points listed as unsupported); finished benchmarks are read back from
the work dir; the table has a row per drafter x temperature and a mean column; the figures are
written when their data exists.
"""

from __future__ import annotations

import json

import pytest

from dspark.evaluation.offline_eval import DrafterSpec, EvalConfig, run_offline_eval, write_results
from dspark.evaluation.plots import write_plots
from dspark.evaluation.report import render_report, render_table
from tests.conftest import make_tiny_runtime
from tests.evaluation.conftest import ByteChatTokenizer, save_tiny_dspark_checkpoint

BENCHES = ("humaneval", "mt-bench")  # one code benchmark, one two-turn chat benchmark


def tiny_loader(capture_layers):
    return make_tiny_runtime(capture_layers=capture_layers)


@pytest.fixture(scope="module")
def dspark_path(tmp_path_factory):
    return str(save_tiny_dspark_checkpoint(make_tiny_runtime().model, tmp_path_factory.mktemp("ckpt") / "dspark"))


def make_config(dspark_path: str, **overrides) -> EvalConfig:
    base = {"drafters": (DrafterSpec.parse(f"dspark={dspark_path}"), DrafterSpec.parse("ngram")), "benchmarks": BENCHES,
            "limit": 1, "temperatures": (0.0, 1.0), "gamma": 4, "block_sizes": (2, 8), "max_new_tokens": 8, "target": "tiny-random"}
    base.update(overrides)
    return EvalConfig(**base)


@pytest.fixture(scope="module")
def results(dspark_path):
    return run_offline_eval(make_config(dspark_path), load_runtime=tiny_loader, tokenizer=ByteChatTokenizer(),
                            progress=False, log=lambda msg: None)


def test_the_results_file_starts_with_the_issue_schema(results, tmp_path):
    assert results["target"] == "tiny-random"
    assert results["temperature"] == 1.0  # the paper's Table 1 temperature is the headline
    assert results["block_size"] == 4 and results["prompts_per_benchmark"] == 1
    assert set(results["tau"]) == {"dspark", "ngram"}
    for label in ("dspark", "ngram"):
        assert set(results["tau"][label]) == set(BENCHES)
        assert all(isinstance(v, float) and v >= 1.0 for v in results["tau"][label].values())
    path = write_results(results, tmp_path / "out" / "offline_eval.json")
    assert json.loads(path.read_text(), parse_constant=lambda c: pytest.fail(f"{c} in the JSON")) == results


def test_tau_per_benchmark_is_emitted_over_rounds_and_runs_cover_every_setting(results):
    runs = {(r["label"], r["temperature"], r["requested_gamma"]): r for r in results["runs"]}
    # n-gram at every γ; DSpark (trained block 4) at 4 and 2, not 8
    assert set(runs) == {(d, t, g) for t in (0.0, 1.0) for d, gs in (("ngram", (4, 2, 8)), ("dspark", (4, 2))) for g in gs}
    assert {(u["label"], u["temperature"], u["gamma"]) for u in results["unsupported"]} == {("dspark", 0.0, 8), ("dspark", 1.0, 8)}
    for run in runs.values():
        for bench in run["benchmarks"].values():
            assert bench["tau"] == bench["emitted_in_rounds"] / bench["rounds"]
            assert bench["requests"] == (2 if run["benchmarks"]["mt-bench"] is bench else 1)  # both MT-Bench turns
            assert len(bench["position_acceptance"]["rate"]) == run["gamma"]
        assert run["domains"]["all"]["tau"] == pytest.approx(sum(b["tau"] for b in run["benchmarks"].values()) / len(BENCHES))
        assert set(run["domains"]) == {"code", "chat", "all"}
    assert results["tau"]["ngram"]["humaneval"] == runs[("ngram", 1.0, 4)]["benchmarks"]["humaneval"]["tau"]
    assert results["greedy_outputs_agree"] == {b: True for b in BENCHES}  # lossless at temperature 0
    assert results["greedy_reference"] == "plain decoding"


def test_greedy_agreement_is_judged_against_plain_decoding_not_between_drafters(dspark_path, monkeypatch):
    """Two drafters that agree with each other but not with plain decoding are flagged."""
    import dataclasses

    from dspark.evaluation import offline_eval

    real = offline_eval.run_conversations

    def plain_differs(runtime, drafter, *args, **kwargs):
        run = real(runtime, drafter, *args, **kwargs)
        return dataclasses.replace(run, output_digest="not-the-drafters'") if drafter is None else run

    monkeypatch.setattr(offline_eval, "run_conversations", plain_differs)
    config = make_config(dspark_path, temperatures=(0.0,), block_sizes=())
    out = run_offline_eval(config, load_runtime=tiny_loader, tokenizer=ByteChatTokenizer(), progress=False, log=lambda m: None)
    digests = {r["benchmarks"]["humaneval"]["output_digest"] for r in out["runs"]}
    assert len(digests) == 1  # the drafters agree with each other...
    assert out["greedy_outputs_agree"] == {b: False for b in BENCHES}  # ...and that is not enough
    assert "WARNING: greedy outputs differ from plain decoding" in render_report(out)


def test_drafters_with_confidences_get_the_threshold_sweep_and_reliability(results):
    for run in results["runs"]:
        overall = run["domains"]["all"]
        if run["drafter"] == "ngram":
            assert "threshold_sweep" not in overall and "reliability" not in overall
            continue
        sweep = overall["threshold_sweep"]["conditional"]
        assert sweep["thresholds"][0] == 0.0
        assert sweep["accepted_length"][0] == pytest.approx(overall["tau_pooled"])  # C = 0 is the run itself
        assert sweep["verified_per_round"] == sorted(sweep["verified_per_round"], reverse=True)
        assert len(overall["reliability"]["positions"]) == run["gamma"]


def test_a_main_run_past_the_trained_block_is_capped_and_says_so(dspark_path):
    config = make_config(dspark_path, drafters=(DrafterSpec.parse(f"dspark={dspark_path}"),), benchmarks=("mbpp",),
                         temperatures=(0.0,), gamma=6, block_sizes=(), max_new_tokens=6)
    out = run_offline_eval(config, load_runtime=tiny_loader, tokenizer=ByteChatTokenizer(), progress=False, log=lambda m: None)
    (run,) = out["runs"]
    assert (run["gamma"], run["requested_gamma"]) == (4, 6)
    assert "| dspark | 0 | 4 (of 6) |" in render_table(out)


def test_finished_benchmarks_are_read_back_from_the_work_dir(dspark_path, tmp_path):
    config = make_config(dspark_path, drafters=(DrafterSpec.parse("ngram"),), temperatures=(1.0,), block_sizes=())
    logs: list[str] = []
    first = run_offline_eval(config, load_runtime=tiny_loader, tokenizer=ByteChatTokenizer(), work_dir=tmp_path,
                             progress=False, log=logs.append)
    assert sum("τ=" in m for m in logs) == len(BENCHES)
    logs.clear()
    again = run_offline_eval(config, load_runtime=tiny_loader, tokenizer=ByteChatTokenizer(), work_dir=tmp_path,
                             progress=False, log=logs.append)
    assert logs == [] and again == first
    longer = make_config(dspark_path, drafters=(DrafterSpec.parse("ngram"),), temperatures=(1.0,), block_sizes=(),
                         max_new_tokens=9)
    run_offline_eval(longer, load_runtime=tiny_loader, tokenizer=ByteChatTokenizer(), work_dir=tmp_path,
                     progress=False, log=logs.append)
    assert sum("τ=" in m for m in logs) == len(BENCHES)  # another setting: recomputed, not mixed up


def test_a_change_to_the_package_source_invalidates_the_work_dir(dspark_path, tmp_path, monkeypatch):
    from dspark.evaluation import offline_eval

    config = make_config(dspark_path, drafters=(DrafterSpec.parse("ngram"),), temperatures=(1.0,), block_sizes=())
    kwargs = dict(load_runtime=tiny_loader, tokenizer=ByteChatTokenizer(), work_dir=tmp_path, progress=False)
    run_offline_eval(config, **kwargs, log=lambda m: None)
    logs: list[str] = []
    monkeypatch.setattr(offline_eval, "_code_digest", lambda: "another version of the drafters")
    run_offline_eval(config, **kwargs, log=logs.append)
    assert sum("τ=" in m for m in logs) == len(BENCHES)  # recomputed with the new code, not read back


def test_the_table_has_a_row_per_drafter_and_temperature_and_a_mean_column(results):
    lines = render_table(results).splitlines()
    assert lines[0] == "| drafter | T | γ | humaneval | mt-bench | mean |"
    rows = [line.split(" | ") for line in lines[2:]]
    assert [(r[0].lstrip("| "), r[1]) for r in rows] == [("dspark", "0"), ("dspark", "1"), ("ngram", "0"), ("ngram", "1")]
    tau = results["tau"]["ngram"]
    ngram_t1 = rows[3]
    assert ngram_t1[3:5] == [f"{tau['humaneval']:.2f}", f"{tau['mt-bench']:.2f}"]
    assert ngram_t1[5].rstrip(" |") == f"{(tau['humaneval'] + tau['mt-bench']) / 2:.2f}"
    report = render_report(results)
    assert "T=1: dspark / ngram:" in report and "Mean τ against block size γ" in report and "dspark γ=8" in report


def test_every_figure_with_data_is_written_as_png(results, tmp_path):
    written = write_plots(results, tmp_path)
    assert sorted(p.name for p in written) == [
        "fig2_position_acceptance.png", "fig4_block_size.png", "fig5_threshold_sweep.png", "fig6_reliability.png"]
    assert all(p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in written)
    ngram_only = dict(results, runs=[r for r in results["runs"] if r["drafter"] == "ngram" and r["requested_gamma"] == 4])
    assert [p.name for p in write_plots(ngram_only, tmp_path / "ngram")] == ["fig2_position_acceptance.png"]


@pytest.mark.parametrize("text, spec", [
    ("ngram", DrafterSpec("ngram", "ngram", None)),
    ("dspark=runs/d", DrafterSpec("dspark", "dspark", "runs/d")),
    ("d2@dspark=runs/d2", DrafterSpec("d2", "dspark", "runs/d2")),
])
def test_drafter_specs_are_label_name_and_path(text, spec):
    assert DrafterSpec.parse(text) == spec


@pytest.mark.parametrize("overrides, message", [
    ({"drafters": ()}, "at least one drafter"),
    ({"drafters": (DrafterSpec.parse("nope"),)}, "unknown drafter 'nope'"),
    ({"drafters": (DrafterSpec.parse("ngram"), DrafterSpec.parse("ngram"))}, "labels must be unique"),
    ({"benchmarks": ("alpaca",)}, "unknown benchmarks"),
    ({"limit": 0}, "limit must be >= 1"),
    ({"temperatures": (-1.0,)}, "temperatures"),
    ({"gamma": 0}, "block sizes must be >= 1"),
    ({"thresholds": (2.0,)}, "thresholds"),
])
def test_bad_settings_are_refused_with_a_message(overrides, message):
    with pytest.raises(ValueError, match=message):
        make_config("unused", **{"drafters": (DrafterSpec.parse("ngram"),), **overrides})


def test_a_malformed_drafter_spec_is_refused_with_a_message():
    with pytest.raises(ValueError, match=r"\[LABEL@\]NAME\[=PATH\]"):
        DrafterSpec.parse("dspark=")
