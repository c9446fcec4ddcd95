"""The serving configuration (dspark/serving_config.py): one typed tree, file + environment.

Specification: defaults <- file (TOML or JSON, or $DSPARK_CONFIG) <- DSPARK_<SECTION>_<KEY> <-
overrides, each value converted to its field's type; a typo (unknown section or key) or a value
of the wrong type is a ValueError naming it; environment variables of other sections are ignored;
services listen on host:port and are dialled at `address` (or host:port).
"""

from __future__ import annotations

import json

import pytest

from dspark.serving_config import ServingConfig


def test_the_defaults_are_a_complete_local_deployment():
    c = ServingConfig.load(env={})
    assert c.model.name == "smollm2-135m-instruct" and c.drafter.name == "dspark-lookup" and c.scheduler.gamma == 7
    ports = {c.scheduler.port, c.drafter.port, c.verifier.port, c.gateway.port}
    assert len(ports) == 4  # every service its own port
    assert c.verifier.dial == c.verifier.bind == f"127.0.0.1:{c.verifier.port}"
    assert c.redis.url == "" and c.scheduler.policy == "dspark"  # the shipped drafter, Algorithm 1
    assert all(v > 0 for v in (c.rpc.deadline_s, c.rpc.verify_deadline_s, c.rpc.draft_deadline_s, c.rpc.connect_timeout_s))


def test_the_default_model_is_the_model_stores():
    from dspark.model.model_store import DEFAULT_MODEL
    from dspark.serving_config import DEFAULT_MODEL_NAME

    assert DEFAULT_MODEL_NAME == DEFAULT_MODEL  # kept in two places so that the configuration imports no torch


def test_a_toml_file_then_the_environment_then_overrides(tmp_path):
    path = tmp_path / "serving.toml"
    path.write_text('[verifier]\nport = 6000\nsps_max_batch = 16\n\n[scheduler]\npolicy = "dspark"\ngamma = 5\n\n'
                    '[rpc]\nverify_deadline_s = 30\n')
    env = {"DSPARK_SCHEDULER_GAMMA": "3", "DSPARK_VERIFIER_ADDRESS": "verifier:6000", "DSPARK_CACHE_DIR": "/elsewhere"}
    c = ServingConfig.load(path, env=env, overrides={"scheduler": {"policy": "fixed:2"}})
    assert c.verifier.port == 6000 and c.verifier.sps_max_batch == 16  # file
    assert c.scheduler.gamma == 3 and c.verifier.dial == "verifier:6000" and c.verifier.bind == "127.0.0.1:6000"  # env over file
    assert c.scheduler.policy == "fixed:2"  # overrides over everything
    assert c.rpc.verify_deadline_s == 30.0 and isinstance(c.rpc.verify_deadline_s, float)


def test_a_json_file_named_by_the_environment(tmp_path):
    path = tmp_path / "serving.json"
    path.write_text(json.dumps({"drafter": {"name": "dspark", "path": "/ckpt", "top_k": 8}, "redis": {"url": "redis://r:6379/0"}}))
    c = ServingConfig.load(env={"DSPARK_CONFIG": str(path)})
    assert (c.drafter.name, c.drafter.path, c.drafter.top_k, c.redis.url) == ("dspark", "/ckpt", 8, "redis://r:6379/0")
    assert ServingConfig.load(path, env={}) == c and ServingConfig.load(env={}).updated(json.loads(path.read_text())) == c


def test_a_service_listening_on_every_interface_is_dialled_locally():
    c = ServingConfig.load(env={"DSPARK_DRAFTER_HOST": "0.0.0.0", "DSPARK_DRAFTER_PORT": "7001"})
    assert c.drafter.bind == "0.0.0.0:7001" and c.drafter.dial == "127.0.0.1:7001"


def test_the_resolved_configuration_round_trips_through_json(tmp_path):
    c = ServingConfig.load(env={"DSPARK_SCHEDULER_POLICY": "threshold:0.4", "DSPARK_RPC_DEADLINE_S": "2.5"})
    path = tmp_path / "resolved.json"
    path.write_text(c.to_json())
    assert ServingConfig.load(path, env={}) == c


@pytest.mark.parametrize("env, message", [
    ({"DSPARK_VERIFIER_PROT": "1"}, "DSPARK_VERIFIER_PROT: unknown key 'prot' of section 'verifier'"),
    ({"DSPARK_VERIFIER_PORT": "fast"}, "verifier.port must be an integer, got 'fast'"),
    ({"DSPARK_VERIFIER_PORT": "70000"}, r"verifier.port must be in \[0, 65535\]"),
    ({"DSPARK_RPC_DEADLINE_S": "0"}, "rpc.deadline_s must be > 0"),
    ({"DSPARK_MODEL_DTYPE": "int8"}, "model.dtype must be"),
    ({"DSPARK_SCHEDULER_GAMMA": "-1"}, "scheduler.gamma must be >= 0"),
])
def test_bad_environment_values_are_errors_that_name_them(env, message):
    with pytest.raises(ValueError, match=message):
        ServingConfig.load(env=env)


@pytest.mark.parametrize("content, suffix, message", [
    ('[verifer]\nport = 1\n', ".toml", "unknown section 'verifer'"),
    ('[verifier]\nprot = 1\n', ".toml", r"unknown key\(s\) \['prot'\] in section 'verifier'"),
    ('[verifier]\nport = "1"\n', ".toml", None),  # a string that is an integer is accepted
    ('[verifier]\nport = 1.5\n', ".toml", "verifier.port must be an integer, got 1.5"),
    ('{"scheduler": {"gamma": true}}', ".json", "scheduler.gamma must be an integer, got True"),
    ('{"scheduler": 3}', ".json", "section 'scheduler' must be a table"),
    ('[verifier\n', ".toml", "invalid TOML"),
    ('port: 1\n', ".yaml", "must end in .toml or .json"),
])
def test_bad_files_are_errors_that_name_the_problem(tmp_path, content, suffix, message):
    path = tmp_path / f"serving{suffix}"
    path.write_text(content)
    if message is None:
        assert ServingConfig.load(path, env={}).verifier.port == 1
        return
    with pytest.raises(ValueError, match=message):
        ServingConfig.load(path, env={})


def test_a_missing_file_is_reported(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        ServingConfig.load(tmp_path / "nope.toml", env={})
