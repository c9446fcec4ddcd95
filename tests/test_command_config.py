"""Every `dspark` command resolves its serving configuration one way (dspark/command_config.py).

Specification: the configuration's keys are the fields of dspark/serving_config.py's sections,
the one source of them (deploy/k8s/base/config/serving.env names each one: tests/deploy). For
every command that serves (generate, profile, serve, gateway, verifier, drafter, scheduler, up,
healthcheck) every key reaches the configuration the command runs with from a file (`--config`,
or $DSPARK_CONFIG), from its DSPARK_<SECTION>_<KEY> variable and, where the command has a flag
for it, from the flag; the environment beats the file, a flag beats both, and a flag left out
overrides nothing. Each command runs with exactly what `resolve_for` gives, and `dspark serve`
passes on every key it uses (none silently dropped). A typo in a file or a value that does not
parse stops a command with a message that names the key.
"""

from __future__ import annotations

import argparse
import json
import os
import typing
from dataclasses import fields
from pathlib import Path

import pytest

from dspark.api_key_hashes import normalize_api_keys
from dspark.cli import build_parser, main, resolve_for, serve_arguments
from dspark.serving_config import ServingConfig

SERVING_COMMANDS = ("generate", "profile", "serve", "gateway", "verifier", "drafter", "scheduler", "up", "healthcheck")
REQUIRED = {"generate": ["a prompt"], "healthcheck": ["--target", "127.0.0.1:1"]}  # what each needs besides configuration
LAYERS = ("file", "env", "flag")

# Keys whose values are checked against a set: a distinct valid value per layer.
CHOICES = {
    "model.dtype": ("bfloat16", "float32", "auto"),
    "model.weights": ("dense", "compact", "auto"),  # valid beside each layer's dtype (compact computes in fp32)
    "model.device": ("cpu", "cuda:1", "auto"),  # checked as a name only: no device is opened by resolving configuration
    "verifier.sampler_backend": ("torch", "triton", "auto"),
    "observability.otlp_protocol": ("grpc", "http/protobuf", ""),
    "drafter.name": ("ngram", "dspark", "dflash"),
}


def all_keys() -> list[tuple[str, str]]:
    """(section, key) of every key, from the dataclasses themselves."""
    hints = typing.get_type_hints(ServingConfig)
    return [(s.name, f.name) for s in fields(ServingConfig) for f in fields(hints[s.name])]


def value(section: str, key: str, layer: str):
    """A valid value of the key, different in each layer and from its default."""
    i = LAYERS.index(layer)
    if f"{section}.{key}" in CHOICES:
        return CHOICES[f"{section}.{key}"][i]
    default = getattr(getattr(ServingConfig(), section), key)
    if isinstance(default, int):
        return default + i + 1
    if isinstance(default, float):
        return default / 2 ** (i + 1)
    return f"{section}-{key}-{layer}"  # long enough for rpc.auth_token; api_keys: a plain key, hashed on load


def stored(section: str, key: str, given):
    """What the configuration holds for a value given: API keys as their hashes."""
    return ",".join(normalize_api_keys(given)) if (section, key) == ("gateway", "api_keys") else given


@pytest.fixture(scope="module")
def parser() -> argparse.ArgumentParser:
    return build_parser()


def subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    (action,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(action.choices)


def flags_of(parser: argparse.ArgumentParser, command: str) -> dict[str, str]:
    """{"section.key": "--flag"} of the command's flags that set a key."""
    return {key: "--" + dest.replace("_", "-") for dest, key in subparsers(parser)[command].get_default("config_flags").items()}


def test_every_serving_command_takes_a_config_file_and_no_other_does(parser):
    with_config = {name for name, p in subparsers(parser).items() if p.get_default("config_flags") is not None}
    assert with_config == set(SERVING_COMMANDS)


@pytest.mark.parametrize("command", SERVING_COMMANDS)
def test_a_flag_that_sets_a_key_defaults_to_none_so_that_left_out_it_overrides_nothing(parser, command):
    p = subparsers(parser)[command]
    for dest, key in p.get_default("config_flags").items():
        section, name = key.split(".")
        assert (section, name) in all_keys(), f"{command}: --{dest} names no key ({key})"
        assert p.get_default(dest) is None, f"{command}: --{dest} defaults to {p.get_default(dest)!r}, not None"


@pytest.mark.parametrize("command", SERVING_COMMANDS)
def test_every_key_reaches_every_command_from_the_file_then_the_environment_then_a_flag(parser, command, tmp_path):
    keys = all_keys()
    path = tmp_path / "serving.json"
    path.write_text(json.dumps({s: {k: value(s, k, "file") for s2, k in keys if s2 == s} for s, _ in keys}))
    env = {f"DSPARK_{s.upper()}_{k.upper()}": str(value(s, k, "env")) for s, k in keys}
    flags = flags_of(parser, command)
    argv = [a for key, flag in flags.items() for a in (flag, str(value(*key.split("."), "flag")))]
    required = REQUIRED.get(command, [])

    def mismatches(config: ServingConfig, layer_of) -> list[str]:
        out = []
        for s, k in keys:
            layer = layer_of(f"{s}.{k}")
            want, got = stored(s, k, value(s, k, layer)), getattr(getattr(config, s), k)
            if got != want:
                out.append(f"{s}.{k}: {got!r}, expected the {layer}'s {want!r}")
        return out

    by_file = resolve_for(command, [*required, "--config", str(path)], env={}, parser=parser)
    assert mismatches(by_file, lambda key: "file") == []
    assert resolve_for(command, required, env={"DSPARK_CONFIG": str(path)}, parser=parser) == by_file
    by_env = resolve_for(command, [*required, "--config", str(path)], env=env, parser=parser)
    assert mismatches(by_env, lambda key: "env") == []
    by_flag = resolve_for(command, [*required, "--config", str(path), *argv], env=env, parser=parser)
    assert mismatches(by_flag, lambda key: "flag" if key in flags else "env") == []


def run_points(monkeypatch) -> dict[str, list]:
    """Replace what each command runs with a recorder of the configuration it was given."""
    import gateway.cli
    import gateway.server
    import services.cli
    import services.drafter.server
    import services.healthcheck
    import services.scheduler.server
    import services.verifier.server
    from services.grpc_tls import TlsConfigError

    got: dict[str, list] = {}

    def record(command, *, returns=0):
        def run(config, *args, **kwargs):
            got.setdefault(command, []).append(config)
            return returns
        return run

    import dspark.cli

    monkeypatch.setattr(dspark.cli, "run_generate", record("generate"))
    monkeypatch.setattr(dspark.cli, "run_profile", record("profile"))
    monkeypatch.setattr(gateway.server, "serve", lambda **kwargs: got.setdefault("serve", []).append(kwargs))
    monkeypatch.setattr(gateway.cli, "run_gateway", record("gateway"))
    monkeypatch.setattr(services.verifier.server, "serve_verifier", record("verifier", returns=None))
    monkeypatch.setattr(services.drafter.server, "serve_drafter", record("drafter", returns=None))
    monkeypatch.setattr(services.scheduler.server, "serve_scheduler", record("scheduler", returns=None))
    monkeypatch.setattr(services.cli, "run_up", record("up"))

    def load_tls(rpc):  # the healthcheck's only use of its configuration; stop before dialling
        got.setdefault("healthcheck", []).append(rpc)
        raise TlsConfigError("recorded")

    monkeypatch.setattr(services.healthcheck, "load_tls", load_tls)
    return got


@pytest.mark.parametrize("command", SERVING_COMMANDS)
def test_each_command_runs_with_the_configuration_resolve_for_gives(parser, command, monkeypatch, tmp_path):
    path = tmp_path / "serving.toml"
    path.write_text('[model]\nkv_budget_mb = 123\n\n[gateway]\nport = 8123\n\n[rpc]\ndeadline_s = 2.5\n')
    env = {"DSPARK_SCHEDULER_GAMMA": "3", "DSPARK_GATEWAY_MAX_TOKENS_LIMIT": "77", "DSPARK_DRAFTER_TOP_K": "5",
           "DSPARK_DRAFTER_NAME": "ngram", "DSPARK_RPC_TLS_CA_PATH": "/ca", "DSPARK_RPC_TLS_CERT_PATH": "/crt",
           "DSPARK_RPC_TLS_KEY_PATH": "/key"}
    for name, raw in env.items():
        monkeypatch.setenv(name, raw)
    monkeypatch.setenv("GRPC_VERBOSITY", "NONE")  # what `dspark healthcheck` sets (restored after the test)
    got = run_points(monkeypatch)
    argv = [*REQUIRED.get(command, []), "--config", str(path)]
    main([command, *argv])
    expected = resolve_for(command, argv, env=dict(os.environ), parser=parser)
    assert expected.model.kv_budget_mb == 123 and expected.scheduler.gamma == 3  # the file and the environment both count
    if command == "serve":
        assert got["serve"] == [serve_arguments(expected)]
    elif command == "healthcheck":
        assert got["healthcheck"] == [expected.rpc]
    else:
        assert got[command] == [expected]


# Every key `dspark serve` runs with. The others are no concern of one process: the gRPC services'
# endpoints and rpc.* (no gRPC inside), redis.url (an in-memory bus), verifier.sps_tokens_per_request
# (serve profiles with γ + 1 tokens per request, as it knows γ), observability.metrics_port (the
# scheduler service's endpoint; serve's metrics are the gateway's /metrics).
SERVE_KEYS = (
    [("model", k) for k in ("name", "dtype", "kv_budget_mb", "max_model_len")]
    + [("drafter", k) for k in ("name", "path", "top_k")] + [("scheduler", "gamma"), ("scheduler", "policy")]
    + [("verifier", "sps_max_batch"), ("verifier", "sampler_backend")]
    + [("gateway", f.name) for f in fields(ServingConfig().gateway)]
    + [("observability", k) for k in ("otlp_endpoint", "otlp_protocol", "sample_ratio")]
)


@pytest.mark.parametrize("section, key", SERVE_KEYS)
def test_dspark_serve_passes_on_every_key_it_uses(section, key):
    base = ServingConfig().updated({"drafter": {"name": "ngram"}})  # a drafter without a checkpoint to read
    changed = base.updated({section: {key: value(section, key, "file" if (section, key) != ("drafter", "name") else "env")}})
    assert serve_arguments(changed) != serve_arguments(base), f"{section}.{key} does not reach gateway.server.serve"


@pytest.mark.parametrize("command", ["serve", "gateway", "verifier", "up"])
def test_a_typo_in_the_file_or_a_bad_variable_stops_the_command_with_a_message_naming_it(command, monkeypatch, capsys,
                                                                                          tmp_path):
    path = tmp_path / "serving.toml"
    path.write_text("[gateway]\nprot = 8000\n")
    assert main([command, "--config", str(path)]) == 2
    captured = capsys.readouterr()
    assert "unknown key(s) ['prot'] in section 'gateway'" in captured.out + captured.err
    monkeypatch.setenv("DSPARK_GATEWAY_MAX_TOKENS_LIMIT", "lots")
    assert main([command]) == 2
    captured = capsys.readouterr()
    assert "environment: gateway.max_tokens_limit must be an integer, got 'lots'" in captured.out + captured.err


def test_the_configuration_modules_import_neither_the_gateway_nor_the_services_nor_torch():
    import subprocess
    import sys

    code = ("import sys; from dspark.serving_config import ServingConfig; import dspark.command_config; "
            "ServingConfig.load(env={'DSPARK_GATEWAY_API_KEYS': 'a-key'}); "  # plain keys are hashed on load
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'gateway', 'services', 'torch'}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).resolve().parents[1]).stdout
    assert out.strip() == "[]"
