"""Running a benchmark's conversations through the engine and recording every round (tiny target).

Specification: the recorded rounds add up to the engine's own counters, so τ from the records
equals Σ emitted / Σ rounds of an independent engine run of the same requests; DSpark rounds
carry the drafter's confidences for exactly the verified drafts; turn 2 of a conversation is
asked after the model's own answer to turn 1 and both turns count; batching changes nothing;
a prompt too long for the context is skipped (with its later turns), not a crash.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dspark.drafters import make_drafter
from dspark.drafters.base import DraftRequest
from dspark.drafters.ngram import NgramDrafter
from dspark.engine.speculative import GenerationRequest, SpeculativeEngine
from dspark.evaluation.acceptance import mean_accepted_length
from dspark.evaluation.runner import (
    Conversation,
    RecordingDrafter,
    conversation_messages,
    request_seed,
    run_conversations,
)
from dspark.sampling.params import SamplingParams
from tests.evaluation.conftest import ByteChatTokenizer

SINGLE_TURN = [Conversation("b/0", ("abcabcabcabc",)), Conversation("b/1", ("def f(x): return x",)),
               Conversation("b/2", ("Write a haiku",))]
TWO_TURNS = [Conversation("mt/0", ("Tell me a story", "Now shorter")), Conversation("mt/1", ("abab abab",))]
MAX_NEW = 12


def sorted_rounds(records) -> list[tuple[int, int]]:
    return sorted(zip(records.num_drafts.tolist(), records.num_accepted.tolist()))


def test_tau_equals_emitted_over_rounds_of_an_independent_engine_run(tiny_runtime):
    tokenizer = ByteChatTokenizer()
    run = run_conversations(tiny_runtime, NgramDrafter(), tokenizer, SINGLE_TURN, gamma=4, temperature=1.0, seed=3,
                            max_new_tokens=MAX_NEW, batch_size=2)
    # the same requests (same seeds) straight through the engine, summed by hand
    requests = [GenerationRequest(f"{c.key}#1", tokenizer.encode_chat(conversation_messages(c.turns[:1], [])), MAX_NEW,
                                  SamplingParams(temperature=1.0, seed=request_seed(3, c.key, 0))) for c in SINGLE_TURN]
    states = SpeculativeEngine(tiny_runtime, NgramDrafter(), num_speculative_tokens=4).generate(requests)
    emitted, rounds = sum(s.emitted_in_rounds for s in states), sum(s.rounds for s in states)
    assert rounds > 0 and run.rounds == rounds and run.emitted_in_rounds == emitted
    assert run.tau == emitted / rounds
    assert mean_accepted_length(run.records) == pytest.approx(emitted / rounds)
    assert run.records.num_rounds == rounds
    assert int(run.records.num_drafts.sum()) == run.draft_tokens == sum(s.draft_tokens for s in states) > 0
    assert int(run.records.num_accepted.sum()) == run.accepted_tokens == sum(s.accepted_tokens for s in states)
    assert run.outputs == {f"{c.key}#1": s.output_ids for c, s in zip(SINGLE_TURN, states)}
    assert run.records.confidences is None  # the n-gram drafter has none


def test_dspark_rounds_carry_confidences_of_exactly_the_verified_drafts(tiny_dspark_checkpoint):
    runtime, path = tiny_dspark_checkpoint
    drafter = make_drafter("dspark", runtime=runtime, path=path)
    tokenizer = ByteChatTokenizer()
    run = run_conversations(runtime, drafter, tokenizer, SINGLE_TURN, gamma=4, temperature=0.0, seed=0,
                            max_new_tokens=MAX_NEW)
    conf = run.records.confidences  # [R, γ]
    assert conf.shape == (run.rounds, 4) and run.draft_tokens > 0
    verified = np.arange(4)[None, :] < run.records.num_drafts[:, None]  # [R, γ]
    assert np.isfinite(conf[verified]).all() and ((conf[verified] > 0) & (conf[verified] < 1)).all()
    assert np.isnan(conf[~verified]).all()
    # lossless: greedy output is the target's own, whatever the drafter
    plain = run_conversations(runtime, None, tokenizer, SINGLE_TURN, gamma=4, temperature=0.0, seed=0, max_new_tokens=MAX_NEW)
    assert run.outputs == plain.outputs and run.output_digest == plain.output_digest
    assert plain.tau == 1.0


def test_turn_two_is_asked_after_the_models_own_answer_to_turn_one(tiny_runtime):
    tokenizer = ByteChatTokenizer()
    run = run_conversations(tiny_runtime, NgramDrafter(), tokenizer, TWO_TURNS, gamma=4, temperature=0.0, seed=0,
                            max_new_tokens=MAX_NEW)
    answer = tokenizer.decode(run.outputs["mt/0#1"])
    assert tokenizer.conversations[-1] == [
        {"role": "user", "content": "Tell me a story"},
        {"role": "assistant", "content": answer},
        {"role": "user", "content": "Now shorter"},
    ]
    assert len(tokenizer.conversations) == 3  # two first turns, one second turn
    assert set(run.outputs) == {"mt/0#1", "mt/0#2", "mt/1#1"} and run.requests == 3
    # both turns count: every request decodes max_new_tokens - 1 tokens in rounds (the first comes from the prefill)
    assert run.generated_tokens == 3 * MAX_NEW
    assert run.emitted_in_rounds >= 3 * (MAX_NEW - 1)


def test_results_do_not_depend_on_batching(tiny_dspark_checkpoint):
    runtime, path = tiny_dspark_checkpoint
    drafter = make_drafter("dspark", runtime=runtime, path=path)
    runs = [run_conversations(runtime, drafter, ByteChatTokenizer(), SINGLE_TURN + TWO_TURNS, gamma=4, temperature=1.0,
                              seed=1, max_new_tokens=MAX_NEW, batch_size=b) for b in (1, 5)]
    assert runs[0].outputs == runs[1].outputs
    assert sorted_rounds(runs[0].records) == sorted_rounds(runs[1].records)
    assert runs[0].tau == runs[1].tau


def test_a_prompt_too_long_for_the_context_is_skipped_with_its_later_turns(tiny_runtime_factory):
    runtime = tiny_runtime_factory(max_model_len=64)
    tokenizer = ByteChatTokenizer(max_chars=200)
    conversations = [Conversation("x/0", ("y" * 100, "and then?")), Conversation("x/1", ("hi",))]
    run = run_conversations(runtime, NgramDrafter(), tokenizer, conversations, gamma=4, temperature=0.0, seed=0,
                            max_new_tokens=8)
    assert [s["request"] for s in run.skipped] == ["x/0#1"]
    assert "context window" in run.skipped[0]["reason"]
    assert set(run.outputs) == {"x/1#1"} and run.requests == 1
    assert all(m[0]["content"] != "y" * 100 or len(m) == 1 for m in tokenizer.conversations)  # no turn 2 for x/0


def test_the_recorder_refuses_rounds_that_verified_other_than_what_was_proposed():
    recorder = RecordingDrafter(NgramDrafter())
    (proposal,) = recorder.propose([DraftRequest("r", [1, 2, 3, 1, 2, 3, 1, 2], 8, SamplingParams(), max_draft_tokens=3)])
    assert len(proposal) == 3 and recorder.spec == NgramDrafter.spec  # the declarations are the wrapped drafter's
    with pytest.raises(RuntimeError, match="scheduler off"):
        recorder.take("r", 2)


def test_conversation_messages_alternate_user_and_assistant():
    assert conversation_messages(["a", "b"], ["A"]) == [
        {"role": "user", "content": "a"}, {"role": "assistant", "content": "A"}, {"role": "user", "content": "b"}]
    with pytest.raises(ValueError, match="no turn left"):
        conversation_messages(["a"], ["A"])


def test_request_seeds_are_fixed_per_conversation_and_turn():
    assert request_seed(0, "gsm8k/1", 0) == request_seed(0, "gsm8k/1", 0)
    assert len({request_seed(0, "gsm8k/1", 0), request_seed(0, "gsm8k/1", 1), request_seed(1, "gsm8k/1", 0)}) == 3
    assert torch.Generator().manual_seed(request_seed(0, "k", 0)) is not None  # a valid torch seed
