"""`dspark verifier | drafter | scheduler | up` (services/cli.py).

Specification: each command reads the configuration (file, environment) and its flags override
it; the services' build functions load a model by path and serve it (the verifier profiles
SPS(B) at start); `dspark up` refuses port 0; and, end to end in real processes (slow), `dspark
up` starts the three services on the tiny model, reports them ready, refuses a call without the
configured internal token, serves a generation equal to plain decoding over gRPC with it, and
stops every child on Ctrl-C.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

import grpc
import pytest

from dspark.cli import main, resolve_for
from dspark.protos.dspark.v1 import common_pb2, scheduler_pb2, scheduler_pb2_grpc
from dspark.serving_config import ServingConfig
from services.grpc_common import check_health, make_channel

ROOT = Path(__file__).resolve().parents[2]
TOKEN = "a-test-token-for-the-services"


def test_flags_override_the_configuration_for_the_commands_own_service():
    env = {"DSPARK_VERIFIER_PORT": "6100", "DSPARK_SCHEDULER_GAMMA": "5"}
    c = resolve_for("verifier", ["--host", "0.0.0.0", "--sps-max-batch", "0", "--drafter", "dspark", "--drafter-path", "/ckpt"],
                    env=env)
    assert (c.verifier.host, c.verifier.port, c.verifier.sps_max_batch) == ("0.0.0.0", 6100, 0)  # port from the environment
    assert (c.drafter.name, c.drafter.path, c.scheduler.gamma) == ("dspark", "/ckpt", 5)
    c = resolve_for("scheduler", ["--port", "6200", "--verifier-address", "v:1", "--policy", "dspark"], env=env)
    assert (c.scheduler.port, c.verifier.dial, c.scheduler.policy, c.verifier.port) == (6200, "v:1", "dspark", 6100)


def test_up_refuses_port_zero(monkeypatch, capsys):
    monkeypatch.setenv("DSPARK_DRAFTER_PORT", "0")
    assert main(["up"]) == 2
    assert "needs fixed ports" in capsys.readouterr().err


def test_a_bad_configuration_is_an_error_message_not_a_traceback(monkeypatch, capsys):
    monkeypatch.setenv("DSPARK_VERIFIER_PORT", "many")
    assert main(["verifier"]) == 2
    assert "verifier.port must be an integer" in capsys.readouterr().err


def test_the_verifier_refuses_the_triton_sampler_on_a_cpu_runtime_before_loading_the_model(monkeypatch, capsys, tmp_path):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    missing = tmp_path / "no-model-here"  # never read: the refusal comes first
    assert main(["verifier", "--sampler-backend", "triton", "--model", str(missing), "--sps-max-batch", "0"]) == 2
    err = capsys.readouterr().err
    assert "error: sampler_backend 'triton' runs the fused kernel on CUDA tensors" in err and "use 'auto' or 'torch'" in err
    assert str(missing) not in err


def test_up_starts_the_gateway_over_the_bus_only_when_a_redis_url_is_configured(tmp_path):
    from services.cli import _gateway_command

    path = tmp_path / "serving.json"  # what `up` writes for its children
    assert _gateway_command(ServingConfig(), path, "info") is None
    config = ServingConfig().updated({"redis": {"url": "redis://127.0.0.1:6379/3"}, "gateway": {"port": 8100, "model_name": "m"},
                                      "model": {"max_model_len": 256}})
    path.write_text(config.to_json())
    cmd = _gateway_command(config, path, "info")
    assert cmd[:4] == [sys.executable, "-m", "dspark.cli", "gateway"]
    assert resolve_for("gateway", cmd[4:], env={}) == config  # the children get none of our DSPARK_* variables


def test_the_build_functions_load_a_model_by_path_and_the_verifier_profiles_sps(tiny_model_dir, serve):
    from services.drafter.server import build_drafter
    from services.verifier.client import RemoteVerifier
    from services.verifier.server import build_local_verifier

    config = ServingConfig().updated({"model": {"name": str(tiny_model_dir), "dtype": "float32"}, "drafter": {"name": "ngram"},
                                      "verifier": {"sps_max_batch": 6, "sps_tokens_per_request": 3}})
    verifier = build_local_verifier(config)
    assert verifier.sps_profile.batch_sizes == [1, 2, 3, 4, 5, 6]
    assert verifier.vocab_size == 256 and verifier.max_model_len == 512 and verifier.num_requests == 0
    remote = RemoteVerifier(serve.verifier(verifier, model=config.model.name))
    assert remote.sps_profile == verifier.sps_profile and remote.model == str(tiny_model_dir)
    drafter, vocab, hidden = build_drafter(config)
    assert drafter.spec.name == "ngram" and (vocab, hidden) == (256, 64)


def _free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


@pytest.mark.slow
@pytest.mark.processes
def test_up_starts_the_services_serves_plain_greedy_tokens_and_stops_them_on_ctrl_c(tiny_model_dir, tiny_runtime):
    from dspark.engine.speculative import GenerationRequest, SpeculativeEngine
    from dspark.sampling.params import SamplingParams

    scheduler_port, drafter_port, verifier_port, gateway_port = _free_ports(4)
    env = {**os.environ, "DSPARK_SCHEDULER_PORT": str(scheduler_port), "DSPARK_DRAFTER_PORT": str(drafter_port),
           "DSPARK_VERIFIER_PORT": str(verifier_port), "DSPARK_GATEWAY_PORT": str(gateway_port), "DSPARK_REDIS_URL": "",
           "DSPARK_RPC_AUTH_TOKEN": TOKEN}  # the services then require it (services/grpc_auth.py)
    cmd = [sys.executable, "-m", "dspark.cli", "up", "--model", str(tiny_model_dir), "--dtype", "bfloat16", "--drafter", "ngram",
           "--policy", "fixed:4", "--gamma", "4", "--sps-max-batch", "0", "--log-level", "warning"]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True)
    try:
        ready: dict = {}
        reader = threading.Thread(target=lambda: ready.update(json.loads(proc.stdout.readline() or "{}")), daemon=True)
        reader.start()
        reader.join(300)
        assert set(ready.get("ready", {})) == {"verifier", "drafter", "scheduler"}, f"not ready: {ready}, exit {proc.poll()}"
        assert ready["endpoints"]["scheduler"] == f"127.0.0.1:{scheduler_port}"

        prompt = [5, 6, 7, 8] * 4
        (expected,) = SpeculativeEngine(tiny_runtime, None).generate([GenerationRequest("p", prompt, 24, SamplingParams(temperature=0.0))])
        with grpc.insecure_channel(f"127.0.0.1:{scheduler_port}") as channel:
            with pytest.raises(grpc.RpcError) as refused:  # without the token
                scheduler_pb2_grpc.SchedulerStub(channel).Stats(scheduler_pb2.StatsRequest(), timeout=30)
            assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with make_channel(f"127.0.0.1:{scheduler_port}", auth_token=TOKEN) as channel:
            stub = scheduler_pb2_grpc.SchedulerStub(channel)
            tokens = []
            request = scheduler_pb2.GenerationRequest(request_id="up", prompt_ids=prompt, max_new_tokens=24,
                                                      params=common_pb2.SamplingParams(temperature=0.0, top_p=1.0))
            for out in stub.Submit(request, timeout=120):
                tokens += out.new_token_ids
        assert tokens == expected.output_ids

        proc.send_signal(signal.SIGINT)  # Ctrl-C
        assert proc.wait(60) == 0
        for port in (scheduler_port, drafter_port, verifier_port):
            with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
                assert not check_health(channel, timeout=1.0)
        for pid in ready["ready"].values():  # every child has exited
            with pytest.raises(ProcessLookupError):
                os.kill(pid, 0)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
