"""`dspark serve`: the embedded OpenAI-compatible server, one process, no external services.

    dspark serve --port 8000 --drafter ngram --gamma 7
    curl localhost:8000/v1/chat/completions -H 'content-type: application/json' \\
        -d '{"model": "smollm2-135m-instruct", "messages": [{"role": "user", "content": "Hi"}]}'

The same gateway as the distributed mode (gateway/app.py over a Bus), wired in-process: an
in-memory bus, and the bus worker (dspark/bus/worker.py) on its own thread feeding the
in-process AsyncEngine. Start-up order: load the target and tokenizer, build the drafter and the
engine, run one short generation so the first client does not pay for lazy initialisation,
start the engine thread and the worker, then accept connections. Shutdown stops uvicorn first,
then the worker, then the engine thread. API keys (gateway.api_keys: DSPARK_GATEWAY_API_KEYS and
DSPARK_API_KEYS), request limits per client (in memory here) and connection limits (floods, slow
clients): the gateway section of the serving configuration, applied by gateway/guard.py and
gateway/connection_limits.py.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import uvicorn
from fastapi import FastAPI

from dspark.bus.memory_bus import MemoryBus
from dspark.bus.worker import WorkerThread, start_worker_thread
from dspark.drafters import drafter_names, make_drafter
from dspark.engine.async_engine import AsyncEngine
from dspark.engine.speculative import GenerationRequest, SpeculativeEngine
from dspark.model.model_store import DEFAULT_MODEL
from dspark.model.target_runtime import TargetConfig, TargetRuntime
from dspark.model.tokenizer import Tokenizer
from dspark.observability.tracing import setup_tracing
from dspark.profiling.sps import profile_sps
from dspark.sampling.params import SamplingParams
from dspark.scheduling.policies import parse_policy
from dspark.serving_config import GatewaySection, ObservabilitySection, ServingConfig
from gateway.api_keys import ApiKeys
from gateway.app import create_app
from gateway.connection_limits import uvicorn_config
from gateway.rate_limit import MemoryRateLimiter, RateLimits

__all__ = ["EmbeddedGateway", "build_engine", "embedded_gateway", "serve", "served_model_name", "warm_up"]

log = logging.getLogger(__name__)

DEFAULTS = ServingConfig()  # the serving defaults live in dspark/serving_config.py


def served_model_name(model: str) -> str:
    """The id clients put in `model`: the default model's name, or the checkpoint directory's name."""
    return model if model == DEFAULT_MODEL else Path(model).expanduser().resolve().name


def warm_up(engine: SpeculativeEngine, tokenizer: Tokenizer) -> float:
    """One short greedy generation (a prefill and a decode round, with logprobs) on the caller's
    thread, before the engine thread exists, and the tokenizer's token bytes (built once, for
    logprobs); returns its seconds."""
    t0 = time.perf_counter()
    prompt = tokenizer.encode("Hello, world. Hello, world.") or [0]
    tokenizer.token_bytes(prompt)
    # Without the policy: the warm-up precedes the SPS(B) profile that `dspark` policies need
    # (profiling a cold engine would measure first-call overheads). All γ drafts are verified.
    policy, engine.policy = engine.policy, None
    try:
        engine.generate([GenerationRequest("warmup", prompt, 4, SamplingParams(temperature=0.0), logprobs=1)])
    finally:
        engine.policy = policy
    return time.perf_counter() - t0


def build_engine(
    target: TargetConfig, *, drafter: str = DEFAULTS.drafter.name, gamma: int = DEFAULTS.scheduler.gamma,
    sps_max_batch: int = DEFAULTS.verifier.sps_max_batch,
    drafter_path: str | None = None,
    policy: str | None = None,
    drafter_top_k: int = DEFAULTS.drafter.top_k,
    sampler_backend: str = DEFAULTS.verifier.sampler_backend,
) -> tuple[AsyncEngine, Tokenizer]:
    """Load, warm up, profile SPS(B) and start: an AsyncEngine ready for requests, and the
    target's tokenizer. `sps_max_batch=0` skips the profile (a few seconds on this CPU)."""
    runtime = TargetRuntime.load(target)
    tokenizer = Tokenizer(runtime.model_dir)
    policy_obj = parse_policy(policy) if policy else None
    if policy_obj is not None and policy_obj.needs_sps_profile and sps_max_batch <= 0:
        raise ValueError(f"policy {policy!r} needs the SPS(B) profile: set sps_max_batch > 0")
    engine = SpeculativeEngine(runtime, make_drafter(drafter, runtime=runtime, path=drafter_path, top_k=drafter_top_k),
                               num_speculative_tokens=gamma, policy=policy_obj, sampler_backend=sampler_backend)
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


