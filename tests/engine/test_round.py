"""Specification of one speculative round (dspark/engine/round.py): draft -> schedule -> verify -> emit.

Every test runs `run_round` over a real LocalVerifier on the tiny random model, with drafters that
propose known tokens. The greedy target's choices are known from plain decoding (the reference
continuation), so what a round must emit is known exactly:

- drafts agreeing with the target's first a choices, then one that does not: the round emits
  those a drafts and the target's own token at the rejection (the correction);
- drafts all agreeing: all of them, and the target's next token (the bonus);
- a policy admitting none of the drafts, or a request being prefilled: one token;
- never more than the request may still take (max_new_tokens), never past a stop token;
- a verifier failing the round: nothing, and the table as it was.
"""

from __future__ import annotations

import pytest
import torch

from dspark.drafters.base import Drafter, DrafterSpec, DraftProposal, DraftRequest, NoDrafter
from dspark.engine.requests import EngineCounters, GenerationRequest, RequestState, kv_tokens_needed
from dspark.engine.round import RoundResult, emit, run_round
from dspark.engine.speculative import SpeculativeEngine
from dspark.engine.verifier import LocalVerifier
from dspark.sampling.params import SamplingParams
from dspark.profiling.sps import SPSProfile
from dspark.scheduling.policies import DSparkPolicy, FixedPolicy, ThresholdPolicy

GREEDY = SamplingParams(temperature=0.0)
PROMPTS = {"a": [5, 6, 7, 8, 5, 6, 7], "b": [1, 2, 3, 1, 2, 3, 1, 2], "c": [200, 17, 93]}
REFERENCE_LEN = 24


class ScriptedDrafter(Drafter):
    """Proposes, per request, the next tokens of a script (point masses), at most max_draft_tokens;
    remembers what each round asked for."""

    spec = DrafterSpec(name="scripted", provides_confidences=True)

    def __init__(self, script: dict[str, list[int]], confidence: float = 0.9):
        self.script = script  # request id -> the whole output it "predicts"
        self.confidence = confidence
        self.asked: list[list[DraftRequest]] = []

    def propose(self, requests: list[DraftRequest]) -> list[DraftProposal]:
        self.asked.append(requests)
        out = []
        for r in requests:
            done = len(r.token_ids) - r.num_prompt_tokens
            draft = self.script[r.request_id][done : done + r.max_draft_tokens]
            p = DraftProposal.point_mass(draft)
            p.confidences = torch.full((len(draft),), self.confidence)  # [num_draft]
            out.append(p)
        return out


@pytest.fixture
def reference(tiny_runtime) -> dict[str, list[int]]:
    """Plain greedy decoding of each prompt: the target's choices, token for token."""
    engine = SpeculativeEngine(tiny_runtime, None)
    states = engine.generate([GenerationRequest(rid, p, REFERENCE_LEN, GREEDY) for rid, p in PROMPTS.items()])
    return {s.request.request_id: s.output_ids for s in states}


@pytest.fixture
def verifier(tiny_runtime) -> LocalVerifier:
    return LocalVerifier(tiny_runtime, sampler_backend="torch")


def admit(verifier: LocalVerifier, drafter: Drafter, rid: str, *, max_new_tokens: int = REFERENCE_LEN,
          stop: frozenset[int] = frozenset()) -> RequestState:
    req = GenerationRequest(rid, PROMPTS[rid], max_new_tokens, GREEDY, stop_token_ids=stop)
    verifier.add_request(rid, req.prompt_ids, req.params, kv_tokens_needed(req))
    drafter.add_request(rid, req.prompt_ids, req.params)
    return RequestState(request=req, generator=torch.Generator().manual_seed(0))


def one_round(table, drafter, verifier, *, gamma=4, policy=None, counters=None) -> RoundResult:
    return run_round(table, drafter=drafter, verifier=verifier, policy=policy, gamma=gamma,
                     counters=counters if counters is not None else EngineCounters())


def prefilled(verifier, drafter, *rids, **kwargs) -> list[RequestState]:
    """Requests past their prefill round (which emits their first token)."""
    table = [admit(verifier, drafter, rid, **kwargs) for rid in rids]
    one_round(table, drafter, verifier)
    return table


def emitted(result: RoundResult) -> dict[str, list[int]]:
    return {o.request_id: o.new_token_ids for o in result.outputs}


# ---- prefill ------------------------------------------------------------------------------


