"""`dspark` command line: generate (plain, n-gram, DSpark drafters), profile, and bad input."""

from __future__ import annotations

import json

import pytest
import torch

from dspark.cli import main

PROMPT = "Write a Python function that returns the square of a number."


def generate_json(capsys, *args: str) -> dict:
    assert main(["generate", PROMPT, "--max-tokens", "24", "--temperature", "0", "--json", *args]) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_a_negative_temperature_is_refused_with_a_message(capsys):
    assert main(["generate", "hi", "--temperature", "-1"]) == 2
    assert "temperature must be 0 (greedy) or a finite number" in capsys.readouterr().err


def test_a_drafter_family_without_a_shipped_checkpoint_needs_a_path(capsys):
    assert main(["generate", "hi", "--drafter", "eagle3"]) == 2
    assert "--drafter-path" in capsys.readouterr().err


@pytest.mark.slow
def test_generate_with_the_shipped_dspark_drafter_at_temperature_0_equals_plain_decoding(capsys, real_model_dir):
    plain = generate_json(capsys, "--drafter", "none")
    shipped = generate_json(capsys, "--drafter", "dspark")  # no --drafter-path: the packaged checkpoint
    assert shipped["token_ids"] == plain["token_ids"]
    assert shipped["draft_tokens"] > 0 and shipped["mean_accepted_length"] > 1.0  # trained: some drafts survive


@pytest.mark.slow
def test_generate_json_reports_text_tokens_and_speculation_statistics(capsys, real_model_dir):
    plain = generate_json(capsys, "--drafter", "none")
    ngram = generate_json(capsys, "--drafter", "ngram")
    for out in (plain, ngram):
        assert {"text", "token_ids", "rounds", "mean_accepted_length"} <= out.keys()
    assert plain["mean_accepted_length"] == 1.0 and plain["rounds"] == len(plain["token_ids"]) - 1
    assert ngram["token_ids"] == plain["token_ids"] and ngram["text"] == plain["text"]
    assert ngram["draft_tokens"] > 0 and plain["draft_tokens"] == 0  # the n-gram drafter's drafts were verified


@pytest.mark.slow
def test_generate_with_a_dspark_checkpoint_at_temperature_0_equals_plain_decoding(capsys, tmp_path, real_model_dir):
    from dspark.drafters.dspark.checkpoint import save_checkpoint
    from dspark.drafters.dspark.config import DSparkConfig
    from dspark.drafters.dspark.model import DSparkDrafter
    from dspark.drafters.shared import SharedWeights
    from dspark.model.config import ModelConfig
    from dspark.model.target_runtime import default_capture_layers
    from dspark.model.transformer import Transformer

    target_config = ModelConfig.from_dir(real_model_dir)
    torch.manual_seed(0)
    config = DSparkConfig.from_target(target_config, num_layers=1, markov_rank=16,
                                      target_layer_ids=default_capture_layers(target_config.num_layers))
    # an untrained drafter: its drafts are mostly rejected, which must not change a single token
    shared = SharedWeights.from_target(Transformer.from_dir(real_model_dir))
    save_checkpoint(tmp_path, drafter=DSparkDrafter(config, shared=shared))
    plain = generate_json(capsys, "--drafter", "none")
    dspark = generate_json(capsys, "--drafter", "dspark", "--drafter-path", str(tmp_path))
    assert dspark["token_ids"] == plain["token_ids"]
    assert dspark["draft_tokens"] > 0


@pytest.mark.slow
def test_profile_prints_an_sps_table(capsys, real_model_dir):
    assert main(["profile", "--max-batch", "4", "--repeats", "1", "--context-len", "16"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0].split() == ["B", "ms/step", "SPS", "tokens/s"]
    assert [int(l.split()[0]) for l in lines[1:]] == [1, 2, 3, 4]


@pytest.mark.slow
def test_a_policy_needing_confidences_with_the_ngram_drafter_is_refused_with_a_message(capsys, real_model_dir):
    assert main(["generate", "hi", "--drafter", "ngram", "--policy", "dspark", "--max-tokens", "4"]) == 2
    assert "needs calibrated confidences" in capsys.readouterr().err


@pytest.mark.slow
def test_generate_with_a_fixed_policy_equals_plain_decoding(capsys, real_model_dir):
    plain = generate_json(capsys, "--drafter", "none")
    fixed = generate_json(capsys, "--drafter", "ngram", "--policy", "fixed:2")
    assert fixed["token_ids"] == plain["token_ids"] and 0 < fixed["draft_tokens"] <= 2 * fixed["rounds"]


@pytest.mark.parametrize("argv, env, policy", [
    (["serve", "--drafter", "none"], {}, "none"),  # nothing to schedule: plain decoding, not the default dspark
    (["serve"], {}, "dspark"),
    (["serve", "--drafter", "none", "--policy", "fixed:1"], {}, "fixed:1"),  # explicit wins (and the engine refuses it)
    (["serve", "--drafter", "none"], {"DSPARK_SCHEDULER_POLICY": "fixed:2"}, "fixed:2"),  # so does a configured one
    (["scheduler"], {"DSPARK_DRAFTER_NAME": "none"}, "none"),  # every command: one resolution
    (["generate", "hi"], {}, ""),  # generate verifies all γ drafts unless told otherwise
    (["generate", "hi"], {"DSPARK_SCHEDULER_POLICY": "fixed:3"}, "fixed:3"),
])
def test_the_policy_defaults_to_plain_decoding_without_a_drafter(argv, env, policy):
    from dspark.cli import resolve_for

    assert resolve_for(argv[0], argv[1:], env=env).scheduler.policy == policy


@pytest.mark.slow
def test_generate_logprobs_gives_each_tokens_target_logprob_and_its_alternatives(capsys, real_model_dir):
    plain = generate_json(capsys, "--drafter", "none")
    speculative = generate_json(capsys, "--drafter", "ngram", "--logprobs", "3")
    assert speculative["token_ids"] == plain["token_ids"] and "logprobs" not in plain
    content = speculative["logprobs"]["content"]
    assert [e["token_id"] for e in content] == speculative["token_ids"]
    for e in content:
        alternatives = e["top_logprobs"]
        assert len(alternatives) == 3 and all(a["logprob"] <= 0 for a in alternatives)
        assert [a["logprob"] for a in alternatives] == sorted((a["logprob"] for a in alternatives), reverse=True)
        # greedy: the emitted token is the target's most likely one, with the same log-probability
        assert alternatives[0]["token_id"] == e["token_id"] and alternatives[0]["logprob"] == pytest.approx(e["logprob"])


def test_generate_refuses_more_logprobs_than_the_engine_computes(capsys):
    assert main(["generate", "hi", "--max-tokens", "2", "--logprobs", "99"]) == 2
    assert "logprobs must be None or in [0, 20]" in capsys.readouterr().err
