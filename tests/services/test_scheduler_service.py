"""The scheduler service over remote verifier and drafter services, as `dspark scheduler` runs it.

Specification: `build_remote_engine(config)` wires AsyncEngine(SpeculativeEngine(RemoteVerifier,
RemoteDrafter)) from the configuration alone; Submit streams each round's tokens and ends with a
finish reason, the tokens being plain greedy decoding; concurrent requests beyond the KV budget
queue and all complete; Cancel, or a client that goes away, ends the request and frees its KV on
the verifier; Stats reports counters and reachability; a policy that needs the SPS profile of a
verifier started without one is refused at start.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from dspark.drafters.ngram import NgramDrafter
from dspark.engine.speculative import GenerationRequest, SpeculativeEngine
from dspark.engine.verifier import LocalVerifier
from dspark.protos.dspark.v1 import common_pb2, scheduler_pb2, scheduler_pb2_grpc
from dspark.sampling.params import SamplingParams
from dspark.serving_config import ServingConfig
from services.scheduler.server import build_remote_engine
from tests.polling import wait_until
from tests.services.conftest import PROFILE

GREEDY = common_pb2.SamplingParams(temperature=0.0, top_p=1.0)
PROMPTS = [[5, 6, 7, 8] * 4, [1, 2, 3, 4] * 4, [9, 8, 7, 6] * 4, [3, 1, 4, 1, 5, 9, 2, 6] * 2]


@pytest.fixture
def stack(serve, tiny_runtime_factory):
    """Verifier (KV for two requests of 16 + 40 tokens) and ngram drafter services, the remote
    engine from the configuration, and the scheduler service over it: (runtime, config, stub)."""
    runtime = tiny_runtime_factory(kv_budget_tokens=120)
    verifier = LocalVerifier(runtime)
    verifier.sps_profile = PROFILE
    config = ServingConfig().updated({
        "verifier": {"address": serve.verifier(verifier)},
        "drafter": {"address": serve.drafter(NgramDrafter(), vocab_size=runtime.vocab_size), "name": "ngram"},
        "scheduler": {"gamma": 4, "policy": "fixed:3"},
        "rpc": {"connect_timeout_s": 10.0},
    })
    engine = build_remote_engine(config)
    channel = grpc.insecure_channel(serve.scheduler(engine))
    try:
        yield runtime, config, scheduler_pb2_grpc.SchedulerStub(channel)
    finally:
        channel.close()
        serve.stop_all()
        engine.shutdown()


def plain(runtime, prompt, n) -> list[int]:
    (state,) = SpeculativeEngine(runtime, None).generate([GenerationRequest("plain", prompt, n, SamplingParams(temperature=0.0))])
    return state.output_ids


def submit(stub, rid, prompt, n) -> tuple[list[int], list[int]]:
    """(tokens, finish reasons of every message) of one Submit."""
    tokens, reasons = [], []
    for out in stub.Submit(scheduler_pb2.GenerationRequest(request_id=rid, prompt_ids=prompt, max_new_tokens=n, params=GREEDY),
                           timeout=120):
        assert out.request_id == rid
        tokens += out.new_token_ids
        reasons.append(out.finish_reason)
    return tokens, reasons


def test_submit_streams_the_tokens_of_plain_decoding_round_by_round(stack):
    runtime, _, stub = stack
    expected = plain(runtime, PROMPTS[0], 30)
    tokens, reasons = submit(stub, "a", PROMPTS[0], 30)
    assert tokens == expected
    assert reasons[-1] == common_pb2.FINISH_REASON_LENGTH and set(reasons[:-1]) == {common_pb2.FINISH_REASON_UNSPECIFIED}
    assert len(reasons) < 30  # speculation: rounds emitted several tokens
    stats = stub.Stats(scheduler_pb2.StatsRequest(), timeout=10)
    assert stats.num_finished == 1 and stats.num_rounds == len(reasons) and stats.num_running == 0
    assert stats.mean_accepted_length > 1.0 and stats.generation_tokens_per_second > 0
    assert stats.num_drafters == 1 and stats.num_verifiers == 1
    assert runtime.kv.reserved_tokens == 0


def test_submit_streams_the_logprobs_a_request_asks_for_with_its_tokens(stack):
    runtime, _, stub = stack
    engine = SpeculativeEngine(runtime, None)
    engine.add_request(GenerationRequest("plain", PROMPTS[1], 12, SamplingParams(temperature=0.0), logprobs=2))
    expected = []
    while engine.has_unfinished:
        for out in engine.step():
            expected += out.logprobs.logprobs
    request = scheduler_pb2.GenerationRequest(request_id="lp", prompt_ids=PROMPTS[1], max_new_tokens=12, params=GREEDY, logprobs=2)
    outputs = list(stub.Submit(request, timeout=120))
    assert all(len(o.logprobs.logprobs) == len(o.new_token_ids) and o.logprobs.k == 2 for o in outputs if o.new_token_ids)
    assert [x for o in outputs for x in o.logprobs.logprobs] == expected  # fp32 on the wire: the same numbers
    assert len(expected) == 12 and len(outputs) < 12  # speculation: rounds emitted several tokens


def test_concurrent_requests_beyond_the_kv_budget_queue_and_all_complete(stack):
    runtime, _, stub = stack
    expected = [plain(runtime, p, 40) for p in PROMPTS]
    with ThreadPoolExecutor(len(PROMPTS)) as pool:  # 4 requests of 56 KV tokens; 2 fit at a time
        results = list(pool.map(lambda i: submit(stub, f"c{i}", PROMPTS[i], 40), range(len(PROMPTS))))
    assert [tokens for tokens, _ in results] == expected
    assert all(reasons[-1] == common_pb2.FINISH_REASON_LENGTH for _, reasons in results)
    assert runtime.kv.reserved_tokens == 0


def test_cancel_ends_the_stream_with_abort_and_frees_the_kv(stack):
    runtime, _, stub = stack
    stream = stub.Submit(scheduler_pb2.GenerationRequest(request_id="long", prompt_ids=list(range(100, 110)), max_new_tokens=110,
                                                         params=GREEDY), timeout=120)
    first = next(stream)
    assert first.finish_reason == common_pb2.FINISH_REASON_UNSPECIFIED
    assert stub.Cancel(scheduler_pb2.CancelRequest(request_id="long"), timeout=10).cancelled
    rest = list(stream)
    assert rest[-1].finish_reason == common_pb2.FINISH_REASON_ABORT
    assert wait_until(lambda: runtime.kv.reserved_tokens == 0, 30.0)
    assert not stub.Cancel(scheduler_pb2.CancelRequest(request_id="long"), timeout=10).cancelled  # gone now


def test_a_client_that_goes_away_frees_its_request(stack):
    runtime, _, stub = stack
    stream = stub.Submit(scheduler_pb2.GenerationRequest(request_id="gone", prompt_ids=list(range(100, 110)), max_new_tokens=110,
                                                         params=GREEDY), timeout=120)
    next(stream)
    stream.cancel()  # the client disconnects
    assert wait_until(lambda: runtime.kv.reserved_tokens == 0, 30.0)
    assert submit(stub, "gone", PROMPTS[1], 5)[0] == plain(runtime, PROMPTS[1], 5)  # the id is free again


def test_a_policy_that_needs_the_sps_profile_is_refused_when_the_verifier_has_none(serve, tiny_runtime_factory):
    from tests.drafters.test_dspark_serving import make_serving_drafter

    runtime = tiny_runtime_factory(capture_layers=(1, 3))
    config = ServingConfig().updated({
        "verifier": {"address": serve.verifier(LocalVerifier(runtime))},  # no SPS profile
        "drafter": {"address": serve.drafter(make_serving_drafter(runtime), vocab_size=256, hidden_size=runtime.config.hidden_size),
                    "name": "dspark"},
        "scheduler": {"policy": "dspark"},
    })
    with pytest.raises(ValueError, match="needs the verifier's SPS"):
        build_remote_engine(config)
