"""`dspark verifier | drafter | scheduler | up`: the gRPC services, one per process.

    dspark verifier --config serving.toml        # target model + KV caches + rejection sampler
    dspark drafter --drafter dspark --drafter-path runs/dspark/final
    dspark scheduler --policy dspark             # dials the verifier and drafter addresses
    dspark up --drafter ngram                    # all of them on this machine, one process each
    dspark up --redis redis://127.0.0.1:6379/0   # ... plus the bus worker and the HTTP gateway

Configuration (dspark/command_config.py, as for every command): defaults <- `--config FILE` (or
$DSPARK_CONFIG) <- DSPARK_<SECTION>_<KEY> environment variables <- the flags below (only those given).

`dspark up` writes the resolved configuration (with a random rpc.auth_token for the internal
calls unless one is configured) to a temporary file only it can read, starts the verifier and the
drafter (in parallel: both load the model), waits until each reports SERVING on grpc.health.v1,
then starts the scheduler and, when a Redis URL is configured, the gateway over the bus
(`dspark gateway`, gateway/cli.py). Once all are ready it supervises them (services/supervisor.py):
a service that exits or is killed is started again, with backoff, and `up` prints one JSON line
per restart ({"restarted": name, "pid": ..., "restarts": n, "exit_status": s}); the others ride
it out (dspark/engine/faults.py). It stops them all, in reverse order, on Ctrl-C or SIGTERM.
Each child runs in its own session, so that Ctrl-C reaches `up` only and the shutdown order is ours.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import fields
from pathlib import Path

from dspark.command_config import add_config_arguments, add_config_flag, command_config
from dspark.serving_config import SAMPLER_BACKENDS, WEIGHT_CHOICES, WEIGHTS_HELP, ServingConfig
from services.healthcheck import add_healthcheck_arguments
from services.supervisor import Child, Supervisor

__all__ = ["add_service_parsers", "cmd_drafter", "cmd_scheduler", "cmd_up", "cmd_verifier", "run_up"]

log = logging.getLogger("dspark.up")


# ---- flags -------------------------------------------------------------------------------------


def _add_common(p: argparse.ArgumentParser, section: str | None) -> None:
    """--config, the flags of `section`'s own endpoint (None: none), --log-level."""
    add_config_arguments(p)
    if section is not None:
        add_config_flag(p, "--host", key=f"{section}.host", help="interface to listen on")
        add_config_flag(p, "--port", key=f"{section}.port", type=int, help="port to listen on")
    p.add_argument("--log-level", default="info")


def _add_model(p: argparse.ArgumentParser) -> None:
    add_config_flag(p, "--model", key="model.name", help="default model name or a local HF Llama/Qwen directory")
    add_config_flag(p, "--dtype", key="model.dtype", choices=["auto", "bfloat16", "float32"],
                    help="compute dtype of the linear layers (auto: bf16 where the hardware has it)")
    add_config_flag(p, "--weights", key="model.weights", choices=WEIGHT_CHOICES, help=WEIGHTS_HELP)


def _add_drafter(p: argparse.ArgumentParser) -> None:
    add_config_flag(p, "--drafter", key="drafter.name", help="drafter to host: none | ngram | dspark | ...")
    add_config_flag(p, "--drafter-path", key="drafter.path", help="checkpoint directory of a trained drafter")


def _run(args: argparse.Namespace, section: str | None, serve) -> int:
    """Serve until stopped: exit 0; 2 for a bad configuration; 1 when a service it needs is unreachable."""
    from dspark.observability.tracing import setup_tracing
    from services.grpc_common import ServiceError

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config = command_config(args)
        setup_tracing(config.observability, service=section or "up")  # OTLP if configured (dspark/observability)
        serve(config)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 2
    except ServiceError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 1
    return 0


# ---- one service per process --------------------------------------------------------------------


def cmd_verifier(args: argparse.Namespace) -> int:
    from services.verifier.server import serve_verifier

    return _run(args, "verifier", serve_verifier)


def cmd_drafter(args: argparse.Namespace) -> int:
    from services.drafter.server import serve_drafter

    return _run(args, "drafter", serve_drafter)


def cmd_scheduler(args: argparse.Namespace) -> int:
    from services.scheduler.server import serve_scheduler

    return _run(args, "scheduler", serve_scheduler)


# ---- dspark up ----------------------------------------------------------------------------------


def _child_env(config_sections: list[str]) -> dict[str, str]:
    """Our environment minus the DSPARK_<SECTION>_<KEY> variables (already resolved into the
    file the children read: left in place, they would override the flags given to `up`)."""
    prefixes = tuple(f"DSPARK_{s.upper()}_" for s in config_sections)
    return {k: v for k, v in os.environ.items() if not k.startswith(prefixes)}


