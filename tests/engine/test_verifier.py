"""The target side of a round (LocalVerifier): prefill, verification, KV truncation, hidden states.

Specification: a first round prefills the prompt and samples the first token; a decode round
accepts exactly the drafts the target agrees with (greedy), emits one more token and keeps only
x_0 + the accepted drafts in the KV cache; the captured hidden states are those of the verified
positions; KV that does not fit raises KVBudgetExceeded and reserves nothing; a batch that does
not match the verifier's state is a ValueError that changes nothing; the rejection stream is
the request's own (seeded), and the drafter's stream is a different one.
"""

from __future__ import annotations

import pytest
import torch

from dspark.engine.speculative import GenerationRequest, SpeculativeEngine, draft_stream_seed
from dspark.engine.verifier import LocalVerifier, VerifyBatch
from dspark.model.kv_cache import KVBudgetExceeded
from dspark.model.target_runtime import TargetRuntime
from dspark.sampling import DraftProbs
from dspark.sampling.params import SamplingParams

GREEDY = SamplingParams(temperature=0.0)
PROMPT = [5, 6, 7, 8, 5, 6, 7]


def plain_greedy(runtime, prompt, n) -> list[int]:
    (state,) = SpeculativeEngine(runtime, None).generate([GenerationRequest("ref", prompt, n, GREEDY)])
    return state.output_ids


def prefill(rid: str, round_id: int = 0) -> VerifyBatch:
    return VerifyBatch(round_id, [rid], torch.tensor([-1]), torch.tensor([0]), torch.empty(0, dtype=torch.long), None)


def decode(rid: str, anchor: int, drafts: list[int], *, capture: bool = False, round_id: int = 1) -> VerifyBatch:
    ids = torch.tensor(drafts, dtype=torch.long)  # [l]
    rows = DraftProbs(sparse_ids=ids.unsqueeze(1), sparse_probs=torch.ones(len(drafts), 1)) if drafts else None  # point masses
    return VerifyBatch(round_id, [rid], torch.tensor([anchor]), torch.tensor([len(drafts)]), ids, rows, capture_hidden_states=capture)


def test_a_first_round_prefills_the_prompt_and_samples_the_first_token(tiny_runtime):
    expected = plain_greedy(tiny_runtime, PROMPT, 3)
    verifier = LocalVerifier(tiny_runtime)
    verifier.add_request("a", PROMPT, GREEDY, num_kv_tokens=len(PROMPT) + 3)
    result = verifier.verify(prefill("a", round_id=7))
    assert result.round_id == 7 and result.request_ids == ["a"]
    assert result.result.num_accepted.tolist() == [0]
    assert result.result.output_token_ids[0, 0].item() == expected[0]
    assert tiny_runtime.context_len("a") == len(PROMPT)  # the sampled token has no K/V yet
    assert result.hidden_states is None and result.num_hidden_positions is None  # not asked for
    nxt = verifier.verify(decode("a", expected[0], []))
    assert nxt.result.output_token_ids[0, 0].item() == expected[1]
    assert tiny_runtime.context_len("a") == len(PROMPT) + 1


def test_right_drafts_are_accepted_and_the_kv_keeps_only_the_accepted_prefix(tiny_runtime):
    expected = plain_greedy(tiny_runtime, PROMPT, 5)
    verifier = LocalVerifier(tiny_runtime)
    verifier.add_request("a", PROMPT, GREEDY, num_kv_tokens=len(PROMPT) + 5)
    verifier.verify(prefill("a"))
    wrong = (expected[3] + 1) % verifier.vocab_size
    result = verifier.verify(decode("a", expected[0], [expected[1], expected[2], wrong]))
    assert result.result.num_accepted.tolist() == [2]
    assert result.result.output_token_ids[0, :3].tolist() == expected[1:4]  # two accepted, then the corrected token
    assert tiny_runtime.context_len("a") == len(PROMPT) + 3  # x_0, x_1, x_2: the rejected draft's K/V is gone


