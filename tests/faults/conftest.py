"""Fixtures for the fault tests: a private Redis to restart, the tiny model as a directory with a
tokenizer (for `dspark up`'s gateway), and the fault ledger.

The ledger collects, per kind of fault a test injected, how many faults, requests and tokens it
covered and how many tokens were lost or duplicated against plain greedy decoding; the table is
printed at the end of the run (it is the table of docs/fault-tolerance.md):

    .venv/bin/pytest tests/faults -q
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.faults.redis_server import RedisServer, redis_server_binary
from tests.services.conftest import write_tiny_model_dir

CHAR_BASE = 0x100  # token id t is the one character chr(CHAR_BASE + t): text and tokens convert one to one


def write_char_tokenizer(directory: Path, vocab_size: int = 256) -> None:
    """A Hugging Face tokenizer for the tiny model: one distinct printable character per token id
    (no special tokens, no end-of-sequence: generations run to max_tokens), so a test reads the
    exact token ids back from the text a gateway streams."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    vocab = {chr(CHAR_BASE + i): i for i in range(vocab_size)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token=chr(CHAR_BASE)))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tokenizer.decoder = decoders.Fuse()
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}))


def token_ids_of(text: str) -> list[int]:
    return [ord(c) - CHAR_BASE for c in text]


@pytest.fixture(scope="module")
def served_model_dir(tmp_path_factory) -> Path:
    """The tiny random model (seed 0) with the one-character-per-token tokenizer."""
    directory = write_tiny_model_dir(tmp_path_factory.mktemp("tiny-served") / "tiny-model")
    write_char_tokenizer(directory)
    return directory


@pytest.fixture
def redis_server(tmp_path):
    """`make(persistent=True)` -> a started private RedisServer, stopped after the test."""
    if redis_server_binary() is None:
        pytest.skip("redis-server is not installed")
    servers: list[RedisServer] = []

    def make(*, persistent: bool = True) -> RedisServer:
        server = RedisServer(tmp_path / f"redis-{len(servers)}", persistent=persistent).start()
        servers.append(server)
        return server

    yield make
    for server in servers:
        server.stop()


# ---- the fault ledger ---------------------------------------------------------------------------


@dataclass
class FaultRecord:
    kind: str
    faults: int = 0
    requests: int = 0
    tokens: int = 0  # tokens plain greedy decoding emits for those requests
    lost: int = 0  # of those, missing from what the clients received
    duplicated: int = 0  # received beyond the matching prefix: repeated or wrong tokens
    notes: list[str] = field(default_factory=list)


LEDGER: dict[str, FaultRecord] = {}


def compare_tokens(received: list[int], expected: list[int]) -> tuple[int, int]:
    """(lost, duplicated): tokens of `expected` after the longest common prefix, and tokens of
    `received` after it. Both are 0 exactly when the two are equal."""
    common = 0
    for a, b in zip(received, expected):
        if a != b:
            break
        common += 1
    return len(expected) - common, len(received) - common


class Ledger:
    def record(self, kind: str, *, faults: int, received: list[list[int]], expected: list[list[int]], note: str = "") -> FaultRecord:
        entry = LEDGER.setdefault(kind, FaultRecord(kind))
        entry.faults += faults
        entry.requests += len(expected)
        for got, want in zip(received, expected, strict=True):
            lost, duplicated = compare_tokens(got, want)
            entry.tokens += len(want)
            entry.lost += lost
            entry.duplicated += duplicated
        if note:
            entry.notes.append(note)
        return entry


@pytest.fixture
def fault_ledger() -> Ledger:
    return Ledger()


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:
    if not LEDGER:
        return
    tr = terminalreporter
    tr.section("faults survived (tokens against plain greedy decoding)")
    tr.write_line("| fault | injected | requests in flight | tokens | lost | duplicated |")
    tr.write_line("|---|---:|---:|---:|---:|---:|")
    for r in LEDGER.values():
        tr.write_line(f"| {r.kind} | {r.faults} | {r.requests} | {r.tokens} | {r.lost} | {r.duplicated} |")
