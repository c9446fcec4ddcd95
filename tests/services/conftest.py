"""Fixtures for the gRPC services: real servers started in this process on free ports.

`serve` starts a verifier, drafter or scheduler server around real components (a LocalVerifier
on the tiny random model, a drafter, an AsyncEngine) on 127.0.0.1:0 and stops it after the test.
`tiny_model_dir` writes the tiny random model as a Hugging Face directory (config.json +
model.safetensors), for code that loads a model by path (the servers' build functions, the CLI).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dspark.engine.async_engine import AsyncEngine
from dspark.engine.verifier import LocalVerifier
from dspark.model.config import ModelConfig
from dspark.profiling.sps import SPSProfile
from services.drafter.server import start_drafter_server
from services.scheduler.server import start_scheduler_server
from services.verifier.server import start_verifier_server
from tests.conftest import random_hf_state_dict

# A verifier whose step time grows slowly with B: Algorithm 1 admits some drafts, not all.
PROFILE = SPSProfile(batch_sizes=[1, 4, 8, 16, 64], step_seconds=[0.010, 0.011, 0.013, 0.020, 0.080])


class Servers:
    """Starts servers and remembers them; `stop_all` runs at teardown."""

    def __init__(self):
        self._running = []

    def verifier(self, verifier: LocalVerifier, **kwargs) -> str:
        server = start_verifier_server(verifier, **kwargs)
        self._running.append(server)
        return f"127.0.0.1:{server.port}"

    def drafter(self, drafter, *, vocab_size: int, hidden_size: int = 0, **kwargs) -> str:
        server = start_drafter_server(drafter, vocab_size=vocab_size, hidden_size=hidden_size, **kwargs)
        self._running.append(server)
        return f"127.0.0.1:{server.port}"

    def scheduler(self, engine: AsyncEngine, **kwargs) -> str:
        server = start_scheduler_server(engine, **kwargs)
        self._running.append(server)
        return f"127.0.0.1:{server.port}"

    def stop_all(self) -> None:
        for server in reversed(self._running):
            server.stop(None)
        self._running.clear()


@pytest.fixture
def serve():
    servers = Servers()
    yield servers
    servers.stop_all()


def write_tiny_model_dir(directory: Path, *, seed: int = 0, **config_overrides) -> Path:
    """The tiny random model (tests/conftest.py) as a HF Llama directory loadable by path."""
    from safetensors.torch import save_file

    c = ModelConfig.tiny(**config_overrides)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps({
        "model_type": c.model_type, "vocab_size": c.vocab_size, "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size, "num_hidden_layers": c.num_layers, "num_attention_heads": c.num_heads,
        "num_key_value_heads": c.num_kv_heads, "head_dim": c.head_dim, "rms_norm_eps": c.rms_norm_eps, "rope_theta": c.rope_theta,
        "max_position_embeddings": c.max_position_embeddings, "tie_word_embeddings": c.tie_word_embeddings,
    }))
    save_file({k: v.contiguous() for k, v in random_hf_state_dict(c, seed=seed).items()}, str(directory / "model.safetensors"))
    return directory


@pytest.fixture
def tiny_model_dir(tmp_path) -> Path:
    return write_tiny_model_dir(tmp_path / "tiny-model")
