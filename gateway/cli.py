"""`dspark gateway`: the OpenAI-compatible gateway alone, over Redis (the distributed mode).

    dspark gateway --redis redis://127.0.0.1:6379/0 --model smollm2-135m-instruct --port 8000
    DSPARK_GATEWAY_API_KEYS=sha256:...,sha256:... dspark gateway --redis redis://redis:6379/0   # keys required
    dspark gateway --requests-per-minute 600 --max-concurrent-requests 8   # per key, shared in Redis
    echo -n "$KEY" | dspark hash-key                                        # the hash to configure

A gateway replica is stateless: it loads only the tokenizer and the model's config (context
window, vocabulary size), never the weights, and talks to the schedulers through the Redis bus
(dspark/bus/redis_bus.py); the schedulers run `dspark.bus.worker.run_worker` on their engines.
Any number of replicas can serve the same bus prefix behind a load balancer; a streamed response
can be resumed on any of them (SSE Last-Event-ID). Configuration as every command's
(dspark/command_config.py): --config file, DSPARK_<SECTION>_<KEY>, then the flags given; the
Redis URL, the model, the gateway's host, port, keys and limits are all keys of it.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
from collections.abc import Iterable

from fastapi import FastAPI

from dspark.command_config import add_config_arguments, add_config_flag, command_config
from dspark.serving_config import ServingConfig
from gateway.api_keys import ApiKeys, cmd_hash_key
from gateway.rate_limit import RateLimits, RedisRateLimiter

__all__ = ["add_gateway_parser", "build_gateway_app", "cmd_gateway"]

log = logging.getLogger(__name__)

# the gateway needs a bus: without a configured redis.url ("" = in-memory, one process) it dials
# the local Redis (a command default of `dspark gateway`, below the file and the environment)
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
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config = command_config(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", flush=True)
        return 2
    return run_gateway(config, args)


def run_gateway(config: ServingConfig, args: argparse.Namespace) -> int:
    """`dspark gateway` with its resolved configuration; `args` gives only what is no key of it
    (the bus prefix and queue, the accept timeout, the log level)."""
    import uvicorn

    from dspark.observability.tracing import setup_tracing
    from gateway.connection_limits import uvicorn_config

    g = config.gateway
    try:
        setup_tracing(config.observability, service="gateway")  # OTLP if configured
        keys = ApiKeys.from_entries(g.api_keys)
        rate_limits = RateLimits(requests_per_minute=g.requests_per_minute, burst=g.burst,
                                 max_concurrent=g.max_concurrent_requests)
        app = build_gateway_app(
            redis_url=config.redis.url, model=config.model.name, model_name=g.model_name or None,
            max_model_len=config.model.max_model_len or None, prefix=args.bus_prefix, max_queue=args.max_queue, api_keys=keys,
            rate_limits=rate_limits, max_tokens_limit=g.max_tokens_limit, max_body_bytes=g.max_body_bytes,
            max_prompt_tokens=g.max_prompt_tokens or None, accept_timeout_s=args.accept_timeout,
        )
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", flush=True)
        return 2
    log.info("gateway for %s on http://%s:%d/v1 over %s (prefix %r%s; %s)", config.model.name, g.host, g.port, config.redis.url,
             args.bus_prefix, f", {len(keys.ids)} API keys required" if keys else "", rate_limits.describe())
    uvicorn.Server(uvicorn_config(app, limits=g, host=g.host, port=g.port, log_level=args.log_level)).run()
    return 0


def add_gateway_parser(sub: argparse._SubParsersAction) -> None:
    """Register `dspark gateway` and `dspark hash-key` on the CLI's subparsers."""
    g = sub.add_parser("gateway", help="the OpenAI-compatible gateway alone, over the Redis bus (distributed mode)")
    add_config_arguments(g, command_defaults={"redis": {"url": DEFAULT_REDIS_URL}})
    add_config_flag(g, "--redis", key="redis.url", help="Redis URL of the bus")
    g.add_argument("--bus-prefix", default="dspark", help="key prefix of the bus in Redis (one per deployment)")
    add_config_flag(g, "--model", key="model.name", help="default model name or a local HF directory, tokenizer + config")
    add_config_flag(g, "--served-model-name", key="gateway.model_name", help="the model id clients send; '' = the model's name")
    add_config_flag(g, "--max-model-len", key="model.max_model_len", type=int, help="context window; 0 = the model config's")
    add_config_flag(g, "--host", key="gateway.host", help="interface to listen on")
    add_config_flag(g, "--port", key="gateway.port", type=int, help="port to listen on")
    add_config_flag(g, "--api-key", key="gateway.api_keys", action="append",
                    help="accepted API key or its sha256:<hex> hash, repeatable, instead of the configured ones "
                         "(DSPARK_GATEWAY_API_KEYS and DSPARK_API_KEYS); none: no auth")
    add_config_flag(g, "--requests-per-minute", key="gateway.requests_per_minute", type=int,
                    help="per API key (per address without keys); 0: no limit")
    add_config_flag(g, "--burst", key="gateway.burst", type=int, help="requests at once before the rate applies")
    add_config_flag(g, "--max-concurrent-requests", key="gateway.max_concurrent_requests", type=int,
                    help="per API key (per address without keys) in flight; 0: no limit")
    add_config_flag(g, "--max-tokens-limit", key="gateway.max_tokens_limit", type=int,
                    help="largest max_tokens a request may ask for")
    add_config_flag(g, "--max-prompt-tokens", key="gateway.max_prompt_tokens", type=int,
                    help="longest prompt in tokens; 0: context - 1")
    add_config_flag(g, "--max-body-bytes", key="gateway.max_body_bytes", type=int, help="largest request body")
    g.add_argument("--max-queue", type=int, default=10_000, help="requests waiting or running on the bus before 503")
    g.add_argument("--accept-timeout", type=float, default=None,
                   help="seconds a request may wait for a scheduler to accept it (default: no limit)")
    g.add_argument("--log-level", default="info")
    g.set_defaults(func=cmd_gateway)

    h = sub.add_parser("hash-key", help="print the sha256:<hex> hash of the API key on stdin (for gateway.api_keys)")
    h.set_defaults(func=cmd_hash_key)