def test_hidden_states_are_those_of_the_newly_verified_positions(tiny_runtime_factory):
    runtime = tiny_runtime_factory(capture_layers=(1, 3))
    expected = plain_greedy(runtime, PROMPT, 4)
    verifier = LocalVerifier(runtime)
    verifier.add_request("a", PROMPT, GREEDY, num_kv_tokens=len(PROMPT) + 4)
    first = verifier.verify(VerifyBatch(0, ["a"], torch.tensor([-1]), torch.tensor([0]), torch.empty(0, dtype=torch.long), None,
                                        capture_hidden_states=True))
    assert first.num_hidden_positions.tolist() == [len(PROMPT)]
    assert tuple(first.hidden_states.shape) == (len(PROMPT), 2, runtime.config.hidden_size)
    reference = TargetRuntime(runtime.model, kv_budget_tokens=64, capture_layers=(1, 3))  # the same model, fresh caches
    reference.add_request("r", 64)
    direct = reference.forward(["r"], torch.tensor(PROMPT), [len(PROMPT)], capture=True).captured  # [n, 2, hidden]
    assert torch.equal(first.hidden_states, direct)

    wrong = (expected[2] + 1) % verifier.vocab_size
    second = verifier.verify(decode("a", expected[0], [expected[1], wrong], capture=True))
    assert second.result.num_accepted.tolist() == [1]
    assert second.num_hidden_positions.tolist() == [2]  # x_0 and the accepted x_1, not the rejected draft
    assert tuple(second.hidden_states.shape) == (2, 2, runtime.config.hidden_size)


def test_several_requests_in_one_round_each_get_their_own_outcome(tiny_runtime):
    prompts = {"a": PROMPT, "b": [1, 2, 3, 1, 2, 3, 1]}
    expected = {rid: plain_greedy(tiny_runtime, p, 4) for rid, p in prompts.items()}
    verifier = LocalVerifier(tiny_runtime)
    for rid, p in prompts.items():
        verifier.add_request(rid, p, GREEDY, num_kv_tokens=len(p) + 4)
    both = VerifyBatch(0, ["a", "b"], torch.tensor([-1, -1]), torch.tensor([0, 0]), torch.empty(0, dtype=torch.long), None)
    first = verifier.verify(both).result.output_token_ids[:, 0].tolist()
    assert first == [expected["a"][0], expected["b"][0]]
    ea, eb = expected["a"], expected["b"]
    drafts = torch.tensor([ea[1], ea[2], (eb[1] + 1) % 256])  # a: two right drafts; b: one wrong one
    rows = DraftProbs(sparse_ids=drafts.unsqueeze(1), sparse_probs=torch.ones(3, 1))
    out = verifier.verify(VerifyBatch(1, ["a", "b"], torch.tensor([ea[0], eb[0]]), torch.tensor([2, 1]), drafts, rows))
    assert out.result.num_accepted.tolist() == [2, 0]
    assert out.result.output_token_ids[0, :3].tolist() == ea[1:4]
    assert out.result.output_token_ids[1, 0].item() == eb[1]


def test_a_request_that_does_not_fit_the_kv_budget_raises_and_reserves_nothing(tiny_runtime_factory):
    runtime = tiny_runtime_factory(kv_budget_tokens=50)
    verifier = LocalVerifier(runtime)
    verifier.add_request("a", PROMPT, GREEDY, num_kv_tokens=30)
    assert verifier.free_kv_tokens == 20 and verifier.kv_budget_tokens == 50
    with pytest.raises(KVBudgetExceeded):
        verifier.add_request("b", PROMPT, GREEDY, num_kv_tokens=30)
    assert not verifier.has_request("b") and verifier.free_kv_tokens == 20
    assert verifier.remove_request(["a", "never-added"]) == 1
    assert verifier.free_kv_tokens == 50
    verifier.add_request("b", PROMPT, GREEDY, num_kv_tokens=30)  # fits now


@pytest.mark.parametrize("prompt, num_kv, message", [
    ([], 8, "the prompt is empty"),
    ([1, 256], 8, r"must be in \[0, 256\), got \[256\]"),
    ([1, 2, 3], 3, "must exceed the prompt length 3"),
    ([1, 2, 3], 10_000, "context window"),
])
def test_bad_requests_are_value_errors(tiny_runtime, prompt, num_kv, message):
    verifier = LocalVerifier(tiny_runtime)
    with pytest.raises(ValueError, match=message):
        verifier.add_request("x", prompt, GREEDY, num_kv_tokens=num_kv)
    assert verifier.num_requests == 0 and tiny_runtime.kv.reserved_tokens == 0


