"""Fixtures for the gateway tests: the real default model behind the app (module-scoped, slow),
and a live uvicorn server on a free localhost port."""

from __future__ import annotations

import socket
import threading
import time
from dataclasses import dataclass

import pytest

from dspark.drafters.ngram import NgramDrafter
from dspark.engine.async_engine import AsyncEngine
from dspark.engine.speculative import SpeculativeEngine
from dspark.model.model_store import DEFAULT_MODEL
from dspark.model.target_runtime import TargetConfig, TargetRuntime
from dspark.model.tokenizer import Tokenizer

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


@pytest.fixture
def anyio_backend():
    return "asyncio"