def _with_internal_token(config):
    """`config`, with a fresh random rpc.auth_token when none is configured: the children
    authenticate their calls to each other (services/grpc_auth.py) with it. A client of the
    scheduler's gRPC API needs a token of its own: configure one (DSPARK_RPC_AUTH_TOKEN)."""
    if config.rpc.auth_token:
        return config
    from services.grpc_auth import generate_token

    return config.updated({"rpc": {"auth_token": generate_token()}})


def _gateway_command(config, config_path: Path, log_level: str) -> list[str] | None:
    """How `up` starts the HTTP gateway: over the Redis bus (gateway/cli.py), if a Redis URL is
    configured; None otherwise (then clients use the scheduler's gRPC API, or `dspark serve`).
    Like the services, the gateway reads all of `config` from `config_path`, the file they share."""
    if not config.redis.url:
        return None
    return [sys.executable, "-m", "dspark.cli", "gateway", "--config", str(config_path), "--log-level", log_level]


def _wait_http(host: str, port: int, *, timeout: float, alive) -> None:
    """Until http://host:port/health answers at all (any status): the gateway is listening."""
    import urllib.error
    import urllib.request

    host = "127.0.0.1" if host in ("0.0.0.0", "") else host
    deadline = time.monotonic() + timeout
    while True:
        try:
            urllib.request.urlopen(f"http://{host}:{port}/health", timeout=2.0).close()
            return
        except urllib.error.HTTPError:
            return
        except OSError:
            pass
        if not alive():
            raise RuntimeError(f"the gateway exited before listening on {host}:{port}")
        if time.monotonic() >= deadline:
            raise TimeoutError(f"the gateway is not listening on {host}:{port} after {timeout} s")
        time.sleep(0.3)


def _stop(children: list[tuple[str, subprocess.Popen]], timeout: float = 15.0) -> None:
    for name, proc in reversed(children):
        if proc.poll() is None:
            log.info("stopping %s (pid %d)", name, proc.pid)
            proc.send_signal(signal.SIGTERM)
    for name, proc in reversed(children):
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            log.warning("%s (pid %d) did not stop within %.0f s: killing it", name, proc.pid, timeout)
            proc.kill()
            proc.wait()


def _report_restart(child: Child, exit_status: int) -> None:
    print(json.dumps({"restarted": child.name, "pid": child.process.pid, "restarts": child.restarts, "exit_status": exit_status}),
          flush=True)