def test_a_request_id_can_be_registered_once(tiny_runtime):
    verifier = LocalVerifier(tiny_runtime)
    verifier.add_request("x", [1, 2], GREEDY, num_kv_tokens=4)
    with pytest.raises(ValueError, match="already registered"):
        verifier.add_request("x", [1, 2], GREEDY, num_kv_tokens=4)


def _bad_batches(anchor):
    empty = torch.empty(0, dtype=torch.long)
    return [
        (VerifyBatch(0, ["zzz"], torch.tensor([-1]), torch.tensor([0]), empty, None), "not registered"),
        (VerifyBatch(0, ["a"], torch.tensor([-1]), torch.tensor([0]), empty, None), "already prefilled"),
        (VerifyBatch(0, ["b"], torch.tensor([3]), torch.tensor([0]), empty, None), "has not been prefilled"),
        (VerifyBatch(0, ["b"], torch.tensor([-1]), torch.tensor([1]), torch.tensor([4]), None), "takes no drafts"),
        (VerifyBatch(0, ["a", "a"], torch.tensor([anchor, anchor]), torch.tensor([0, 0]), empty, None), "only once"),
        (VerifyBatch(0, ["a"], torch.tensor([anchor, 1]), torch.tensor([0]), empty, None), "one entry per request"),
        (VerifyBatch(0, ["a"], torch.tensor([anchor]), torch.tensor([2]), torch.tensor([4]), None), "sum\\(num_draft_tokens\\) = 2"),
        (VerifyBatch(0, [], torch.empty(0, dtype=torch.long), torch.empty(0, dtype=torch.long), empty, None), "at least one request"),
    ]


def test_a_batch_that_does_not_match_the_verifier_state_is_a_value_error_that_changes_nothing(tiny_runtime):
    verifier = LocalVerifier(tiny_runtime)
    verifier.add_request("a", PROMPT, GREEDY, num_kv_tokens=len(PROMPT) + 6)
    verifier.add_request("b", [1, 2, 3], GREEDY, num_kv_tokens=8)
    anchor = int(verifier.verify(prefill("a")).result.output_token_ids[0, 0])
    for batch, message in _bad_batches(anchor):
        with pytest.raises(ValueError, match=message):
            verifier.verify(batch)
    assert tiny_runtime.context_len("a") == len(PROMPT) and tiny_runtime.context_len("b") == 0


def test_invalid_draft_rows_are_rejected_and_the_forward_is_undone(tiny_runtime):
    verifier = LocalVerifier(tiny_runtime)
    verifier.add_request("a", PROMPT, SamplingParams(temperature=1.0, seed=3), num_kv_tokens=len(PROMPT) + 4)
    anchor = int(verifier.verify(prefill("a")).result.output_token_ids[0, 0])
    bad_rows = DraftProbs(sparse_ids=torch.tensor([[4, 5]]), sparse_probs=torch.tensor([[0.5, 0.2]]))  # sums to 0.7
    with pytest.raises(ValueError, match="must sum to 1"):
        verifier.verify(VerifyBatch(1, ["a"], torch.tensor([anchor]), torch.tensor([1]), torch.tensor([4]), bad_rows))
    assert tiny_runtime.context_len("a") == len(PROMPT)  # the failed round left no K/V behind
    assert verifier.verify(decode("a", anchor, [])).result.num_accepted.tolist() == [0]  # and the request goes on
    assert tiny_runtime.context_len("a") == len(PROMPT) + 1


