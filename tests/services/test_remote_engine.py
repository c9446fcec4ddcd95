"""The round loop over gRPC: SpeculativeEngine(RemoteVerifier, RemoteDrafter) against real servers.

Specification: whatever the policy, greedy output over the services equals plain decoding; with
fixed seeds at temperature 1 the remote engine emits exactly the tokens the in-process engine
emits (same p_d rows, same hidden states, same random streams: dense and sparse rows); a request
whose KV does not fit waits and is served later, never failed; a verifier that answers too late
is retried on a rebuilt request, then fails it with an error naming the service and the deadline;
finished requests leave no state on either service; the remote drafter declares the service's
spec field for field; every call into the verifier and the drafter runs on its service's one
compute thread.
"""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import torch

from dspark.drafters.base import DraftRequest
from dspark.drafters.dspark.serving import DSparkServingDrafter
from dspark.drafters.ngram import NgramDrafter
from dspark.engine.async_engine import AsyncEngine
from dspark.engine.faults import FaultPolicy, RequestsFailed
from dspark.engine.speculative import GenerationRequest, SpeculativeEngine
from dspark.engine.verifier import LocalVerifier
from dspark.model.kv_cache import KVBudgetExceeded
from dspark.sampling.params import SamplingParams
from dspark.scheduling.policies import parse_policy
from services.drafter.client import RemoteDrafter
from services.grpc_common import ServiceUnavailable
from services.verifier.client import RemoteVerifier
from tests.drafters.test_draft_vocabulary import make_drafter as make_vocab_drafter
from tests.drafters.test_dspark_serving import make_serving_drafter
from tests.services.conftest import PROFILE

GREEDY = SamplingParams(temperature=0.0)
PROMPTS = [[5, 6, 7, 8, 9], [1, 2, 3, 1, 2, 3, 1, 2], list(range(40, 70))]
CAPTURE = (1, 3)


def remote_engine(serve, runtime, drafter, *, gamma=4, policy=None, verifier_kwargs=None, **client_kwargs) -> SpeculativeEngine:
    """Serve `runtime` (as a LocalVerifier with the test SPS profile) and `drafter`; the engine over both."""
    local = LocalVerifier(runtime)
    local.sps_profile = PROFILE
    verifier = RemoteVerifier(serve.verifier(local), **(verifier_kwargs or {}))
    remote_drafter = None
    if drafter is not None:
        address = serve.drafter(drafter, vocab_size=runtime.vocab_size, hidden_size=runtime.config.hidden_size)
        remote_drafter = RemoteDrafter(address, **client_kwargs)
    return SpeculativeEngine.from_parts(verifier=verifier, drafter=remote_drafter, num_speculative_tokens=gamma, policy=policy)


def requests(params=GREEDY, max_new_tokens=20, prefix="r"):
    params = params if isinstance(params, list) else [params] * len(PROMPTS)
    return [GenerationRequest(f"{prefix}{i}", p, max_new_tokens, q) for i, (p, q) in enumerate(zip(PROMPTS, params))]


@pytest.mark.parametrize("spec", ["none", "fixed:1", "fixed:3", "threshold:0.3", "dspark", "dspark-async"])
def test_greedy_output_over_the_services_is_plain_decoding_whatever_the_policy(serve, tiny_runtime_factory, spec):
    runtime = tiny_runtime_factory(capture_layers=CAPTURE)
    plain = SpeculativeEngine(runtime, None).generate(requests(prefix="plain"))
    engine = remote_engine(serve, runtime, make_serving_drafter(runtime), policy=parse_policy(spec))
    assert engine.sps_profile == PROFILE  # fetched from the verifier service
    states = engine.generate(requests())
    assert [s.output_ids for s in states] == [p.output_ids for p in plain]
    drafted, accepted = sum(s.draft_tokens for s in states), sum(s.accepted_tokens for s in states)
    assert drafted == 0 if spec == "none" else drafted > 0 and accepted > 0  # drafts verified over gRPC, some accepted
    assert engine.verifier.remove_request(["r0", "r1", "r2"]) == 0  # finished requests were freed on the verifier
    assert runtime.kv.reserved_tokens == 0


@pytest.mark.parametrize("draft_vocab", [None, list(range(0, 256, 2))])
def test_the_remote_drafter_declares_the_services_spec_field_for_field(serve, tiny_runtime_factory, draft_vocab):
    runtime = tiny_runtime_factory(capture_layers=CAPTURE)
    local = DSparkServingDrafter(make_vocab_drafter(runtime, draft_vocab, block_size=5))
    address = serve.drafter(local, vocab_size=runtime.vocab_size, hidden_size=runtime.config.hidden_size)
    remote = RemoteDrafter(address)
    assert remote.spec == local.spec  # block size and draft vocabulary included
    assert remote.spec.block_size == 5 and remote.spec.draft_vocab_size == (None if draft_vocab is None else 128)
    assert RemoteDrafter(serve.drafter(NgramDrafter(), vocab_size=runtime.vocab_size, hidden_size=0)).spec == NgramDrafter().spec