@dataclass
class EmbeddedGateway:
    """The gateway app, its in-memory bus and the worker thread that runs requests on the engine."""

    app: FastAPI
    bus: MemoryBus
    worker: WorkerThread
    engine: AsyncEngine

    def close(self) -> None:
        """Stop the worker (the engine is the caller's to shut down)."""
        self.worker.stop()


def embedded_gateway(
    engine: AsyncEngine, tokenizer: Tokenizer, *, model_name: str, bus: MemoryBus | None = None,
    api_keys: ApiKeys | Iterable[str] = (), **app_kwargs,
) -> EmbeddedGateway:
    """Wire the gateway to a started AsyncEngine through an in-memory bus (one process)."""
    bus = bus or MemoryBus()
    # The only worker: the engine's own FIFO admission (by KV) decides what runs, so take everything.
    worker = start_worker_thread(lambda: bus, engine, consumer="embedded", max_in_flight=100_000)

    async def health() -> tuple[bool, dict]:
        ok = engine.is_running and worker.is_alive
        return ok, {"num_running": engine.num_running, "num_waiting": engine.num_waiting, "queue_depth": await bus.queue_depth()}

    runtime = engine.runtime
    app = create_app(bus, tokenizer, model_name=model_name, max_model_len=engine.max_model_len,
                     vocab_size=runtime.vocab_size if runtime is not None else None, api_keys=api_keys, health=health,
                     **app_kwargs)
    return EmbeddedGateway(app=app, bus=bus, worker=worker, engine=engine)


def serve(
    host: str = DEFAULTS.gateway.host,
    port: int = DEFAULTS.gateway.port,
    model: str = DEFAULT_MODEL,
    drafter: str = DEFAULTS.drafter.name,
    gamma: int = DEFAULTS.scheduler.gamma,
    *,
    target: TargetConfig | None = None,  # overrides `model` (dtype, KV budget, context length)
    max_tokens_limit: int = DEFAULTS.gateway.max_tokens_limit,
    model_name: str | None = None,  # the id clients send; default: see served_model_name
    log_level: str = "info",
    sps_max_batch: int = DEFAULTS.verifier.sps_max_batch,  # SPS(B) profile at start-up up to this batch; 0 skips it
    drafter_path: str | None = None,  # checkpoint directory of a trained drafter (dspark)
    drafter_top_k: int = DEFAULTS.drafter.top_k,  # truncate the drafter's rows to its top k; 0 = full rows
    policy: str | None = None,  # parse_policy form; None = all γ drafts every round
    sampler_backend: str = DEFAULTS.verifier.sampler_backend,
    api_keys: Iterable[str] | None = None,  # None: gateway.api_keys of `limits`
    # connection and request limits, API keys; tracing. `dspark serve` passes its resolved
    # configuration's (dspark/command_config.py); this function reads no file or variable itself.
    limits: GatewaySection = DEFAULTS.gateway,
    observability: ObservabilitySection = DEFAULTS.observability,
) -> None:
    if drafter not in drafter_names():  # fail on a bad name before loading anything
        raise ValueError(f"unknown drafter {drafter!r}; expected one of {drafter_names()}")
    target = target or TargetConfig(model=model)
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    setup_tracing(observability, service="serve")  # off unless an OTLP endpoint is configured
    engine, tokenizer = build_engine(target, drafter=drafter, gamma=gamma, sps_max_batch=sps_max_batch,
                                     drafter_path=drafter_path, policy=policy, drafter_top_k=drafter_top_k,
                                     sampler_backend=sampler_backend)
    name = model_name or served_model_name(target.model)
    keys = ApiKeys.from_entries(limits.api_keys if api_keys is None else api_keys)
    rate_limits = RateLimits(requests_per_minute=limits.requests_per_minute, burst=limits.burst,
                             max_concurrent=limits.max_concurrent_requests)
    gateway = embedded_gateway(engine, tokenizer, model_name=name, api_keys=keys, max_tokens_limit=max_tokens_limit,
                               rate_limiter=MemoryRateLimiter(rate_limits), max_body_bytes=limits.max_body_bytes,
                               max_prompt_tokens=limits.max_prompt_tokens or None)
    log.info("serving %s on http://%s:%d/v1 (drafter %s, gamma %d%s; %s); the round view on http://%s:%d/ui", name, host,
             port, drafter, gamma, f", {len(keys.ids)} API keys required" if keys else "", rate_limits.describe(), host, port)
    try:
        uvicorn.Server(uvicorn_config(gateway.app, limits=limits, host=host, port=port, log_level=log_level)).run()
    finally:
        gateway.close()
        engine.shutdown()