def test_the_rejection_stream_is_seeded_by_the_request_and_independent_of_the_batch(tiny_runtime):
    seeded = SamplingParams(temperature=1.0, seed=11)

    def run(with_neighbour: bool) -> list[int]:
        verifier = LocalVerifier(tiny_runtime)
        verifier.add_request("s", PROMPT, seeded, num_kv_tokens=len(PROMPT) + 8)
        ids = ["s"]
        if with_neighbour:
            verifier.add_request("n", [9, 9, 9], SamplingParams(temperature=1.0), num_kv_tokens=12)
            ids.append("n")
        out = verifier.verify(VerifyBatch(0, ids, torch.full((len(ids),), -1), torch.zeros(len(ids), dtype=torch.long),
                                          torch.empty(0, dtype=torch.long), None)).result.output_token_ids[:, 0].tolist()
        tokens = [out[0]]
        for step in range(5):
            anchors = torch.tensor(out)
            out = verifier.verify(VerifyBatch(step + 1, ids, anchors, torch.zeros(len(ids), dtype=torch.long),
                                              torch.empty(0, dtype=torch.long), None)).result.output_token_ids[:, 0].tolist()
            tokens.append(out[0])
        verifier.remove_request(ids)
        return tokens

    alone = run(False)
    assert run(False) == alone and run(True) == alone
    assert tiny_runtime.kv.reserved_tokens == 0


@pytest.mark.parametrize("seed", [0, 7, -3, 2**40, 2**62])
def test_the_draft_stream_is_never_the_rejection_stream(seed):
    derived = draft_stream_seed(seed)
    assert derived != seed and (derived - seed) % 2**32 != 0  # torch's CPU generator reads the low 32 bits
    a, b = torch.Generator().manual_seed(seed), torch.Generator().manual_seed(derived)
    assert not torch.equal(torch.rand(8, generator=a), torch.rand(8, generator=b))


def test_the_engine_over_a_given_verifier_equals_the_engine_over_a_runtime(tiny_runtime):
    from dspark.drafters.ngram import NgramDrafter

    params = SamplingParams(temperature=1.0, seed=5)
    reqs = [GenerationRequest("a", PROMPT, 20, params), GenerationRequest("b", [1, 2, 3, 1, 2, 3], 20, GREEDY)]
    direct = SpeculativeEngine(tiny_runtime, NgramDrafter(), num_speculative_tokens=3).generate(reqs)
    parts = SpeculativeEngine.from_parts(verifier=LocalVerifier(tiny_runtime), drafter=NgramDrafter(), num_speculative_tokens=3)
    assert parts.runtime is tiny_runtime and parts.max_model_len == tiny_runtime.max_model_len
    via_parts = parts.generate(reqs)
    assert [s.output_ids for s in via_parts] == [s.output_ids for s in direct]
    assert sum(s.accepted_tokens for s in via_parts) > 0


def test_auto_picks_the_triton_sampler_only_for_logits_on_a_cuda_device():
    from dspark.engine.verifier import resolve_sampler_backend

    assert resolve_sampler_backend("auto", "cpu") == "torch"  # even on a machine with a GPU
    assert resolve_sampler_backend("auto", "cuda") == ("triton" if torch.cuda.is_available() else "torch")
    with pytest.raises(ValueError, match="sampler_backend must be"):
        resolve_sampler_backend("fast")


def test_the_triton_sampler_for_a_cpu_runtime_is_refused_when_the_verifier_is_built(tiny_runtime, monkeypatch):
    """Not at the first round: the message names the device and what to use instead."""
    from dspark.engine.verifier import resolve_sampler_backend

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    for build in (lambda: LocalVerifier(tiny_runtime, sampler_backend="triton"),
                  lambda: SpeculativeEngine(tiny_runtime, None, sampler_backend="triton")):
        with pytest.raises(ValueError, match=r"'triton' runs the fused kernel on CUDA tensors, but the target's logits live "
                                             r"on cpu: use 'auto' or 'torch'"):
            build()
    assert LocalVerifier(tiny_runtime, sampler_backend="torch").sampler_backend == "torch"
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # Triton's interpreter runs the kernel on CPU tensors (tests)
    assert resolve_sampler_backend("triton", "cpu") == "triton"


def test_the_engine_takes_exactly_one_of_a_runtime_or_a_verifier(tiny_runtime):
    with pytest.raises(ValueError, match="exactly one"):
        SpeculativeEngine(None, None)
    with pytest.raises(ValueError, match="exactly one"):
        SpeculativeEngine(tiny_runtime, None, verifier=LocalVerifier(tiny_runtime))
