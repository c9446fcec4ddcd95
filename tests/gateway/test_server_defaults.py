"""`dspark serve` with its defaults (the shipped DSpark drafter, the `dspark` policy) starts and
serves: the warm-up must not need the SPS profile that is measured right after it.

The serving configuration (dspark/serving_config.py) is the one source of the serving defaults:
a flag of `dspark serve` or `dspark gateway` that has a key there, left out, takes that key's
default; with other defaults in the configuration the flags follow them (a default written into
the CLI would not)."""

from __future__ import annotations

import asyncio

import pytest

import dspark.serving_config
from dspark.cli import build_parser, serve_arguments
from dspark.engine.speculative import GenerationRequest
from dspark.model.target_runtime import TargetConfig
from dspark.sampling.params import SamplingParams
from dspark.serving_config import ServingConfig
from gateway.cli import with_config_defaults
from gateway.server import build_engine

# Defaults unlike the shipped ones, for every key a `dspark serve` / `dspark gateway` flag stands for.
OTHER_DEFAULTS = {
    "model": {"name": "some-other-model", "dtype": "float32", "kv_budget_mb": 123},
    "gateway": {"host": "0.0.0.0", "port": 8123, "max_tokens_limit": 777},
    "verifier": {"sps_max_batch": 5},
    "scheduler": {"gamma": 3},
}


def serve_defaults(config: ServingConfig) -> dict:
    """What `dspark serve` without flags passes to gateway.server.serve."""
    resolved = serve_arguments(build_parser().parse_args(["serve"]))
    target = resolved.pop("target")
    return {**resolved, "model": target.model, "dtype": target.dtype, "kv_budget_mb": target.kv_budget_mb}


def expected_serve_defaults(config: ServingConfig) -> dict:
    return {"host": config.gateway.host, "port": config.gateway.port, "max_tokens_limit": config.gateway.max_tokens_limit,
            "sps_max_batch": config.verifier.sps_max_batch, "gamma": config.scheduler.gamma,
            "model": config.model.name, "dtype": config.model.dtype, "kv_budget_mb": config.model.kv_budget_mb}


def gateway_defaults() -> dict:
    args = with_config_defaults(build_parser().parse_args(["gateway"]))
    return {"model": args.model, "host": args.host, "port": args.port}


def test_dspark_serve_flags_default_to_the_serving_configuration():
    config = ServingConfig()
    resolved = serve_defaults(config)
    assert {k: resolved[k] for k in expected_serve_defaults(config)} == expected_serve_defaults(config)
    assert resolved["drafter"] == config.drafter.name and resolved["policy"] == config.scheduler.policy


def test_dspark_gateway_flags_default_to_the_serving_configuration():
    config = ServingConfig()
    assert gateway_defaults() == {"model": config.model.name, "host": config.gateway.host, "port": config.gateway.port}
    args = build_parser().parse_args(["gateway"])  # the limits fall back to the loaded configuration in cmd_gateway
    assert args.max_tokens_limit is None and args.max_body_bytes is None and args.max_prompt_tokens is None


def test_the_cli_defaults_follow_the_configuration_when_its_defaults_change(monkeypatch):
    other = ServingConfig().updated(OTHER_DEFAULTS)
    monkeypatch.setattr(dspark.serving_config, "ServingConfig", lambda: other)  # what the CLI modules read at parse time
    resolved = serve_defaults(other)
    assert {k: resolved[k] for k in expected_serve_defaults(other)} == expected_serve_defaults(other)
    assert gateway_defaults() == {"model": "some-other-model", "host": "0.0.0.0", "port": 8123}


@pytest.mark.slow
def test_the_default_serving_configuration_starts_and_answers_greedy_like_plain_decoding(real_model_dir):
    defaults = ServingConfig()
    assert defaults.drafter.name == "dspark-lookup" and defaults.scheduler.policy == "dspark"
    from dspark.drafters import drafter_capture_layers

    target = TargetConfig(model=str(real_model_dir), capture_layers=drafter_capture_layers(defaults.drafter.name, None))
    engine, tokenizer = build_engine(target, drafter=defaults.drafter.name, policy="dspark", sps_max_batch=8)
    try:
        assert engine.engine.sps_profile is not None and engine.engine.policy is not None
        prompt = tokenizer.encode_chat([{"role": "user", "content": "Count from 1 to 10."}])

        async def run(rid: str) -> list[int]:
            out = []
            async for delta in engine.generate(GenerationRequest(rid, prompt, 12, SamplingParams(temperature=0.0))):
                out += delta.new_token_ids
            return out

        served = asyncio.run(run("defaults"))
    finally:
        engine.shutdown()
    plain, _ = build_engine(TargetConfig(model=str(real_model_dir)), drafter="none", sps_max_batch=0)
    try:
        async def run_plain() -> list[int]:
            out = []
            async for delta in plain.generate(GenerationRequest("plain", prompt, 12, SamplingParams(temperature=0.0))):
                out += delta.new_token_ids
            return out

        assert served == asyncio.run(run_plain())
    finally:
        plain.shutdown()
