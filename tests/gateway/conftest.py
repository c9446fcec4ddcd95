"""Fixtures for the gateway tests: the real default model behind the app (module-scoped, slow),
a live uvicorn server on a free localhost port, and tiny random engines for the fast tests.

This directory deliberately has no __init__.py: without a tests/__init__.py, pytest would import
it as a top-level package named `gateway` and shadow the real `gateway` package."""

from __future__ import annotations

import socket
import threading
import time
from dataclasses import dataclass

import pytest
import torch

from dspark.drafters.ngram import NgramDrafter
from dspark.engine.async_engine import AsyncEngine
from dspark.engine.speculative import SpeculativeEngine
from dspark.model.config import ModelConfig
from dspark.model.model_store import DEFAULT_MODEL
from dspark.model.target_runtime import TargetConfig, TargetRuntime
from dspark.model.tokenizer import Tokenizer
from dspark.model.transformer import Transformer

MAX_TOKENS_LIMIT = 1024  # the cancellation test asks for this many: it cannot finish by itself in time


@dataclass
class Served:
    runtime: TargetRuntime
    tokenizer: Tokenizer
    engine: AsyncEngine  # ngram drafter, gamma 5
    app: object  # FastAPI
    model_name: str = DEFAULT_MODEL
    max_tokens_limit: int = MAX_TOKENS_LIMIT


@pytest.fixture(scope="module")
def served():
    """The default model (bf16) behind create_app; warmed up; shut down after the module."""
    from gateway.app import create_app
    from gateway.server import warm_up

    runtime = TargetRuntime.load(TargetConfig(kv_budget_mb=64))  # ~2,900 KV tokens
    tokenizer = Tokenizer(runtime.model_dir)
    spec = SpeculativeEngine(runtime, NgramDrafter(), num_speculative_tokens=5)
    warm_up(spec, tokenizer)
    engine = AsyncEngine(spec).start()
    app = create_app(engine, tokenizer, model_name=DEFAULT_MODEL, max_tokens_limit=MAX_TOKENS_LIMIT)
    yield Served(runtime=runtime, tokenizer=tokenizer, engine=engine, app=app)
    engine.shutdown()


@pytest.fixture(scope="module")
def live_url(served):
    """The same app behind a real uvicorn server in a thread (for real disconnects and the openai client)."""
    import uvicorn

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(served.app, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.02)
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(10)
    sock.close()


def tiny_runtime(*, kv_budget_tokens: int = 4096, seed: int = 0) -> TargetRuntime:
    """A random 4-layer model (vocab 256): milliseconds per forward."""
    torch.manual_seed(seed)
    model = Transformer(ModelConfig.tiny(), compute_dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.2)
    model.eval().requires_grad_(False)
    model.prepare_for_inference()
    return TargetRuntime(model, kv_budget_tokens=kv_budget_tokens)


@pytest.fixture
def tiny_engine():
    """Factory: a started AsyncEngine over a tiny random model; all are shut down afterwards."""
    made: list[AsyncEngine] = []

    def make(*, kv_budget_tokens: int = 4096, drafter=None) -> AsyncEngine:
        engine = AsyncEngine(SpeculativeEngine(tiny_runtime(kv_budget_tokens=kv_budget_tokens), drafter), idle_poll_s=0.01)
        made.append(engine.start())
        return engine

    yield make
    for e in made:
        e.shutdown()


@pytest.fixture
def anyio_backend():
    return "asyncio"
