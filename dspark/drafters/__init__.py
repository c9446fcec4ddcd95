"""Drafters: propose draft tokens + the distribution rows they were sampled from.

    base.py       the contract: DrafterSpec (what a drafter declares), Drafter (what the engine calls)
    registry.py   every drafter by name: make_drafter, the trained families (DrafterFamily)
    shared.py     what the trained families share: the target's weights, per-position draws
    ngram.py      prompt lookup; lookup.py: lookup proposals beside a trained drafter
    dspark/ dflash/ eagle3/   the trained families, each with its registry entry (family.py)
"""

from __future__ import annotations

from dspark.drafters.base import Drafter, DrafterSpec, DraftProposal, DraftRequest, NoDrafter
from dspark.drafters.registry import (
    DrafterFamily,
    checkpoint_family,
    drafter_capture_layers,
    drafter_names,
    family,
    make_drafter,
    register_family,
)

__all__ = [
    "DraftProposal", "DraftRequest", "Drafter", "DrafterFamily", "DrafterSpec", "NoDrafter", "checkpoint_family",
    "drafter_capture_layers", "drafter_names", "family", "make_drafter", "register_family",
]