def test_a_request_in_its_first_round_is_prefilled_and_gets_exactly_the_targets_first_token(verifier, reference):
    drafter = ScriptedDrafter(reference)
    table = [admit(verifier, drafter, rid) for rid in PROMPTS]
    counters = EngineCounters()
    result = one_round(table, drafter, verifier, counters=counters)
    assert emitted(result) == {rid: reference[rid][:1] for rid in PROMPTS}
    assert drafter.asked == []  # nothing to draft from before the first token
    assert all(s.prefilled and s.rounds == 0 for s in table)  # a prefill is not a decode round
    assert result.prefill_tokens == sum(len(p) for p in PROMPTS.values()) and result.num_draft_tokens == []
    assert counters.steps == 1 and counters.emitted_tokens == len(PROMPTS) and counters.decode_request_rounds == 0


# ---- accepted prefix + correction / bonus -------------------------------------------------


def test_drafts_that_all_agree_with_the_target_are_all_emitted_followed_by_the_bonus_token(verifier, reference):
    drafter = ScriptedDrafter(reference)
    table = prefilled(verifier, drafter, "a", "b")
    result = one_round(table, drafter, verifier, gamma=4)
    assert emitted(result) == {rid: reference[rid][1:6] for rid in ("a", "b")}  # 4 drafts + the bonus
    assert result.num_draft_tokens == [4, 4] and result.num_decode_accepted == [4, 4] and result.num_emitted == [5, 5]
    assert all(s.output_ids == reference[s.request.request_id][:6] for s in table)


@pytest.mark.parametrize("wrong_at", [0, 1, 3])
def test_the_first_wrong_draft_ends_the_accepted_prefix_and_the_target_corrects_it(verifier, reference, wrong_at):
    script = {rid: list(out) for rid, out in reference.items()}
    position = 1 + wrong_at  # output index of the wrong draft (output[0] came from the prefill)
    script["a"][position] = (reference["a"][position] + 1) % verifier.vocab_size  # not the target's choice
    drafter = ScriptedDrafter(script)
    table = prefilled(verifier, drafter, "a", "b")
    result = one_round(table, drafter, verifier, gamma=4)
    # the accepted prefix, then the target's own token where the draft was wrong; "b" is unaffected
    assert emitted(result) == {"a": reference["a"][1 : position + 1], "b": reference["b"][1:6]}
    assert result.num_decode_accepted == [wrong_at, 4]
    assert table[0].draft_tokens == 4 and table[0].accepted_tokens == wrong_at and table[0].rounds == 1


def test_rounds_go_on_from_where_the_last_one_stopped_and_equal_plain_decoding(verifier, reference):
    script = {rid: list(out) for rid, out in reference.items()}
    for i in range(2, REFERENCE_LEN, 5):  # a wrong draft every few positions
        script["a"][i] = (script["a"][i] + 7) % verifier.vocab_size
    drafter = ScriptedDrafter(script)
    table = prefilled(verifier, drafter, "a", "b", "c")
    rounds = 0
    while any(s.finish_reason is None for s in table):
        one_round([s for s in table if s.finish_reason is None], drafter, verifier, gamma=3)
        rounds += 1
    assert {s.request.request_id: s.output_ids for s in table} == reference
    assert rounds < REFERENCE_LEN - 1 and table[0].accepted_tokens < table[0].draft_tokens  # drafts paid, some failed


# ---- the schedule -------------------------------------------------------------------------


def test_a_policy_that_admits_none_of_the_drafts_leaves_one_token_per_request(verifier, reference):
    drafter = ScriptedDrafter(reference, confidence=0.5)  # right drafts, but not confident enough for C = 0.9
    table = prefilled(verifier, drafter, "a", "b", "c")
    result = one_round(table, drafter, verifier, gamma=4, policy=ThresholdPolicy(0.9))
    assert [len(p) for p in result.proposed.values()] == [4, 4, 4]  # the drafter did propose
    assert [len(p) for p in result.admitted.values()] == [0, 0, 0]  # the policy admitted none
    assert emitted(result) == {rid: reference[rid][1:2] for rid in PROMPTS}
    assert result.num_draft_tokens == [0, 0, 0] and all(s.draft_tokens == 0 for s in table)


STEP_AT_3_TOKENS = SPSProfile(batch_sizes=[1, 3, 4, 64], step_seconds=[0.010, 0.010, 0.020, 0.320])


def test_algorithm_1_on_a_step_where_no_draft_can_pay_is_not_drafted_for_at_all(verifier, reference):
    # 3 requests sit at the top of a 3-token plateau: a 4th token doubles the step, so even a
    # certain draft lowers Θ and Algorithm 1 would admit none; the round asks the drafter nothing
    # (not even a free lookup) and runs no schedule. From the batch sizes only: lossless.
    verifier.sps_profile = STEP_AT_3_TOKENS
    drafter = ScriptedDrafter(reference, confidence=1.0)
    table = prefilled(verifier, drafter, "a", "b", "c")
    asked_before, counters = len(drafter.asked), EngineCounters()
    while any(s.finish_reason is None for s in table):
        result = one_round(table, drafter, verifier, gamma=4, policy=DSparkPolicy(), counters=counters)
        assert result.num_draft_tokens == [0, 0, 0] and result.drafting is False
    assert len(drafter.asked) == asked_before and counters.rounds_without_drafting == counters.steps
    assert {s.request.request_id: s.output_ids for s in table} == reference


