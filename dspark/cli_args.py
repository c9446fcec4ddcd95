"""Argument types for comma-separated lists on the command line (`dspark bench`, `dspark eval`).

    p.add_argument("--temperature", type=comma_floats, default=(0.0, 1.0))    # "0,1" -> (0.0, 1.0)
    p.add_argument("--concurrency", type=comma_ints)                           # "1,2,4" -> (1, 2, 4)
    p.add_argument("--policies", type=comma_names)                             # "none, dspark" -> ("none", "dspark")

Empty items are skipped ("1,,2," is (1, 2)); an item that does not parse is an
argparse.ArgumentTypeError, so argparse exits 2 with a message that quotes the text given.
"""

from __future__ import annotations

import argparse

__all__ = ["comma_floats", "comma_ints", "comma_names"]


def comma_floats(text: str) -> tuple[float, ...]:
    try:
        return tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None


def comma_ints(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def comma_names(text: str) -> tuple[str, ...]:
    return tuple(x.strip() for x in text.split(",") if x.strip())
