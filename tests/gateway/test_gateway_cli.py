"""`dspark gateway` on the command line: registered, options parsed, keys from flags or env."""

from __future__ import annotations

from dspark.api_key_hashes import normalize_api_keys
from dspark.cli import build_parser, resolve_for
from gateway.cli import cmd_gateway


def test_dspark_gateway_is_registered_with_its_options():
    args = build_parser().parse_args(["gateway", "--redis", "redis://bus:6379/1", "--api-key", "k1", "--api-key", "k2",
                                      "--max-tokens-limit", "64", "--bus-prefix", "prod", "--accept-timeout", "5"])
    assert args.func is cmd_gateway
    assert (args.redis, args.api_key, args.max_tokens_limit, args.bus_prefix, args.accept_timeout) == (
        "redis://bus:6379/1", ["k1", "k2"], 64, "prod", 5.0)


def test_api_keys_come_from_both_variables_comma_separated_and_the_flags_replace_them():
    env = {"DSPARK_API_KEYS": " k1, ,k2 ", "DSPARK_GATEWAY_API_KEYS": "k3"}
    assert resolve_for("gateway", [], env=env).gateway.api_keys == ",".join(normalize_api_keys("k3,k1,k2"))
    assert resolve_for("gateway", ["--api-key", "k4", "--api-key", "k5"], env=env).gateway.api_keys == (
        ",".join(normalize_api_keys("k4,k5")))
    assert resolve_for("gateway", [], env={}).gateway.api_keys == ""
