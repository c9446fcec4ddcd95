"""Fixtures and helpers for the gRPC services: real servers started in this process on free ports.

`serve` starts a verifier, drafter or scheduler server around real components (a LocalVerifier
on the tiny random model, a drafter, an AsyncEngine) on 127.0.0.1:0 and stops it after the test.
`tiny_services` starts all three at once (any fixture scope), in the order of SERVICE_NAMES;
`closing_all`, `calls_to_each_service`, `rpc_error` and `health_reply` are what tests call them with.
`tiny_model_dir` writes the tiny random model as a Hugging Face directory (config.json +
model.safetensors), for code that loads a model by path (the servers' build functions, the CLI).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from dspark.drafters.ngram import NgramDrafter
from dspark.engine.async_engine import AsyncEngine
from dspark.engine.speculative import SpeculativeEngine
from dspark.engine.verifier import LocalVerifier
from dspark.model.config import ModelConfig
from dspark.model.target_runtime import TargetRuntime
from dspark.profiling.sps import SPSProfile
from dspark.protos import DRAFTER_SERVICE, SCHEDULER_SERVICE, VERIFIER_SERVICE
from dspark.protos.dspark.v1 import (
    common_pb2,
    drafter_pb2,
    drafter_pb2_grpc,
    scheduler_pb2,
    scheduler_pb2_grpc,
    verifier_pb2,
    verifier_pb2_grpc,
)
from services.drafter.server import start_drafter_server
from services.grpc_tls import TlsCredentials
from services.scheduler.server import start_scheduler_server
from services.verifier.server import start_verifier_server
from tests.conftest import make_tiny_runtime, random_hf_state_dict

# A verifier whose step time grows slowly with B: Algorithm 1 admits some drafts, not all.
PROFILE = SPSProfile(batch_sizes=[1, 4, 8, 16, 64], step_seconds=[0.010, 0.011, 0.013, 0.020, 0.080])

SERVICE_NAMES = (VERIFIER_SERVICE, DRAFTER_SERVICE, SCHEDULER_SERVICE)  # the order of tiny_services' addresses


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


@contextmanager
def tiny_services(runtime: TargetRuntime, drafter, *, hidden_size: int = 0, auth_token: str = "",
                  tls: TlsCredentials | None = None, **engine_kwargs) -> Iterator[tuple[str, str, str]]:
    """(verifier, drafter, scheduler) addresses: a verifier on `runtime`, `drafter`, and a scheduler
    over an in-process engine (a fresh tiny model, the n-gram drafter, `engine_kwargs`), each
    requiring `auth_token` and `tls` when given. On exit the servers stop first, then the engine:
    no call is left in flight on an engine that is gone."""
    servers, engine = Servers(), None
    try:
        verifier_address = servers.verifier(LocalVerifier(runtime), auth_token=auth_token, tls=tls)
        drafter_address = servers.drafter(drafter, vocab_size=runtime.config.vocab_size, hidden_size=hidden_size,
                                          auth_token=auth_token, tls=tls)
        engine = AsyncEngine(SpeculativeEngine(make_tiny_runtime(), NgramDrafter(), **engine_kwargs)).start()
        yield verifier_address, drafter_address, servers.scheduler(engine, auth_token=auth_token, tls=tls)
    finally:
        servers.stop_all()
        if engine is not None:
            engine.shutdown()


@contextmanager
def closing_all(channels: list[grpc.Channel]) -> Iterator[list[grpc.Channel]]:
    """`channels`, each closed on exit."""
    try:
        yield channels
    finally:
        for channel in channels:
            channel.close()


def calls_to_each_service(channels: list[grpc.Channel], *, request_id: str,
                          timeout: float = 10) -> dict[str, Callable[[], object]]:
    """Calls on (verifier, drafter, scheduler) `channels` by "Service.Method": unary ones (GetInfo,
    Stats) and server-streaming ones read to their end (Drafter.Draft of an empty round, Scheduler.Submit
    of a greedy 2-token generation named `request_id`)."""
    verifier = verifier_pb2_grpc.VerifierStub(channels[0])
    drafter = drafter_pb2_grpc.DrafterStub(channels[1])
    scheduler = scheduler_pb2_grpc.SchedulerStub(channels[2])
    request = scheduler_pb2.GenerationRequest(request_id=request_id, prompt_ids=[1, 2, 3], max_new_tokens=2,
                                              params=common_pb2.SamplingParams(temperature=0.0, top_p=1.0))
    return {
        "Verifier.GetInfo": lambda: verifier.GetInfo(verifier_pb2.GetVerifierInfoRequest(), timeout=timeout),
        "Drafter.GetInfo": lambda: drafter.GetInfo(drafter_pb2.GetDrafterInfoRequest(), timeout=timeout),
        "Drafter.Draft": lambda: list(drafter.Draft(drafter_pb2.DraftRoundRequest(round_id=1), timeout=timeout)),
        "Scheduler.Stats": lambda: scheduler.Stats(scheduler_pb2.StatsRequest(), timeout=timeout),
        "Scheduler.Submit": lambda: list(scheduler.Submit(request, timeout=30)),
    }


def rpc_error(call: Callable[..., object], *args, **kwargs) -> tuple[grpc.StatusCode, str]:
    """The status code and details that `call(*args, **kwargs)` must fail with (a server stream is
    read to its end)."""
    with pytest.raises(grpc.RpcError) as info:
        result = call(*args, **kwargs)
        if hasattr(result, "__next__"):
            list(result)
    return info.value.code(), info.value.details()


def health_reply(channel: grpc.Channel, service: str = "", *, timeout: float = 10) -> health_pb2.HealthCheckResponse:
    """grpc.health.v1 Check for `service` ("" = the server as a whole); unlike check_health, a failed
    call raises."""
    return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout)


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