def test_algorithm_1_below_the_step_is_drafted_for(verifier, reference):
    # the same profile with 2 requests: a 3rd token is free, so a certain draft pays and is verified
    verifier.sps_profile = STEP_AT_3_TOKENS
    drafter = ScriptedDrafter(reference, confidence=1.0)
    table = prefilled(verifier, drafter, "a", "b")
    result = one_round(table, drafter, verifier, gamma=4, policy=DSparkPolicy())
    # Algorithm 1 takes one certain draft (B = 3) and breaks at the second (B = 4 doubles the step); ties go to "a"
    assert len(drafter.asked) == 1 and result.drafting is True and result.num_draft_tokens == [1, 0]
    assert emitted(result) == {"a": reference["a"][1:3], "b": reference["b"][1:2]}


def test_a_policy_that_cuts_the_drafts_verifies_the_prefix_it_admits_only(verifier, reference):
    drafter = ScriptedDrafter(reference)
    table = prefilled(verifier, drafter, "a")
    result = one_round(table, drafter, verifier, gamma=4, policy=FixedPolicy(2))
    assert drafter.asked[-1][0].max_draft_tokens == 2  # the policy's bound reaches the drafter
    assert emitted(result) == {"a": reference["a"][1:4]}  # 2 admitted drafts + the bonus


def test_with_no_drafter_every_round_is_plain_decoding(verifier, reference):
    drafter = NoDrafter()
    table = prefilled(verifier, drafter, "a", "b")
    result = one_round(table, drafter, verifier, gamma=0)
    assert emitted(result) == {rid: reference[rid][1:2] for rid in ("a", "b")}
    assert result.num_emitted == [1, 1]


# ---- the end of a request -----------------------------------------------------------------


def test_a_request_near_max_new_tokens_is_drafted_for_its_remaining_tokens_only(verifier, reference):
    drafter = ScriptedDrafter(reference)
    table = prefilled(verifier, drafter, "a", max_new_tokens=3)  # 1 emitted, 2 to go
    result = one_round(table, drafter, verifier, gamma=4)
    assert drafter.asked[-1][0].max_draft_tokens == 1  # a round emits drafts + 1
    assert emitted(result) == {"a": reference["a"][1:3]}
    assert table[0].output_ids == reference["a"][:3] and table[0].finish_reason == "length"


def test_a_stop_token_among_the_accepted_drafts_ends_the_request_there(verifier, reference):
    drafter = ScriptedDrafter(reference)
    # a request and the first output index in this round's reach (1..5) holding a token not emitted before
    rid, i = next((rid, i) for rid, out in reference.items() for i in range(2, 6) if out[i] not in out[:i])
    out = reference[rid]
    table = prefilled(verifier, drafter, rid, stop=frozenset({out[i]}))
    result = one_round(table, drafter, verifier, gamma=4)
    assert emitted(result) == {rid: out[1 : i + 1]}  # through the stop token, not the tokens after it
    assert table[0].output_ids == out[: i + 1] and table[0].finish_reason == "stop" and result.finished == [rid]
    assert result.num_emitted == [5]  # what the verifier emitted before the cut


# ---- a failing verifier -------------------------------------------------------------------


class FailingVerifier(LocalVerifier):
    def verify(self, batch):
        raise ConnectionError("the verifier is gone")


def test_a_round_the_verifier_fails_emits_nothing_and_leaves_the_table_as_it_was(tiny_runtime, reference):
    verifier = FailingVerifier(tiny_runtime, sampler_backend="torch")
    drafter = ScriptedDrafter(reference)
    table = [admit(verifier, drafter, "a")]
    table[0].output_ids, table[0].prefilled = reference["a"][:3], True  # as if three tokens were emitted
    counters = EngineCounters()
    with pytest.raises(ConnectionError):
        one_round(table, drafter, verifier, counters=counters)
    s = table[0]
    assert s.output_ids == reference["a"][:3] and (s.rounds, s.draft_tokens, s.accepted_tokens) == (0, 0, 0)
    assert counters.steps == 0 and counters.emitted_tokens == 0


def test_emitting_keeps_no_token_past_max_new_tokens_whatever_the_verifier_returned(verifier, reference):
    # run_round never asks for more (drafts are capped at remaining - 1); emit holds the line anyway
    s = prefilled(verifier, NoDrafter(), "a", max_new_tokens=3)[0]
    out = emit(s, reference["a"][1:6])
    assert out.new_token_ids == reference["a"][1:3] and s.output_ids == reference["a"][:3] and out.finish_reason == "length"
