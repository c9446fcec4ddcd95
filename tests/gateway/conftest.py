"""Fixtures for the gateway tests: the real default model behind the embedded gateway
(module-scoped, slow), a live uvicorn server on a free localhost port, and for the fast tests a
byte-level tokenizer that fits the tiny random model (vocab 256)."""

from __future__ import annotations

import contextlib
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
    """The default model (bf16) behind the embedded gateway (in-memory bus + worker thread);
    warmed up; shut down after the module."""
    from gateway.server import embedded_gateway, warm_up

    runtime = TargetRuntime.load(TargetConfig(kv_budget_mb=64))  # ~2,900 KV tokens
    tokenizer = Tokenizer(runtime.model_dir)
    spec = SpeculativeEngine(runtime, NgramDrafter(), num_speculative_tokens=5)
    warm_up(spec, tokenizer)
    engine = AsyncEngine(spec).start()
    gateway = embedded_gateway(engine, tokenizer, model_name=DEFAULT_MODEL, max_tokens_limit=MAX_TOKENS_LIMIT)
    yield Served(runtime=runtime, tokenizer=tokenizer, engine=engine, app=gateway.app)
    gateway.close()
    engine.shutdown()


@contextlib.contextmanager
def live_server(app):
    """`app` behind a real uvicorn server in a thread; yields its base URL."""
    import uvicorn

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()


@pytest.fixture(scope="module")
def live_url(served):
    """The same app behind a real uvicorn server (for real disconnects and the openai client)."""
    with live_server(served.app) as url:
        yield url


class ByteTokenizer:
    """A real byte-level tokenizer for the tiny random model (vocab 256): token id = byte, text is
    Latin-1 (every byte one character, so each generated token shows up as text at once); the
    chat template is `role: content` lines ending with `assistant:`."""

    eos_token_ids: frozenset[int] = frozenset()  # generations run to max_tokens: lengths are known
    vocab_size = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("latin-1"))

    def encode_chat(self, messages: list[dict[str, str]]) -> list[int]:
        return self.encode("".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant:")

    def decode(self, token_ids: list[int], *, skip_special_tokens: bool = True) -> str:
        return bytes(token_ids).decode("latin-1")

    def token_bytes(self, token_ids: list[int]) -> list[bytes | None]:
        return [chr(t).encode("utf-8") for t in token_ids]  # each token's one Latin-1 character, as UTF-8
