"""Drafters: propose draft tokens + the distribution rows they were sampled from (base.py).

`make_drafter(name)` is the one registry the CLI and the servers build drafters from.
"""

from __future__ import annotations

from dspark.drafters.base import DraftProposal, DraftRequest, Drafter, NoDrafter

DRAFTERS = ("none", "ngram")


def make_drafter(name: str) -> Drafter | None:
    """A drafter by name; None for plain decoding."""
    if name == "none":
        return None
    if name == "ngram":
        from dspark.drafters.ngram import NgramDrafter

        return NgramDrafter()
    raise ValueError(f"unknown drafter {name!r}; expected one of {DRAFTERS}")


__all__ = ["DRAFTERS", "DraftProposal", "DraftRequest", "Drafter", "NoDrafter", "make_drafter"]
