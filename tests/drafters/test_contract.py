"""Specification of the drafter contract (dspark/drafters/base.py): a drafter declares what it is
and needs as one DrafterSpec, the engine and the drafter service read that and nothing else,
and the lifecycle defaults are what a drafter without per-request state needs.

    python -m pytest tests/drafters/test_contract.py -q
"""

from __future__ import annotations

import pytest
import torch

from dspark.drafters.base import Drafter, DrafterSpec, DraftProposal, DraftRequest, NoDrafter, checked_spec
from dspark.engine.speculative import GenerationRequest, SpeculativeEngine
from dspark.sampling.params import SamplingParams
from dspark.scheduling.policies import parse_policy
from services.drafter.server import DrafterServicer


class DuckTypedDrafter:
    """A drafter as they were before the contract: flags as loose attributes, no spec."""

    name = "duck"
    needs_hidden_states = True
    capture_layers = (1, 3)
    provides_confidences = True

    def propose(self, requests: list[DraftRequest]) -> list[DraftProposal]:
        return [DraftProposal.empty() for _ in requests]

    def remove_request(self, request_id: str) -> None:
        pass


class RecordsItsLifecycle(Drafter):
    """Stateless but for a log of the lifecycle calls that reach `remove_request`."""

    spec = DrafterSpec(name="recorder")

    def __init__(self):
        self.removed: list[str] = []

    def propose(self, requests: list[DraftRequest]) -> list[DraftProposal]:
        return [DraftProposal.point_mass([r.token_ids[-1]] * r.max_draft_tokens) for r in requests]

    def remove_request(self, request_id: str) -> None:
        self.removed.append(request_id)


# ---- what a spec may declare --------------------------------------------------------------------


def test_a_spec_lists_the_layers_it_reads_exactly_when_it_needs_hidden_states():
    assert DrafterSpec(name="x", needs_hidden_states=True, capture_layers=[1, 3]).capture_layers == (1, 3)
    with pytest.raises(ValueError, match="capture_layers"):
        DrafterSpec(name="x", needs_hidden_states=True)
    with pytest.raises(ValueError, match="capture_layers"):
        DrafterSpec(name="x", capture_layers=(1,))
    with pytest.raises(ValueError, match=">= 0"):
        DrafterSpec(name="x", needs_hidden_states=True, capture_layers=(-1,))


def test_a_spec_needs_a_name_and_positive_sizes():
    with pytest.raises(ValueError, match="name"):
        DrafterSpec(name="")
    for field in ("block_size", "draft_vocab_size"):
        with pytest.raises(ValueError, match=field):
            DrafterSpec(name="x", **{field: 0})
    assert DrafterSpec(name="x").block_size is None  # no bound of its own (n-gram lookups)


# ---- the boundary refuses anything else ---------------------------------------------------------


def test_the_engine_refuses_a_drafter_that_declares_no_spec(tiny_runtime_factory):
    runtime = tiny_runtime_factory(capture_layers=(1, 3))
    with pytest.raises(TypeError, match="expected a Drafter .* got DuckTypedDrafter"):
        SpeculativeEngine(runtime, DuckTypedDrafter())

    class Forgetful(Drafter):  # subclasses the base but never declares its spec
        def propose(self, requests):
            return []

    with pytest.raises(AttributeError, match="spec"):
        SpeculativeEngine(runtime, Forgetful())

    class Loose(Forgetful):
        spec = {"name": "loose", "needs_hidden_states": True}

    with pytest.raises(TypeError, match="Loose.spec must be a DrafterSpec, got dict"):
        SpeculativeEngine(runtime, Loose())


def test_the_drafter_service_refuses_a_drafter_that_declares_no_spec():
    with pytest.raises(TypeError, match="expected a Drafter"):
        DrafterServicer(DuckTypedDrafter(), vocab_size=256, hidden_size=64)


def test_a_drafter_must_implement_propose():
    class ProposesNothing(Drafter):
        spec = DrafterSpec(name="nothing")

    with pytest.raises(TypeError, match="abstract"):
        ProposesNothing()


def test_the_engine_reads_the_declared_capabilities(tiny_runtime_factory):
    class ReadsLayers0And2(RecordsItsLifecycle):
        spec = DrafterSpec(name="reads-0-2", needs_hidden_states=True, capture_layers=(0, 2))

    runtime = tiny_runtime_factory(capture_layers=(1, 3))
    with pytest.raises(ValueError, match=r"reads target layers \(0, 2\), the verifier captures \(1, 3\)"):
        SpeculativeEngine(runtime, ReadsLayers0And2())
    with pytest.raises(ValueError, match="needs calibrated confidences; drafter 'recorder' gives none"):
        SpeculativeEngine(runtime, RecordsItsLifecycle(), policy=parse_policy("dspark"))
    assert checked_spec(NoDrafter()) == DrafterSpec(name="none")


# ---- the lifecycle defaults ---------------------------------------------------------------------


def test_the_defaults_of_a_stateless_drafter():
    d = RecordsItsLifecycle()
    d.add_request("a", [1, 2, 3], SamplingParams())  # registering afresh forgets what was held
    d.remove_requests(["b", "c"])  # one remove_request each
    assert d.removed == ["a", "b", "c"]
    with pytest.raises(NotImplementedError, match="'recorder' takes no hidden states"):
        d.observe_many({"a": torch.zeros(1, 2, 8)})
    with pytest.raises(NotImplementedError, match="'recorder' takes no hidden states"):
        d.context_len("a")


def test_the_engine_drives_the_lifecycle_of_every_request(tiny_runtime_factory):
    drafter = RecordsItsLifecycle()
    engine = SpeculativeEngine(tiny_runtime_factory(), drafter, num_speculative_tokens=2)
    states = engine.generate([GenerationRequest(f"r{i}", [5, 6, 7], 6, SamplingParams(temperature=0.0)) for i in range(2)])
    assert all(s.draft_tokens > 0 for s in states)  # it drafted: the calls below are not vacuous
    # add_request's default (remove_request) at admission, then remove_requests when each finished
    assert sorted(drafter.removed) == ["r0", "r0", "r1", "r1"]