def _raise_keyboard_interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def cmd_up(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config = command_config(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 2
    return run_up(config, log_level=args.log_level)


def run_up(config: ServingConfig, *, log_level: str) -> int:
    """`dspark up` with its resolved configuration (module docstring); the children read it from
    a file, with none of our DSPARK_<SECTION>_<KEY> variables."""
    from dspark.protos import DRAFTER_SERVICE, SCHEDULER_SERVICE, VERIFIER_SERVICE
    from services.grpc_common import wait_until_serving
    from services.grpc_tls import load_tls

    try:
        config = _with_internal_token(config)
        zero = [s for s in ("verifier", "drafter", "scheduler", "gateway") if getattr(config, s).port == 0]
        if zero:
            raise ValueError(f"`dspark up` needs fixed ports (the services dial each other), got port 0 for {zero}")
        tls = load_tls(config.rpc)  # the children's mutual TLS (rpc.tls_*): `up` checks health with it
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 2
    # Ctrl-C and SIGTERM both stop everything, whatever this process inherited: a shell starting
    # it in the background (nohup, CI runners) leaves SIGINT ignored, and Python keeps it ignored.
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, _raise_keyboard_interrupt)
    with tempfile.TemporaryDirectory(prefix="dspark-up-") as tmp:
        path = Path(tmp) / "serving.json"
        path.touch(mode=0o600)  # it holds the internal token (and the API keys' hashes)
        path.write_text(config.to_json())
        env = _child_env([f.name for f in fields(ServingConfig)])
        supervisor = Supervisor(lambda cmd: subprocess.Popen(cmd, env=env, start_new_session=True), on_restart=_report_restart)
        start = supervisor.start

        def service(name: str) -> list[str]:
            return [sys.executable, "-m", "dspark.cli", name, "--config", str(path), "--log-level", log_level]

        timeout = config.rpc.startup_timeout_s
        try:
            verifier = start("verifier", service("verifier"))
            drafter = start("drafter", service("drafter"))
            wait_until_serving(config.verifier.dial, VERIFIER_SERVICE, timeout=timeout, alive=lambda: verifier.poll() is None,
                               tls=tls)
            wait_until_serving(config.drafter.dial, DRAFTER_SERVICE, timeout=timeout, alive=lambda: drafter.poll() is None,
                               tls=tls)
            scheduler = start("scheduler", service("scheduler"))
            wait_until_serving(config.scheduler.dial, SCHEDULER_SERVICE, timeout=timeout, alive=lambda: scheduler.poll() is None,
                               tls=tls)
            gateway_cmd = _gateway_command(config, path, log_level)
            if gateway_cmd is not None:
                gateway = start("gateway", gateway_cmd)
                _wait_http(config.gateway.host, config.gateway.port, timeout=timeout, alive=lambda: gateway.poll() is None)
            ready = {name: proc.pid for name, proc in supervisor.processes()}
            endpoints = {"verifier": config.verifier.dial, "drafter": config.drafter.dial, "scheduler": config.scheduler.dial}
            if gateway_cmd is not None:
                endpoints["gateway"] = f"http://{config.gateway.host}:{config.gateway.port}/v1"
            print(json.dumps({"ready": ready, "endpoints": endpoints}), flush=True)  # one line a script can wait for
            while True:
                supervisor.poll()
                time.sleep(0.5)
        except KeyboardInterrupt:
            log.info("Ctrl-C: stopping all services")
            return 0
        except (RuntimeError, TimeoutError) as e:
            print(f"error: {e}", file=sys.stderr, flush=True)
            return 1
        finally:
            _stop(supervisor.processes())


# ---- registration -------------------------------------------------------------------------------


def add_service_parsers(sub: argparse._SubParsersAction) -> None:
    """Register `dspark verifier | drafter | scheduler | up | healthcheck` on the CLI's subparsers
    (`dspark healthcheck` itself runs without them: dspark/cli.py's main, services/healthcheck.py)."""
    v = sub.add_parser("verifier", help="gRPC verifier service: target model, KV caches, rejection sampler, SPS(B)")
    _add_common(v, "verifier")
    _add_model(v)
    _add_drafter(v)  # which layers to capture follows from the drafter the deployment uses
    add_config_flag(v, "--kv-budget-mb", key="model.kv_budget_mb", type=int, help="memory for all requests' KV caches")
    add_config_flag(v, "--max-model-len", key="model.max_model_len", type=int, help="context window; 0 = the model's")
    add_config_flag(v, "--sps-max-batch", key="verifier.sps_max_batch", type=int,
                    help="profile SPS(B) at start-up up to this B; 0 skips it")
    add_config_flag(v, "--sampler-backend", key="verifier.sampler_backend", choices=SAMPLER_BACKENDS)
    v.set_defaults(func=cmd_verifier)

    d = sub.add_parser("drafter", help="gRPC drafter service: hosts a drafter, keeps each request's context features")
    _add_common(d, "drafter")
    _add_model(d)
    _add_drafter(d)
    add_config_flag(d, "--drafter-top-k", key="drafter.top_k", type=int,
                    help="truncate draft rows to the top k (sparse on the wire); 0 = full")
    d.set_defaults(func=cmd_drafter)

    s = sub.add_parser("scheduler", help="gRPC scheduler service: the round loop over the verifier and drafter services")
    _add_common(s, "scheduler")
    add_config_flag(s, "--verifier-address", key="verifier.address", help="host:port of the verifier; '' = its host:port")
    add_config_flag(s, "--drafter-address", key="drafter.address", help="host:port of the drafter; '' = its host:port")
    add_config_flag(s, "--drafter", key="drafter.name", help="drafter name; 'none' = plain decoding, no drafter service needed")
    add_config_flag(s, "--gamma", key="scheduler.gamma", type=int, help="draft tokens per round")
    add_config_flag(s, "--policy", key="scheduler.policy", help="none | fixed:K | threshold:C | dspark | dspark-async")
    add_config_flag(s, "--redis", key="redis.url", help="Redis URL: also serve the gateways' requests from the bus")
    s.set_defaults(func=cmd_scheduler)

    u = sub.add_parser("up", help="start verifier, drafter, scheduler (and gateway with --redis) as processes on this machine")
    _add_common(u, None)
    _add_model(u)
    _add_drafter(u)
    add_config_flag(u, "--kv-budget-mb", key="model.kv_budget_mb", type=int)
    add_config_flag(u, "--sps-max-batch", key="verifier.sps_max_batch", type=int,
                    help="the verifier's SPS(B) profile up to this B; 0 skips it")
    add_config_flag(u, "--gamma", key="scheduler.gamma", type=int)
    add_config_flag(u, "--policy", key="scheduler.policy")
    add_config_flag(u, "--redis", key="redis.url", help="Redis URL of the bus: also starts the HTTP gateway")
    add_config_flag(u, "--gateway-port", key="gateway.port", type=int)
    u.set_defaults(func=cmd_up)

    h = sub.add_parser("healthcheck", help="one grpc.health.v1 Check with the services' TLS configuration: exit 0 when SERVING "
                                           "(an exec probe under mutual TLS)")
    add_healthcheck_arguments(h)
