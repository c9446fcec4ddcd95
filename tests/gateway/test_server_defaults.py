"""`dspark serve` with its defaults (the shipped DSpark drafter, the `dspark` policy) starts and
serves: the warm-up must not need the SPS profile that is measured right after it."""

from __future__ import annotations

import asyncio

import pytest

from dspark.engine.speculative import GenerationRequest
from dspark.model.target_runtime import TargetConfig
from dspark.sampling.params import SamplingParams
from dspark.serving_config import ServingConfig
from gateway.server import build_engine


@pytest.mark.slow
def test_the_default_serving_configuration_starts_and_answers_greedy_like_plain_decoding(real_model_dir):
    defaults = ServingConfig()
    assert defaults.drafter.name == "dspark" and defaults.scheduler.policy == "dspark"
    from dspark.drafters import drafter_capture_layers

    target = TargetConfig(model=str(real_model_dir), capture_layers=drafter_capture_layers("dspark", None))
    engine, tokenizer = build_engine(target, drafter="dspark", policy="dspark", sps_max_batch=8)
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
