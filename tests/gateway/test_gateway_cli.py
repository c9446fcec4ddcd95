"""`dspark gateway` on the command line: registered, options parsed, keys from flags or env."""

from __future__ import annotations

from dspark.cli import build_parser
from gateway.cli import cmd_gateway
from gateway.server import api_keys_from_env


def test_dspark_gateway_is_registered_with_its_options():
    args = build_parser().parse_args(["gateway", "--redis", "redis://bus:6379/1", "--api-key", "k1", "--api-key", "k2",
                                      "--max-tokens-limit", "64", "--bus-prefix", "prod", "--accept-timeout", "5"])
    assert args.func is cmd_gateway
    assert (args.redis, args.api_key, args.max_tokens_limit, args.bus_prefix, args.accept_timeout) == (
        "redis://bus:6379/1", ["k1", "k2"], 64, "prod", 5.0)


def test_api_keys_come_from_the_environment_comma_separated(monkeypatch):
    monkeypatch.setenv("DSPARK_API_KEYS", " k1, ,k2 ")
    assert api_keys_from_env() == ("k1", "k2")
    monkeypatch.delenv("DSPARK_API_KEYS")
    assert api_keys_from_env() == ()