def test_greedy_output_with_the_ngram_drafter_and_with_no_drafter_is_plain_decoding(serve, tiny_runtime):
    plain = SpeculativeEngine(tiny_runtime, None).generate(requests(prefix="plain", max_new_tokens=30))
    for drafter in (NgramDrafter(), None):
        states = remote_engine(serve, tiny_runtime, drafter).generate(requests(max_new_tokens=30))
        assert [s.output_ids for s in states] == [p.output_ids for p in plain]
        if drafter is not None:
            assert sum(s.accepted_tokens for s in states) > 0


def test_logprobs_over_the_services_are_the_in_process_engines_bit_for_bit(serve, tiny_runtime):
    """The verifier service computes them beside the rejection sampler and sends fp32 on the wire."""

    def logprobs_of(engine):
        asking = [GenerationRequest(f"lp{i}", p, 16, GREEDY, logprobs=k) for i, (p, k) in enumerate(zip(PROMPTS, [3, None, 0]))]
        got = {r.request_id: [] for r in asking}
        for r in asking:
            engine.add_request(r)
        while engine.has_unfinished:
            for out in engine.step():
                got[out.request_id].append((out.new_token_ids, out.logprobs))
        return got

    local = logprobs_of(SpeculativeEngine(tiny_runtime, NgramDrafter(), num_speculative_tokens=4))
    remote_engine_ = remote_engine(serve, tiny_runtime, NgramDrafter())
    remote = logprobs_of(remote_engine_)
    flat = lambda steps: ([t for ids, _ in steps for t in ids], [x for _, lp in steps if lp is not None for x in lp.logprobs])  # noqa: E731
    for rid in local:
        assert flat(remote[rid]) == flat(local[rid])
    assert all(lp is None for _, lp in remote["lp1"]) and len(flat(remote["lp0"])[1]) == 16
    assert [ids for _, lp in remote["lp0"] for ids in lp.top_ids] == [ids for _, lp in local["lp0"] for ids in lp.top_ids]
    assert remote_engine_.counters.emitted_in_decode_rounds > remote_engine_.counters.decode_request_rounds  # drafts accepted


SEEDED = [SamplingParams(temperature=1.0, seed=101), SamplingParams(temperature=0.8, top_k=50, seed=-7),
          SamplingParams(temperature=1.0, top_p=0.9, seed=2**40)]


@pytest.mark.parametrize("drafter_kind", ["dspark-dense", "dspark-sparse-top3", "ngram"])
def test_seeded_sampling_over_the_services_emits_the_tokens_of_the_in_process_engine(serve, tiny_runtime_factory, drafter_kind):
    def make(runtime):
        if drafter_kind == "ngram":
            return NgramDrafter()
        return make_serving_drafter(runtime, seed=1, top_k=3 if "sparse" in drafter_kind else 0)

    local_runtime = tiny_runtime_factory(capture_layers=CAPTURE, compute_dtype=torch.float32)
    remote_runtime = tiny_runtime_factory(capture_layers=CAPTURE, compute_dtype=torch.float32)  # same seeded weights
    local = SpeculativeEngine(local_runtime, make(local_runtime), num_speculative_tokens=4).generate(requests(SEEDED, 24))
    remote = remote_engine(serve, remote_runtime, make(remote_runtime)).generate(requests(SEEDED, 24))
    assert [s.output_ids for s in remote] == [s.output_ids for s in local]
    assert [s.accepted_tokens for s in remote] == [s.accepted_tokens for s in local]
    assert sum(s.draft_tokens for s in remote) > 0
    assert len({tuple(s.output_ids) for s in remote}) == len(PROMPTS)


def test_the_drafter_service_sends_sparse_rows_when_the_drafter_truncates(serve, tiny_runtime_factory):
    runtime = tiny_runtime_factory(capture_layers=CAPTURE)
    for top_k, sparse in ((3, True), (0, False)):
        engine = remote_engine(serve, runtime, make_serving_drafter(runtime, top_k=top_k))
        engine.add_request(GenerationRequest("a", PROMPTS[0], 10, SamplingParams(temperature=1.0, seed=1)))
        engine.step()  # prefill: the drafter service now holds the prompt's features
        state = engine.running["a"]
        (proposal,) = engine.drafter.propose([DraftRequest("a", state.all_token_ids, len(PROMPTS[0]), state.request.params, 4)])
        assert len(proposal) == 4
        assert (proposal.prob_ids is not None and proposal.prob_ids.shape[1] <= 3) if sparse else proposal.dense_probs is not None
        engine.abort("a")


