"""`dspark serve`: the embedded OpenAI-compatible server, one process, no external services.

    dspark serve --port 8000 --drafter ngram --gamma 7
    curl localhost:8000/v1/chat/completions -H 'content-type: application/json' \\
        -d '{"model": "smollm2-135m-instruct", "messages": [{"role": "user", "content": "Hi"}]}'

Start-up order: load the target and tokenizer, build the drafter and the engine, run one short
generation so the first client does not pay for lazy initialisation, start the engine thread,
then accept connections. Shutdown stops uvicorn first, then the engine thread.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import uvicorn

from dspark.drafters import DRAFTERS, make_drafter
from dspark.engine.async_engine import AsyncEngine
from dspark.engine.speculative import GenerationRequest, SpeculativeEngine
from dspark.model.model_store import DEFAULT_MODEL
from dspark.model.target_runtime import TargetConfig, TargetRuntime
from dspark.model.tokenizer import Tokenizer
from dspark.profiling.sps import profile_sps
from dspark.scheduling.policies import parse_policy
from dspark.sampling.params import SamplingParams
from gateway.app import create_app

__all__ = ["build_engine", "serve", "served_model_name", "warm_up"]

log = logging.getLogger(__name__)


def served_model_name(model: str) -> str:
    """The id clients put in `model`: the default model's name, or the checkpoint directory's name."""
    return model if model == DEFAULT_MODEL else Path(model).expanduser().resolve().name


def warm_up(engine: SpeculativeEngine, tokenizer: Tokenizer) -> float:
    """One short greedy generation (a prefill and a decode round) on the caller's thread, before
    the engine thread exists; returns its seconds."""
    t0 = time.perf_counter()
    prompt = tokenizer.encode("Hello, world. Hello, world.") or [0]
    engine.generate([GenerationRequest("warmup", prompt, 4, SamplingParams(temperature=0.0))])
    return time.perf_counter() - t0


def build_engine(
    target: TargetConfig, *, drafter: str = "ngram", gamma: int = 7, sps_max_batch: int = 64,
    drafter_path: str | None = None,
    policy: str | None = None,
) -> tuple[AsyncEngine, Tokenizer]:
    """Load, warm up, profile SPS(B) and start: an AsyncEngine ready for requests, and the
    target's tokenizer. `sps_max_batch=0` skips the profile (a few seconds on this CPU)."""
    runtime = TargetRuntime.load(target)
    tokenizer = Tokenizer(runtime.model_dir)
    policy_obj = parse_policy(policy) if policy else None
    if policy_obj is not None and policy_obj.needs_sps_profile and sps_max_batch <= 0:
        raise ValueError(f"policy {policy!r} needs the SPS(B) profile: set sps_max_batch > 0")
    engine = SpeculativeEngine(runtime, make_drafter(drafter, runtime=runtime, path=drafter_path),
                               num_speculative_tokens=gamma, policy=policy_obj)
    log.info("warm-up took %.2f s", warm_up(engine, tokenizer))
    if sps_max_batch > 0:
        t0 = time.perf_counter()
        engine.sps_profile = profile_sps(runtime, max_batch=sps_max_batch, tokens_per_request=gamma + 1)
        log.info(
            "SPS(B) profiled in %.1f s: %s", time.perf_counter() - t0,
            ", ".join(f"B={b}: {1 / t:.1f}" for b, t in zip(engine.sps_profile.batch_sizes, engine.sps_profile.step_seconds)
                      if b in (1, 4, 8, 16, 32, 64)),
        )
    return AsyncEngine(engine).start(), tokenizer


def serve(
    host: str = "127.0.0.1",
    port: int = 8000,
    model: str = DEFAULT_MODEL,
    drafter: str = "ngram",
    gamma: int = 7,
    *,
    target: TargetConfig | None = None,  # overrides `model` (dtype, KV budget, context length)
    max_tokens_limit: int = 2048,
    model_name: str | None = None,  # the id clients send; default: see served_model_name
    log_level: str = "info",
    sps_max_batch: int = 64,  # SPS(B) profile at start-up up to this batch; 0 skips it
    drafter_path: str | None = None,  # checkpoint directory of a trained drafter (dspark)
    policy: str | None = None,  # parse_policy form; None = all γ drafts every round
) -> None:
    if drafter not in DRAFTERS:  # fail on a bad name before loading anything
        raise ValueError(f"unknown drafter {drafter!r}; expected one of {DRAFTERS}")
    target = target or TargetConfig(model=model)
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    engine, tokenizer = build_engine(target, drafter=drafter, gamma=gamma, sps_max_batch=sps_max_batch,
                                     drafter_path=drafter_path, policy=policy)
    name = model_name or served_model_name(target.model)
    app = create_app(engine, tokenizer, model_name=name, max_tokens_limit=max_tokens_limit)
    log.info("serving %s on http://%s:%d/v1 (drafter %s, gamma %d)", name, host, port, drafter, gamma)
    try:
        uvicorn.run(app, host=host, port=port, log_level=log_level)
    finally:
        engine.shutdown()
