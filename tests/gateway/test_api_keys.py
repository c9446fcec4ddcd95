"""API keys stored hashed (gateway/api_keys.py) and `dspark hash-key`.

Specification: a key's hash is `sha256:` + the SHA-256 hex of its UTF-8 bytes; configured
entries may be hashes or plain keys, and come out as hashes only (a malformed hash is an error
that does not echo it); a presented key is identified by a short id derived from its hash, a
wrong key by None, and the comparison visits every configured hash; the configuration's
gateway.api_keys holds hashes only, even when given plain keys, and DSPARK_API_KEYS (the older
name) adds to it; `dspark hash-key` prints the hash of the key on stdin.
"""

from __future__ import annotations

import hashlib
import hmac
import io
import json

import pytest

from dspark.cli import main
from dspark.serving_config import ServingConfig
from gateway import api_keys as api_keys_module
from gateway.api_keys import ApiKeys, hash_api_key, key_id, normalize_api_keys

KEY = "sk-test-0123456789abcdef"
KEY_HASH = "sha256:" + hashlib.sha256(KEY.encode()).hexdigest()


def test_a_hash_is_the_sha256_of_the_key():
    assert hash_api_key(KEY) == KEY_HASH
    assert key_id(KEY_HASH) == "key-" + KEY_HASH[7:19]
    with pytest.raises(ValueError, match="must not be empty"):
        hash_api_key("")


def test_entries_become_hashes_without_repeats_and_a_malformed_hash_is_an_error():
    assert normalize_api_keys(f" {KEY} , ,{KEY_HASH.upper().replace('SHA256:', 'sha256:')},other") == (
        KEY_HASH, hash_api_key("other"))
    with pytest.raises(ValueError, match="not 64 hex digits") as info:
        normalize_api_keys("sha256:my-secret-key-typed-here")
    assert "my-secret" not in str(info.value)


def test_a_presented_key_is_identified_by_its_id_and_a_wrong_one_is_none():
    keys = ApiKeys.from_entries([KEY_HASH, "second-key"])
    assert keys.identify(KEY.encode()) == key_id(KEY_HASH)
    assert keys.identify(b"second-key") == key_id(hash_api_key("second-key"))
    assert keys.identify(b"sk-wrong") is None and keys.identify(KEY_HASH.encode()) is None
    assert KEY not in repr(keys) and not ApiKeys.from_entries("")


def test_every_configured_hash_is_compared_whichever_matches(monkeypatch):
    compared, compare = [], hmac.compare_digest

    def counting_compare(a, b):
        compared.append(b)
        return compare(a, b)

    monkeypatch.setattr(api_keys_module.hmac, "compare_digest", counting_compare)
    keys = ApiKeys.from_entries(["a-key", KEY, "z-key"])
    for presented in (b"a-key", KEY.encode(), b"wrong"):
        compared.clear()
        keys.identify(presented)
        assert compared == list(keys.digests)  # no early exit: the time says nothing about which key


def test_the_configuration_keeps_hashes_only_and_reads_the_older_variable_too():
    config = ServingConfig.load(env={"DSPARK_GATEWAY_API_KEYS": f"{KEY},{hash_api_key('b')}"})
    assert config.gateway.api_keys == f"{KEY_HASH},{hash_api_key('b')}"
    assert KEY not in config.to_json() and KEY not in repr(config)
    assert ("gateway", "api_keys") in ServingConfig.secret_keys()
    config = ServingConfig.load(env={"DSPARK_GATEWAY_API_KEYS": KEY, "DSPARK_API_KEYS": "legacy-key"})
    keys = ApiKeys.from_entries(config.gateway.api_keys)
    assert keys.identify(KEY.encode()) and keys.identify(b"legacy-key") and "legacy-key" not in config.to_json()
    with pytest.raises(ValueError, match="gateway.api_keys: .*not 64 hex digits"):
        ServingConfig.load(env={"DSPARK_GATEWAY_API_KEYS": "sha256:abc"})


def test_dspark_hash_key_prints_the_hash_of_the_key_on_stdin(monkeypatch, capsys):
    monkeypatch.setattr("sys.stdin", io.StringIO(KEY + "\n"))
    assert main(["hash-key"]) == 0
    out = capsys.readouterr().out
    assert out == KEY_HASH + "\n"
    assert ApiKeys.from_entries(out.strip()).identify(KEY.encode())  # what it prints is what the gateway accepts
    monkeypatch.setattr("sys.stdin", io.StringIO(""))
    assert main(["hash-key"]) == 2
    assert "no key on stdin" in capsys.readouterr().err


def test_the_gateway_limits_come_from_the_configuration_unless_a_flag_is_given():
    from dspark.cli import build_parser

    args = build_parser().parse_args(["gateway", "--requests-per-minute", "30", "--config", "serving.toml"])
    assert (args.requests_per_minute, args.burst, args.max_concurrent_requests, args.config) == (30, None, None, "serving.toml")
    config = ServingConfig.load(env={"DSPARK_GATEWAY_REQUESTS_PER_MINUTE": "600", "DSPARK_GATEWAY_MAX_CONCURRENT_REQUESTS": "8",
                                     "DSPARK_GATEWAY_MAX_PROMPT_TOKENS": "1000"})
    g = config.gateway
    assert (g.requests_per_minute, g.burst, g.max_concurrent_requests, g.max_prompt_tokens) == (600, 0, 8, 1000)
    assert json.loads(config.to_json())["gateway"]["max_body_bytes"] == 1 << 20
    with pytest.raises(ValueError, match="gateway.requests_per_minute must be >= 0"):
        ServingConfig.load(env={"DSPARK_GATEWAY_REQUESTS_PER_MINUTE": "-1"})
