"""API keys: stored as SHA-256 hashes, checked in constant time, named by a short id.

    echo -n "$KEY" | dspark hash-key          # -> sha256:<64 hex>, what the configuration stores
    keys = ApiKeys.from_entries(["sha256:9f86d08...", "a-plain-key"])
    keys.identify(b"a-plain-key")              # -> "key-2c26b46b68ff" (its id), None for a wrong key

The gateway never keeps a key's plain text: a configured plain key is hashed when it is loaded
(`normalize_api_keys`, also applied by dspark.serving_config to `gateway.api_keys`), and a
presented key is hashed before it is compared. The SHA-256 of the presented key is compared
with every configured hash by `hmac.compare_digest`, without stopping at a match, so the time
taken says neither which key matched nor whether one did. (The keys are long random strings, so
an unsalted fast hash is enough: there is no dictionary to try.) A key is named in logs, metrics
and rate-limit buckets only by its id, the first 12 hex digits of its hash. The hashing itself
lives in dspark/api_key_hashes.py, which the configuration uses without importing the gateway.
"""

from __future__ import annotations

import hashlib
import hmac
import sys
from collections.abc import Iterable
from dataclasses import dataclass

from dspark.api_key_hashes import HASH_PREFIX, hash_api_key, normalize_api_keys

__all__ = ["HASH_PREFIX", "ApiKeys", "cmd_hash_key", "hash_api_key", "key_id", "normalize_api_keys"]

_KEY_ID_HEX = 12


def key_id(key_hash: str) -> str:
    """The short name of a key in logs and limits: `key-` + the first 12 hex digits of its hash."""
    return "key-" + key_hash.removeprefix(HASH_PREFIX)[:_KEY_ID_HEX].lower()


@dataclass(frozen=True)
class ApiKeys:
    """The accepted keys, as SHA-256 digests; empty = no authentication."""

    digests: tuple[bytes, ...]  # 32 bytes each
    ids: tuple[str, ...]  # key_id of each digest

    @classmethod
    def from_entries(cls, entries: str | Iterable[str]) -> ApiKeys:
        hashes = normalize_api_keys(entries)
        return cls(digests=tuple(bytes.fromhex(h.removeprefix(HASH_PREFIX)) for h in hashes), ids=tuple(key_id(h) for h in hashes))

    def __bool__(self) -> bool:
        return bool(self.digests)

    def identify(self, presented: bytes) -> str | None:
        """The id of the key `presented` is, or None. Constant time in the key and in which
        configured key matched (module docstring)."""
        digest = hashlib.sha256(presented).digest()
        matches = [hmac.compare_digest(digest, d) for d in self.digests]  # all of them: no early exit
        return self.ids[matches.index(True)] if any(matches) else None


def cmd_hash_key(args) -> int:
    """`dspark hash-key`: the hash of the key on stdin (first line, surrounding whitespace dropped)."""
    key = sys.stdin.readline().strip()
    if not key:
        print("error: no key on stdin (e.g. `echo -n \"$KEY\" | dspark hash-key`)", file=sys.stderr)
        return 2
    print(hash_api_key(key))
    return 0
