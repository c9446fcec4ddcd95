"""`dspark gateway`: the OpenAI-compatible gateway alone, over Redis (the distributed mode).

    dspark gateway --redis redis://127.0.0.1:6379/0 --model smollm2-135m-instruct --port 8000
    DSPARK_API_KEYS=k1,k2 dspark gateway --redis redis://redis:6379/0     # keys required

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
    api_keys: Iterable[str] = (),
    **app_kwargs,
) -> FastAPI:
    """The gateway app over a RedisBus; the bus's connections are closed when the app shuts down."""
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

    @contextlib.asynccontextmanager
    async def lifespan(app):
        try:
            yield
        finally:
            await bus.close()

    return create_app(bus, Tokenizer(model_dir), model_name=model_name or served_model_name(model), max_model_len=context,
                      vocab_size=config.vocab_size, api_keys=api_keys, lifespan=lifespan, **app_kwargs)


def cmd_gateway(args: argparse.Namespace) -> int:
    import uvicorn

    from gateway.server import api_keys_from_env

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    keys = tuple(args.api_key or ()) or api_keys_from_env()
    try:
        app = build_gateway_app(
            redis_url=args.redis, model=args.model, model_name=args.served_model_name, max_model_len=args.max_model_len,
            prefix=args.bus_prefix, max_queue=args.max_queue, api_keys=keys,
            max_tokens_limit=args.max_tokens_limit, max_body_bytes=args.max_body_bytes,
            max_prompt_tokens=args.max_prompt_tokens, accept_timeout_s=args.accept_timeout,
        )
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", flush=True)
        return 2
    log.info("gateway for %s on http://%s:%d/v1 over %s (prefix %r%s)", args.model, args.host, args.port, args.redis,
             args.bus_prefix, ", API keys required" if keys else "")
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    return 0


def add_gateway_parser(sub: argparse._SubParsersAction) -> None:
    """Register `dspark gateway` on the CLI's subparsers."""
    g = sub.add_parser("gateway", help="the OpenAI-compatible gateway alone, over the Redis bus (distributed mode)")
    g.add_argument("--redis", default=os.environ.get(REDIS_URL_ENV, DEFAULT_REDIS_URL),
                   help=f"Redis URL of the bus (env {REDIS_URL_ENV}; default {DEFAULT_REDIS_URL})")
    g.add_argument("--bus-prefix", default="dspark", help="key prefix of the bus in Redis (one per deployment)")
    g.add_argument("--model", default="smollm2-135m-instruct", help="default model name or a local HF directory (tokenizer + config)")
    g.add_argument("--served-model-name", default=None, help="the model id clients send (default: the model's name)")
    g.add_argument("--max-model-len", type=int, default=None, help="context window (default: the model config's)")
    g.add_argument("--host", default="127.0.0.1")
    g.add_argument("--port", type=int, default=8000)
    g.add_argument("--api-key", action="append", default=None,
                   help="accepted API key (repeatable; default: env DSPARK_API_KEYS, comma-separated; none: no auth)")
    g.add_argument("--max-tokens-limit", type=int, default=2048, help="largest max_tokens a request may ask for")
    g.add_argument("--max-prompt-tokens", type=int, default=None, help="longest prompt in tokens (default: context - 1)")
    g.add_argument("--max-body-bytes", type=int, default=1 << 20, help="largest request body")
    g.add_argument("--max-queue", type=int, default=10_000, help="requests waiting or running on the bus before 503")
    g.add_argument("--accept-timeout", type=float, default=None,
                   help="seconds a request may wait for a scheduler to accept it (default: no limit)")
    g.add_argument("--log-level", default="info")
    g.set_defaults(func=cmd_gateway)
