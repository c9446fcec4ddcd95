"""The stored form of an API key: `sha256:<hex>` of the plain key.

    hash_api_key("a-plain-key")                     # -> "sha256:2c26b46b68ff..."
    normalize_api_keys("sha256:9f86d08..., other")  # -> hashes, in order, without repeats

Shared by the serving configuration, which hashes plain keys as it loads `gateway.api_keys`, and
the gateway (gateway/api_keys.py), which hashes presented keys before comparing them. It lives
here, not in gateway/, so that dspark/serving_config.py depends on nothing of the gateway.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable

__all__ = ["HASH_PREFIX", "hash_api_key", "normalize_api_keys"]

HASH_PREFIX = "sha256:"
_HASH_RE = re.compile(r"sha256:[0-9a-fA-F]{64}")


def hash_api_key(key: str) -> str:
    """`sha256:<hex>` of a plain key (its UTF-8 bytes)."""
    if not key:
        raise ValueError("an API key must not be empty")
    return HASH_PREFIX + hashlib.sha256(key.encode()).hexdigest()


def normalize_api_keys(entries: str | Iterable[str]) -> tuple[str, ...]:
    """Comma-separated (or listed) keys as `sha256:<hex>` hashes, in order, without repeats.

    An entry that starts with `sha256:` must be a well-formed hash (a typo must not silently
    become a plain key that nobody holds); any other non-empty entry is a plain key and is
    hashed here. Blank entries are skipped."""
    items = entries.split(",") if isinstance(entries, str) else entries
    out: list[str] = []
    for raw in items:
        entry = raw.strip()
        if not entry:
            continue
        if entry.lower().startswith(HASH_PREFIX):
            if not _HASH_RE.fullmatch(entry):
                raise ValueError(f"an API key entry starts with sha256: but is not 64 hex digits after it (it has "
                                 f"{len(entry) - len(HASH_PREFIX)} characters); `dspark hash-key` prints a hash")
            entry = entry.lower()
        else:
            entry = hash_api_key(entry)
        if entry not in out:
            out.append(entry)
    return tuple(out)
