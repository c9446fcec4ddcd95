"""`dspark gateway`: the OpenAI-compatible gateway alone, over Redis (the distributed mode).

    dspark gateway --redis redis://127.0.0.1:6379/0 --model smollm2-135m-instruct --port 8000
    DSPARK_GATEWAY_API_KEYS=sha256:...,sha256:... dspark gateway --redis redis://redis:6379/0   # keys required
    dspark gateway --requests-per-minute 600 --max-concurrent-requests 8   # per key, shared in Redis
    echo -n "$KEY" | dspark hash-key                                        # the hash to configure

A gateway replica is stateless: it loads only the tokenizer and the model's config (context
window, vocabulary size), never the weights, and talks to the schedulers through the Redis bus
(dspark/bus/redis_bus.py); the schedulers run `dspark.bus.worker.run_worker` on their engines.
Any number of replicas can serve the same bus prefix behind a load balancer; a streamed response
can be resumed on any of them (SSE Last-Event-ID).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
from collections.abc import Iterable

from fastapi import FastAPI

from gateway.api_keys import ApiKeys, cmd_hash_key
from gateway.rate_limit import RateLimits, RedisRateLimiter

__all__ = ["add_gateway_parser", "build_gateway_app", "cmd_gateway"]

log = logging.getLogger(__name__)

REDIS_URL_ENV = "DSPARK_REDIS_URL"
DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"


def build_gateway_app(
    *,
    redis_url: str,
    model: str,
    model_name: str | None = None,  # the id clients send; default: the model's name
    max_model_len: int | None = None,  # default: the model config's max_position_embeddings
    prefix: str = "dspark",
    max_queue: int = 10_000,
    api_keys: ApiKeys | Iterable[str] = (),
    rate_limits: RateLimits | None = None,  # per client, kept in the same Redis (shared by every replica)
    **app_kwargs,
) -> FastAPI:
    """The gateway app over a RedisBus; the bus's (and the limiter's) connections are closed when
    the app shuts down."""
    from dspark.bus.redis_bus import RedisBus
    from dspark.model.config import ModelConfig
    from dspark.model.model_store import resolve_model_dir
    from dspark.model.tokenizer import Tokenizer
    from gateway.app import create_app
    from gateway.server import served_model_name

    model_dir = resolve_model_dir(model)
    config = ModelConfig.from_dir(model_dir)
    context = config.max_position_embeddings
    if max_model_len is not None:
        if max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {max_model_len}")
        context = min(context, max_model_len)
    bus = RedisBus.from_url(redis_url, prefix=prefix, max_queue=max_queue)
    limiter = None
    if rate_limits is not None and rate_limits.enabled:
        limiter = RedisRateLimiter.from_url(redis_url, prefix=prefix, limits=rate_limits)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        try:
            yield
        finally:
            await bus.close()
            if limiter is not None:
                await limiter.close()

    return create_app(bus, Tokenizer(model_dir), model_name=model_name or served_model_name(model), max_model_len=context,
                      vocab_size=config.vocab_size, api_keys=api_keys, rate_limiter=limiter, lifespan=lifespan, **app_kwargs)


def cmd_gateway(args: argparse.Namespace) -> int:
    import uvicorn

    from dspark.observability.tracing import setup_tracing
    from dspark.serving_config import ServingConfig
    from gateway.connection_limits import uvicorn_config

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args = with_config_defaults(args)
    try:
        # connection and request limits, API keys: the config file and DSPARK_GATEWAY_* variables; flags override
        limits = ServingConfig.load(args.config).gateway
        setup_tracing(ServingConfig.load(args.config).observability, service="gateway")  # OTLP if configured
        keys = ApiKeys.from_entries(args.api_key) if args.api_key else ApiKeys.from_config(limits.api_keys)
        rate_limits = RateLimits(requests_per_minute=_given(args.requests_per_minute, limits.requests_per_minute),
                                 burst=_given(args.burst, limits.burst),
                                 max_concurrent=_given(args.max_concurrent_requests, limits.max_concurrent_requests))
        app = build_gateway_app(
            redis_url=args.redis, model=args.model, model_name=args.served_model_name, max_model_len=args.max_model_len,
            prefix=args.bus_prefix, max_queue=args.max_queue, api_keys=keys, rate_limits=rate_limits,
            max_tokens_limit=_given(args.max_tokens_limit, limits.max_tokens_limit),
            max_body_bytes=_given(args.max_body_bytes, limits.max_body_bytes),
            max_prompt_tokens=_given(args.max_prompt_tokens, limits.max_prompt_tokens) or None,
            accept_timeout_s=args.accept_timeout,
        )
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", flush=True)
        return 2
    log.info("gateway for %s on http://%s:%d/v1 over %s (prefix %r%s; %s)", args.model, args.host, args.port, args.redis,
             args.bus_prefix, f", {len(keys.ids)} API keys required" if keys else "", rate_limits.describe())
    uvicorn.Server(uvicorn_config(app, limits=limits, host=args.host, port=args.port, log_level=args.log_level)).run()
    return 0


def _given(flag, configured):
    """A flag's value if it was given, else the configuration's."""
    return configured if flag is None else flag


def with_config_defaults(args: argparse.Namespace) -> argparse.Namespace:
    """`args` with --model, --host and --port, where not given, set to their serving-config defaults
    (dspark/serving_config.py: the one source of them; the limits fall back to the loaded config)."""
    from dspark.serving_config import ServingConfig

    defaults = ServingConfig()
    return argparse.Namespace(**{**vars(args), "model": _given(args.model, defaults.model.name),
                                 "host": _given(args.host, defaults.gateway.host), "port": _given(args.port, defaults.gateway.port)})


def add_gateway_parser(sub: argparse._SubParsersAction) -> None:
    """Register `dspark gateway` and `dspark hash-key` on the CLI's subparsers."""
    from dspark.serving_config import ServingConfig

    defaults = ServingConfig()
    g = sub.add_parser("gateway", help="the OpenAI-compatible gateway alone, over the Redis bus (distributed mode)")
    g.add_argument("--redis", default=os.environ.get(REDIS_URL_ENV, DEFAULT_REDIS_URL),
                   help=f"Redis URL of the bus (env {REDIS_URL_ENV}; default {DEFAULT_REDIS_URL})")
    g.add_argument("--bus-prefix", default="dspark", help="key prefix of the bus in Redis (one per deployment)")
    g.add_argument("--model", default=None,
                   help="default model name or a local HF directory, tokenizer + config (default: model.name, "
                        f"{defaults.model.name})")
    g.add_argument("--served-model-name", default=None, help="the model id clients send (default: the model's name)")
    g.add_argument("--max-model-len", type=int, default=None, help="context window (default: the model config's)")
    g.add_argument("--host", default=None, help=f"interface to listen on (default: gateway.host, {defaults.gateway.host})")
    g.add_argument("--port", type=int, default=None, help=f"port to listen on (default: gateway.port, {defaults.gateway.port})")
    g.add_argument("--config", default=None, help="serving configuration file, for the gateway section (default: $DSPARK_CONFIG)")
    g.add_argument("--api-key", action="append", default=None,
                   help="accepted API key or its sha256:<hex> hash (repeatable; default: config gateway.api_keys "
                        "= env DSPARK_GATEWAY_API_KEYS, and DSPARK_API_KEYS; none: no auth)")
    g.add_argument("--requests-per-minute", type=int, default=None, help="per API key (per address without keys); 0: no limit "
                                                                         "(config: gateway.requests_per_minute)")
    g.add_argument("--burst", type=int, default=None, help="requests at once before the rate applies (config: gateway.burst)")
    g.add_argument("--max-concurrent-requests", type=int, default=None,
                   help="per API key (per address without keys) in flight; 0: no limit (config: gateway.max_concurrent_requests)")
    g.add_argument("--max-tokens-limit", type=int, default=None,
                   help="largest max_tokens a request may ask for (config: gateway.max_tokens_limit)")
    g.add_argument("--max-prompt-tokens", type=int, default=None,
                   help="longest prompt in tokens (config: gateway.max_prompt_tokens; default: context - 1)")
    g.add_argument("--max-body-bytes", type=int, default=None, help="largest request body (config: gateway.max_body_bytes)")
    g.add_argument("--max-queue", type=int, default=10_000, help="requests waiting or running on the bus before 503")
    g.add_argument("--accept-timeout", type=float, default=None,
                   help="seconds a request may wait for a scheduler to accept it (default: no limit)")
    g.add_argument("--log-level", default="info")
    g.set_defaults(func=cmd_gateway)

    h = sub.add_parser("hash-key", help="print the sha256:<hex> hash of the API key on stdin (for gateway.api_keys)")
    h.set_defaults(func=cmd_hash_key)
