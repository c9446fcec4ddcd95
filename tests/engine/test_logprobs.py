"""Log-probabilities of emitted tokens through the engine (dspark/sampling/logprobs.py).

Specification: a request that asks gets, with every emitted token, log_softmax of the target's
logits at that position (the raw distribution, before temperature and filters) and its k most
likely alternatives; greedy decoding with speculation reports the very same tokens AND the very
same log-probabilities, bit for bit, as plain decoding; a request that does not ask gets none,
and a round where no request asks does not compute them. Every speculative test asserts that
drafts were accepted, so none passes vacuously.
"""

from __future__ import annotations

import pytest
import torch

from dspark.drafters.ngram import NgramDrafter
from dspark.engine.speculative import GenerationRequest, SpeculativeEngine
from dspark.engine.verifier import LocalVerifier
from dspark.model.target_runtime import TargetRuntime
from dspark.sampling.logprobs import TokenLogprobs
from dspark.sampling.params import SamplingParams
from tests.engine.test_speculative_engine import PROMPTS, OracleDrafter

GREEDY = SamplingParams(temperature=0.0)


def run(engine: SpeculativeEngine, requests: list[GenerationRequest]) -> dict[str, tuple[list[int], TokenLogprobs | None]]:
    """Every request to the end; per request its tokens and the logprobs of all its step outputs."""
    tokens: dict[str, list[int]] = {r.request_id: [] for r in requests}
    parts: dict[str, list[TokenLogprobs | None]] = {r.request_id: [] for r in requests}
    for r in requests:
        engine.add_request(r)
    while engine.has_unfinished:
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
            parts[out.request_id].append(out.logprobs)
            assert out.logprobs is None or len(out.logprobs) == len(out.new_token_ids)
    result = {}
    for rid, ps in parts.items():
        if all(p is None for p in ps):
            result[rid] = (tokens[rid], None)
            continue
        result[rid] = (tokens[rid], TokenLogprobs([x for p in ps for x in p.logprobs], [x for p in ps for x in p.top_ids],
                                                  [x for p in ps for x in p.top_logprobs]))
    return result


def requests(prompts, *, n: int = 30, logprobs: int | None = 5, params=GREEDY, prefix: str = "r") -> list[GenerationRequest]:
    return [GenerationRequest(f"{prefix}{i}", p, n, params, logprobs=logprobs) for i, p in enumerate(prompts)]


def reference_logprobs(runtime: TargetRuntime, prompt: list[int], output: list[int]) -> torch.Tensor:  # [len(output), vocab]
    """log_softmax of the target's logits at each output position, from one independent forward
    over prompt + output[:-1] on fresh caches (no verifier, no sampler, no speculation)."""
    fresh = TargetRuntime(runtime.model, kv_budget_tokens=1024)
    tokens = prompt + output[:-1]
    fresh.add_request("reference", len(tokens) + 1)
    logits = fresh.forward(["reference"], torch.tensor(tokens), [len(tokens)]).logits  # [len(tokens), vocab]
    return torch.log_softmax(logits[len(prompt) - 1 :].float(), dim=-1)


@pytest.mark.parametrize("drafter", ["ngram", "oracle"])
def test_greedy_logprobs_with_speculation_equal_plain_decodings_bit_for_bit(tiny_runtime, drafter):
    plain = run(SpeculativeEngine(tiny_runtime, None), requests(PROMPTS))
    d = NgramDrafter() if drafter == "ngram" else OracleDrafter({tuple(p): plain[f"r{i}"][0] for i, p in enumerate(PROMPTS)})
    engine = SpeculativeEngine(tiny_runtime, d, num_speculative_tokens=4)
    spec = run(engine, requests(PROMPTS))
    assert engine.counters.emitted_in_decode_rounds > engine.counters.decode_request_rounds  # drafts were accepted
    for rid, (tokens, lp) in plain.items():
        assert spec[rid][0] == tokens
        assert spec[rid][1] == lp  # every float equal: the same bits (NaN never appears in an emitted entry)
        assert len(lp) == 30 and all(len(alternatives) == 5 for alternatives in lp.top_ids)


