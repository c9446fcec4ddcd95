"""`dspark serve` with its defaults (the shipped DSpark drafter, the `dspark` policy) starts and
serves: the warm-up must not need the SPS profile that is measured right after it.

The serving configuration (dspark/serving_config.py) is the one source of the serving defaults:
`dspark serve` and `dspark gateway` without flags, file or variables run with its defaults
(and the gateway with its one command default, a local Redis); that a flag left out never
overrides a key is tests/test_command_config.py's."""

from __future__ import annotations

import asyncio

import pytest

from dspark.cli import resolve_for, serve_arguments
from dspark.engine.speculative import GenerationRequest
from dspark.model.target_runtime import TargetConfig
from dspark.sampling.params import SamplingParams
from dspark.serving_config import ServingConfig
from gateway.cli import DEFAULT_REDIS_URL
from gateway.server import build_engine


def test_dspark_serve_without_flags_runs_with_the_serving_configurations_defaults():
    config = ServingConfig()
    resolved = serve_arguments(resolve_for("serve", [], env={}))
    target = resolved.pop("target")
    assert (target.model, target.dtype, target.kv_budget_mb, target.max_model_len) == (
        config.model.name, config.model.dtype, config.model.kv_budget_mb, None)
    assert resolved == {
        "host": config.gateway.host, "port": config.gateway.port, "drafter": config.drafter.name, "drafter_path": None,
        "drafter_top_k": config.drafter.top_k, "gamma": config.scheduler.gamma, "policy": config.scheduler.policy,
        "sps_max_batch": config.verifier.sps_max_batch, "sampler_backend": config.verifier.sampler_backend,
        "max_tokens_limit": config.gateway.max_tokens_limit, "model_name": None, "limits": config.gateway,
        "observability": config.observability}


def test_dspark_gateway_without_flags_runs_with_the_defaults_and_a_local_redis():
    assert resolve_for("gateway", [], env={}) == ServingConfig().updated({"redis": {"url": DEFAULT_REDIS_URL}})


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
