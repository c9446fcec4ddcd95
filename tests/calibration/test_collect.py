"""Specification tests of held-out acceptance collection and STS calibration (calibration/collect.py).

Tiny random target + a briefly trained tiny drafter: the verifier logits of each drafted block
equal a plain reference (prefill of tokens[0..t] + the drafts as one fresh request), observed
acceptance matches its exact probability in expectation, and `calibrate` writes the temperatures
(loadable with the checkpoint), the reliability PNG and the table.
"""

from __future__ import annotations

import json

import pytest
import torch

from dspark.calibration.collect import calibrate, collect_acceptance, verify_logits
from dspark.drafters.dspark import load_checkpoint
from dspark.drafters.shared import SharedWeights
from dspark.training.trainer import TrainConfig, train
from tests.training.test_target_cache import make_tiny_cache, tiny_runtime


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("calib")
    cache = make_tiny_cache(tmp)
    runtime = tiny_runtime()
    config = TrainConfig(steps=6, batch_seqs=3, anchors_per_seq=8, lr=3e-3, layers=1, block_size=4, markov_rank=16, seed=0)
    result = train(config, cache=cache, target_config=runtime.config, shared=SharedWeights.from_target(runtime.model),
                   run_dir=tmp / "run", progress=False)
    drafter = load_checkpoint(result.final_dir, shared=SharedWeights.from_target(runtime.model)).drafter
    return cache, runtime, drafter, result.final_dir


def test_verify_logits_equal_a_fresh_prefill_of_the_drafted_prefix(setup):
    cache, runtime, _, _ = setup
    gamma = 4
    g = torch.Generator().manual_seed(0)
    seqs = cache.indices("heldout")[:2]
    tokens = [cache.tokens(i) for i in seqs]
    anchors = [torch.tensor([cache.sequences[i].prompt_len, cache.sequences[i].length - 2]) for i in seqs]
    drafts = [torch.randint(0, 256, (2, gamma), generator=g) for _ in seqs]
    got = verify_logits(runtime, tokens, anchors, drafts)
    assert got.shape == (4, gamma, 256)
    row = 0
    for tok, a, d in zip(tokens, anchors, drafts):
        for j, t in enumerate(a.tolist()):
            ids = torch.cat([tok[: t + 1], d[j, : gamma - 1]])
            runtime.add_request("ref", ids.numel())
            try:
                ref = runtime.forward(["ref"], ids, [ids.numel()]).logits[t:]  # rows of x_0 .. x_{γ-1}
            finally:
                runtime.free_request("ref")
            torch.testing.assert_close(got[row], ref, rtol=1e-4, atol=1e-4)
            row += 1
    assert not runtime.kv.requests  # every request freed


def test_observed_acceptance_matches_its_exact_probability_in_expectation(setup):
    cache, runtime, drafter, _ = setup
    data = collect_acceptance(drafter, runtime, cache, split="all", anchors_per_seq=16, temperature=1.0, seed=1, progress=False)
    assert data.num_blocks > 50
    v = data.valid[:, 0]
    # position 1 is always verified: E[y_1] = E[c*_1] (y is a Bernoulli draw with mean c*)
    mean_y, mean_c = data.accepted[v, 0].mean(), data.c_star[v, 0].mean()
    se = (mean_c * (1 - mean_c) / v.sum()).sqrt()
    assert abs(mean_y - mean_c) < 4 * se + 1e-3
    assert data.valid.any(0).all() and not data.valid.all()  # blocks near the end are masked


def test_calibrate_end_to_end_writes_temperatures_png_and_table(setup, tmp_path):
    cache, runtime, drafter, final_dir = setup
    data = collect_acceptance(drafter, runtime, cache, split="heldout", anchors_per_seq=16, temperature=1.0, progress=False)
    report = calibrate(data, out_dir=final_dir, block_size=4)
    assert report.png.exists() and report.png.read_bytes()[:4] == b"\x89PNG"
    assert len(report.rows) == 4 and "ECE raw" in report.table
    # position 1 has nothing before it: STS (T = 1 is in its grid) can only lower its ECE; later
    # positions are fitted with the earlier temperatures fixed, so only the mean is compared there
    assert report.rows[0]["ece_after"] <= report.rows[0]["ece_before"] + 1e-12
    assert sum(r["ece_after"] for r in report.rows) <= sum(r["ece_before"] for r in report.rows)
    saved = json.loads((final_dir / "calibration.json").read_text())
    assert len(saved["positions"]) == 4
    ckpt = load_checkpoint(final_dir, shared=SharedWeights.from_target(runtime.model))
    torch.testing.assert_close(ckpt.temperatures, report.temperatures)


def test_greedy_collection_accepts_exactly_the_target_argmax(setup):
    cache, runtime, drafter, _ = setup
    data = collect_acceptance(drafter, runtime, cache, split="heldout", anchors_per_seq=4, temperature=0.0, progress=False)
    assert set(data.accepted.unique().tolist()) <= {0.0, 1.0}
    assert torch.equal(data.accepted, data.c_star)


def test_greedy_and_sampled_requests_get_their_own_temperatures(setup, tmp_path):
    """STS per regime: a temperature-0 fit (survival = argmax match) and a temperature-1 fit live
    side by side in sts.json, and the serving drafter applies the one of each request's regime."""
    from dspark.drafters.base import DraftRequest
    from dspark.drafters.dspark.checkpoint import save_checkpoint
    from dspark.drafters.dspark.serving import DSparkServingDrafter
    from dspark.sampling.params import SamplingParams

    cache, runtime, drafter, _ = setup
    out = tmp_path / "ckpt"
    save_checkpoint(out, drafter=drafter)
    sampled = calibrate(collect_acceptance(drafter, runtime, cache, split="heldout", anchors_per_seq=16, temperature=1.0,
                                           progress=False), out_dir=out, block_size=4)
    greedy = calibrate(collect_acceptance(drafter, runtime, cache, split="heldout", anchors_per_seq=16, temperature=0.0,
                                          progress=False), out_dir=out, block_size=4, regime="greedy")
    assert (out / "calibration_greedy.json").exists() and (out / "reliability_greedy.png").exists()
    ckpt = load_checkpoint(out, shared=SharedWeights.from_target(runtime.model))
    torch.testing.assert_close(ckpt.temperatures, sampled.temperatures)
    torch.testing.assert_close(ckpt.greedy_temperatures, greedy.temperatures)
    assert not torch.equal(ckpt.temperatures, ckpt.greedy_temperatures)

    serving = DSparkServingDrafter(ckpt.drafter, temperatures=ckpt.temperatures, greedy_temperatures=ckpt.greedy_temperatures)
    seq = cache.indices("heldout")[0]
    tokens, t = cache.tokens(seq), cache.sequences[seq].prompt_len
    serving.observe("r", cache.captured(seq, stop=t).float())
    conf = {}
    for temperature in (0.0, 1.0):
        req = DraftRequest("r", tokens[: t + 1].tolist(), t, SamplingParams(temperature=temperature), 4, torch.Generator().manual_seed(0))
        (proposal,) = serving.propose([req])
        conf[temperature] = proposal.confidences
    # the first position's raw logit is the same in both regimes (it reads only h_1 and x_0)
    raw_logit = torch.logit(conf[1.0][0].double()) * ckpt.temperatures[0].double()
    torch.testing.assert_close(torch.sigmoid(raw_logit / ckpt.greedy_temperatures[0].double()).float(), conf[0.0][0])