def test_a_request_that_does_not_fit_the_kv_budget_waits_and_is_served_later(serve, tiny_runtime_factory):
    runtime = tiny_runtime_factory(kv_budget_tokens=80)  # one request of 16 + 40 tokens at a time
    prompts = [[5, 6, 7, 8] * 4, [1, 2, 3, 4] * 4, [9, 8, 7, 6] * 4]
    plain = [SpeculativeEngine(runtime, None).generate([GenerationRequest(f"p{i}", p, 40, GREEDY)])[0].output_ids
             for i, p in enumerate(prompts)]
    engine = remote_engine(serve, runtime, NgramDrafter())
    with pytest.raises(KVBudgetExceeded):  # RESOURCE_EXHAUSTED from the verifier service, as the local error
        engine.verifier.add_request("x", prompts[0], GREEDY, 56)
        engine.verifier.add_request("y", prompts[1], GREEDY, 56)
    engine.verifier.remove_request(["x"])

    async def run_all() -> list[list[int]]:
        async_engine = AsyncEngine(engine, idle_poll_s=0.01).start()
        try:
            async def one(i, p):
                tokens = []
                async for delta in async_engine.generate(GenerationRequest(f"q{i}", p, 40, GREEDY)):
                    tokens += delta.new_token_ids
                return tokens

            return await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
        finally:
            async_engine.shutdown()

    assert asyncio.run(run_all()) == plain
    assert runtime.kv.reserved_tokens == 0


class SlowVerifier(LocalVerifier):
    """The real verifier, answering each round `delay_s` late (a verifier overloaded or stuck)."""

    delay_s = 1.0

    def verify(self, batch):
        time.sleep(self.delay_s)
        return super().verify(batch)


def test_a_verifier_that_answers_after_the_deadline_is_retried_then_a_clear_error(serve, tiny_runtime):
    address = serve.verifier(SlowVerifier(tiny_runtime))
    engine = SpeculativeEngine.from_parts(verifier=RemoteVerifier(address, verify_deadline_s=0.2), drafter=None,
                                          faults=FaultPolicy(max_rebuilds=1))
    engine.add_request(GenerationRequest("a", [1, 2, 3], 5, GREEDY))
    assert engine.step() == [] and engine.running["a"].needs_rebuild  # a late round is retried (dspark/engine/faults.py)
    assert engine.step() == []  # rebuilt on the verifier, and late again
    with pytest.raises(RequestsFailed, match=rf"verifier at {address}: Verify: no answer within the 0.2 s deadline") as failed:
        engine.step()
    assert failed.value.request_ids == ["a"] and not engine.running


def test_an_unreachable_service_is_reported_at_construction(serve, tiny_runtime):
    address = serve.verifier(LocalVerifier(tiny_runtime))
    serve.stop_all()  # the port is closed now
    with pytest.raises(ServiceUnavailable, match=rf"verifier at {address}: not reachable within 0.5 s"):
        RemoteVerifier(address, connect_timeout_s=0.5)
    with pytest.raises(ServiceUnavailable, match="drafter at"):
        RemoteDrafter(address, connect_timeout_s=0.5)


def test_aborted_and_finished_requests_leave_no_state_on_the_services(serve, tiny_runtime_factory):
    runtime = tiny_runtime_factory(capture_layers=CAPTURE)
    drafter = make_serving_drafter(runtime)
    engine = remote_engine(serve, runtime, drafter)
    engine.add_request(GenerationRequest("a", PROMPTS[0], 30, GREEDY))
    engine.add_request(GenerationRequest("b", PROMPTS[1], 3, GREEDY))
    for _ in range(3):
        engine.step()
    assert "b" not in engine.running and drafter.context_len("b") == 0  # finished: freed on both services
    assert drafter.context_len("a") == runtime.context_len("a") == len(engine.running["a"].all_token_ids) - 1
    engine.abort("a")
    assert drafter.context_len("a") == 0 and runtime.kv.reserved_tokens == 0


def test_every_call_into_the_verifier_and_the_drafter_runs_on_the_services_one_compute_thread(serve, tiny_runtime_factory):
    # gRPC hands calls to a pool of threads; a forward on each would leave one OpenMP pool per
    # thread, and past one pool per core libgomp's sleeping workers slow every forward
    # (dspark/model/compute_thread.py). So the servicers run the model on one thread of their own.
    runtime = tiny_runtime_factory(capture_layers=CAPTURE)
    local = LocalVerifier(runtime)
    drafter = make_serving_drafter(runtime)
    threads: dict[str, set[int]] = {"verify": set(), "add_request": set(), "propose": set(), "observe_many": set()}

    def recorded(owner, name):
        method = getattr(owner, name)

        def call(*args, **kwargs):
            threads[name].add(threading.get_ident())
            return method(*args, **kwargs)
        setattr(owner, name, call)

    for name in ("verify", "add_request"):
        recorded(local, name)
    for name in ("propose", "observe_many"):
        recorded(drafter, name)
    engine = SpeculativeEngine.from_parts(
        verifier=RemoteVerifier(serve.verifier(local)),
        drafter=RemoteDrafter(serve.drafter(drafter, vocab_size=runtime.vocab_size, hidden_size=runtime.config.hidden_size)),
        num_speculative_tokens=4)
    engine.generate(requests(max_new_tokens=12))
    verifier_threads = threads["verify"] | threads["add_request"]
    drafter_threads = threads["propose"] | threads["observe_many"]
    assert len(verifier_threads) == 1 and len(drafter_threads) == 1, threads
    assert threading.get_ident() not in verifier_threads | drafter_threads
    assert verifier_threads != drafter_threads
