"""How the engine reaches its parts (dspark/engine/parts.py, dspark/engine/resilience.py).

In-process parts go straight through and the embedded mode never loads the fault handling; parts
that declare `in_process = False` get it. In process here, with failures injected by hand (the
same cases over real gRPC services that crash are tests/faults/test_engine_recovery.py): a drafter
that fails costs drafts, never tokens; a verifier that fails a round (even one it finished, whose
reply was lost) has its requests rebuilt; either way greedy output stays plain greedy decoding,
with no token lost or duplicated.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from dspark.drafters.base import Drafter
from dspark.drafters.ngram import NgramDrafter
from dspark.engine.faults import FaultPolicy, PartFailure
from dspark.engine.speculative import GenerationRequest, SpeculativeEngine
from dspark.engine.verifier import LocalVerifier, Verifier
from dspark.sampling.params import SamplingParams
from services.drafter.client import RemoteDrafter
from services.verifier.client import RemoteVerifier

GREEDY = SamplingParams(temperature=0.0)
PROMPTS = [[5, 6, 7, 8] * 3, [1, 2, 3, 1, 2, 3, 1, 2], [9, 9, 9, 200, 9, 9, 9, 200]]
FAST_RETRY = FaultPolicy(retry_interval_s=0.001)


def requests(max_new_tokens: int = 40) -> list[GenerationRequest]:
    return [GenerationRequest(f"r{i}", p, max_new_tokens, GREEDY) for i, p in enumerate(PROMPTS)]


def start(engine: SpeculativeEngine) -> list:
    for r in requests():
        engine.add_request(r)
    return list(engine.running.values())


def plain(runtime) -> list[list[int]]:
    return [s.output_ids for s in SpeculativeEngine(runtime, None).generate(requests())]


def test_local_and_remote_parts_declare_the_same_contracts_and_where_they_run():
    assert Verifier in LocalVerifier.__mro__ and Verifier in RemoteVerifier.__mro__
    assert issubclass(RemoteDrafter, Drafter) and issubclass(NgramDrafter, Drafter)
    assert (LocalVerifier.in_process, RemoteVerifier.in_process) == (True, False)
    assert (NgramDrafter.in_process, RemoteDrafter.in_process) == (True, False)


def test_the_embedded_mode_never_loads_the_fault_handling():
    script = textwrap.dedent("""
        import sys
        from dspark.drafters.ngram import NgramDrafter
        from dspark.engine.speculative import GenerationRequest, SpeculativeEngine
        from tests.conftest import make_tiny_runtime
        engine = SpeculativeEngine(make_tiny_runtime(), NgramDrafter(), num_speculative_tokens=3)
        (state,) = engine.generate([GenerationRequest("a", [1, 2, 3, 1, 2, 3], 12)])
        assert len(state.output_ids) == 12
        print("dspark.engine.resilience" in sys.modules)
    """)
    root = Path(__file__).resolve().parents[2]  # this checkout, not whichever dspark is installed
    env = {**os.environ, "PYTHONPATH": str(root)}
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True, cwd=root, env=env)
    assert out.stdout.strip() == "False"


# ---- failures injected in process ---------------------------------------------------------


class FlakyDrafter(NgramDrafter):
    """An n-gram drafter whose every call fails while `down` (as a crashed drafter service's do)."""

    in_process = False  # its calls can fail: the engine must handle that

    def __init__(self):
        super().__init__()
        self.down = False
        self.registered: list[tuple[str, int]] = []

    def _check(self) -> None:
        if self.down:
            raise PartFailure("drafter down")

    def add_request(self, request_id, token_ids, params):
        self._check()
        self.registered.append((request_id, len(token_ids)))
        super().add_request(request_id, token_ids, params)

    def propose(self, requests):
        self._check()
        return super().propose(requests)

    def remove_requests(self, request_ids):
        self._check()
        super().remove_requests(request_ids)


class FlakyVerifier(LocalVerifier):
    """Fails the rounds listed in `fail_rounds` after running them: the reply is lost, the
    verifier's state has moved on (a round that finished after its deadline)."""

    in_process = False

    def __init__(self, runtime, fail_rounds: set[int]):
        super().__init__(runtime, sampler_backend="torch")
        self.fail_rounds = fail_rounds
        self.rounds = 0

    def verify(self, batch):
        result = super().verify(batch)
        self.rounds += 1
        if self.rounds in self.fail_rounds:
            raise PartFailure("verifier reply lost")
        return result


def test_a_drafter_that_fails_mid_generation_costs_drafts_not_tokens(tiny_runtime_factory):
    expected = plain(tiny_runtime_factory())
    drafter = FlakyDrafter()
    engine = SpeculativeEngine(tiny_runtime_factory(), drafter, num_speculative_tokens=4, faults=FAST_RETRY)
    states = start(engine)
    for _ in range(4):
        engine.step()
    drafter.down = True
    before = sum(s.draft_tokens for s in states), [len(s.output_ids) for s in states]
    for _ in range(3):
        engine.step()
    assert engine.drafter_outage is not None and sum(s.draft_tokens for s in states) == before[0]  # no drafts while down
    assert all(len(s.output_ids) > n for s, n in zip(states, before[1]))  # and decoding went on
    drafter.down = False
    while engine.has_unfinished:
        engine.step()
    assert [s.output_ids for s in states] == expected
    assert engine.drafter_outage is None and sum(s.draft_tokens for s in states) > before[0]  # drafted again
    again = drafter.registered[len(PROMPTS):]  # registered again from prompt + output so far
    assert sorted(rid for rid, _ in again) == ["r0", "r1", "r2"] and all(n > len(PROMPTS[int(rid[1])]) for rid, n in again)


@pytest.mark.parametrize("fail_rounds", [{3}, {3, 4}], ids=["once", "twice-in-a-row"])
def test_a_verifier_that_loses_a_round_has_its_requests_rebuilt_with_no_token_lost_or_duplicated(
        tiny_runtime_factory, fail_rounds):
    expected = plain(tiny_runtime_factory())
    runtime = tiny_runtime_factory()
    engine = SpeculativeEngine.from_parts(verifier=FlakyVerifier(runtime, fail_rounds), drafter=NgramDrafter(),
                                          num_speculative_tokens=4, faults=FAST_RETRY)
    states = start(engine)
    lost = []
    while engine.has_unfinished:
        outputs = engine.step()
        if not outputs:
            lost.append([s.needs_rebuild for s in states])
        time.sleep(engine.stalled_for_s())
    assert lost and all(all(flags) for flags in lost)  # each lost round marked every request for a rebuild
    assert [s.output_ids for s in states] == expected
    assert all(s.verifier_failures == len(fail_rounds) for s in states)
    assert engine.verifier_outage is None and runtime.kv.reserved_tokens == 0


class ProfileFetchFailingVerifier(LocalVerifier):
    """A verifier whose SPS profile cannot be read while `down`: a remote verifier fetches it on
    first use (services/verifier/client.py), and that call can fail like any other."""

    in_process = False

    def __init__(self, runtime):
        super().__init__(runtime, sampler_backend="torch")
        self.down = False
        self._profile = None

    @property
    def sps_profile(self):
        if self.down:
            raise PartFailure("GetSPSProfile: verifier unreachable")
        return self._profile

    @sps_profile.setter
    def sps_profile(self, profile):
        self._profile = profile


def test_a_failed_fetch_of_the_sps_profile_loses_the_round_like_a_failed_verify(tiny_runtime_factory):
    from dspark.scheduling.policies import parse_policy

    expected = plain(tiny_runtime_factory())
    verifier = ProfileFetchFailingVerifier(tiny_runtime_factory())
    engine = SpeculativeEngine.from_parts(verifier=verifier, drafter=NgramDrafter(), num_speculative_tokens=4,
                                          policy=parse_policy("fixed:2"), faults=FAST_RETRY)
    states = start(engine)
    for _ in range(3):
        engine.step()
    verifier.down = True
    assert engine.step() == []  # the round is lost, not the step: no exception escapes to the caller
    assert engine.verifier_outage is not None and all(s.needs_rebuild for s in states)
    verifier.down = False
    while engine.has_unfinished:
        engine.step()
        time.sleep(engine.stalled_for_s())
    assert [s.output_ids for s in states] == expected
    assert engine.verifier_outage is None


class FreeFailingVerifier(LocalVerifier):
    """An in-process verifier whose remove_request fails while `fail_free` (a bug, an assertion)."""

    def __init__(self, runtime):
        super().__init__(runtime, sampler_backend="torch")
        self.fail_free = False

    def remove_request(self, request_ids):
        if self.fail_free:
            raise RuntimeError("remove_request failed")
        return super().remove_request(request_ids)


class RemovalRecordingDrafter(NgramDrafter):
    def __init__(self):
        super().__init__()
        self.removed: list[str] = []

    def remove_requests(self, request_ids):
        self.removed += request_ids
        super().remove_requests(request_ids)


def test_an_abort_whose_verifier_free_fails_still_frees_the_drafter_and_the_policy(tiny_runtime_factory):
    from dspark.scheduling.policies import parse_policy

    verifier, drafter = FreeFailingVerifier(tiny_runtime_factory()), RemovalRecordingDrafter()
    policy = parse_policy("fixed:2")
    forgotten = []
    policy_remove = policy.remove_request
    object.__setattr__(policy, "remove_request", lambda rid: (forgotten.append(rid), policy_remove(rid)))
    engine = SpeculativeEngine.from_parts(verifier=verifier, drafter=drafter, num_speculative_tokens=4, policy=policy)
    start(engine)
    engine.step()
    verifier.fail_free = True
    with pytest.raises(RuntimeError, match="remove_request failed"):
        engine.abort("r0")  # the failure is the caller's to see (AsyncEngine._safe_abort logs it and retries)
    assert "r0" not in engine.running and drafter.removed == ["r0"] and forgotten == ["r0"]