def test_logprobs_are_log_softmax_of_the_targets_logits_computed_independently(tiny_runtime):
    prompt = PROMPTS[2]
    ((tokens, lp),) = run(SpeculativeEngine(tiny_runtime, NgramDrafter(), num_speculative_tokens=3), requests([prompt], n=8)).values()
    reference = reference_logprobs(tiny_runtime, prompt, tokens)  # [8, vocab]
    expected = reference.gather(1, torch.tensor(tokens)[:, None]).squeeze(1)
    assert torch.equal(torch.tensor(lp.logprobs), expected)  # the forward is batch-invariant: exactly these bits
    top = torch.sort(reference, dim=-1, descending=True, stable=True)
    assert lp.top_ids == top.indices[:, :5].tolist()
    assert torch.equal(torch.tensor(lp.top_logprobs), top.values[:, :5])
    assert [ids[0] for ids in lp.top_ids] == tokens  # greedy: the emitted token is the most likely one


def test_a_sampled_requests_logprobs_are_the_raw_distribution_not_the_tempered_one(tiny_runtime):
    prompt = PROMPTS[4]
    params = SamplingParams(temperature=0.6, top_k=20, seed=7)
    ((tokens, lp),) = run(SpeculativeEngine(tiny_runtime, NgramDrafter(), num_speculative_tokens=3),
                          requests([prompt], n=12, params=params, logprobs=2)).values()
    reference = reference_logprobs(tiny_runtime, prompt, tokens)
    assert torch.equal(torch.tensor(lp.logprobs), reference.gather(1, torch.tensor(tokens)[:, None]).squeeze(1))
    assert lp.top_ids == torch.sort(reference, dim=-1, descending=True, stable=True).indices[:, :2].tolist()


def test_requests_that_do_not_ask_get_none_and_do_not_change_the_others(tiny_runtime):
    alone = run(SpeculativeEngine(tiny_runtime, NgramDrafter(), num_speculative_tokens=3), requests(PROMPTS[:1], logprobs=3))
    mixed = run(SpeculativeEngine(tiny_runtime, NgramDrafter(), num_speculative_tokens=3),
                requests(PROMPTS[:1], logprobs=3) + requests(PROMPTS[1:3], logprobs=None, prefix="other"))
    assert mixed["r0"] == alone["r0"]
    assert mixed["other0"][1] is None and mixed["other1"][1] is None
    # 0 alternatives: only the emitted token's own log-probability
    ((_, own),) = run(SpeculativeEngine(tiny_runtime, None), requests(PROMPTS[:1], logprobs=0)).values()
    assert own.logprobs == alone["r0"][1].logprobs and all(ids == [] for ids in own.top_ids)


def test_a_round_where_no_request_asks_sends_no_logprob_request_to_the_verifier(tiny_runtime):
    seen = []

    class Recording(LocalVerifier):
        def verify(self, batch):
            seen.append(batch.num_logprobs)
            return super().verify(batch)

    engine = SpeculativeEngine.from_parts(verifier=Recording(tiny_runtime), drafter=NgramDrafter(), num_speculative_tokens=3)
    out = run(engine, requests(PROMPTS[:2], logprobs=None))
    assert all(lp is None for _, lp in out.values())
    assert seen and all(k is None for k in seen)


def test_a_stop_token_ends_the_logprobs_with_the_tokens(tiny_runtime):
    ((full, full_lp),) = run(SpeculativeEngine(tiny_runtime, None), requests(PROMPTS[1:2], n=20)).values()
    stop = full[5]
    k = full.index(stop)
    engine = SpeculativeEngine(tiny_runtime, NgramDrafter(), num_speculative_tokens=4)
    ((tokens, lp),) = run(engine, [GenerationRequest("s", PROMPTS[1], 20, GREEDY, stop_token_ids=frozenset({stop}), logprobs=1)]).values()
    assert tokens == full[: k + 1] and lp.logprobs == full_lp.logprobs[: k + 1]


@pytest.mark.parametrize("logprobs", [-1, 21])
def test_more_alternatives_than_the_engine_computes_are_refused(tiny_runtime, logprobs):
    with pytest.raises(ValueError, match="logprobs"):
        SpeculativeEngine(tiny_runtime, None).validate(GenerationRequest("x", [1, 2], 4, GREEDY, logprobs=logprobs))
