"""The scheduler service: the round loop over a remote verifier and drafter, and the Scheduler API.

    dspark scheduler --config serving.toml      # verifier and drafter must be reachable at their addresses

    engine = build_remote_engine(config)        # AsyncEngine(SpeculativeEngine(RemoteVerifier, RemoteDrafter)), started

The process hosts one AsyncEngine (dspark/engine/async_engine.py) over
`SpeculativeEngine.from_parts(verifier=RemoteVerifier, drafter=RemoteDrafter)`: continuous
batching (requests join and leave between rounds; a request whose KV does not fit waits in FIFO
order: RESOURCE_EXHAUSTED from the verifier queues it, never fails it), the configured policy
(Algorithm 1 on the verifier's SPS(B) profile for `dspark`). Requests arrive two ways, both
feeding the same engine: the gRPC Scheduler service (Submit streams StepOutputs until one carries
a finish reason; Cancel; Stats), and, when `redis.url` is set, the Redis bus worker
(dspark/bus/worker.py) that the gateways talk to. Health (grpc.health.v1) and reflection are
served alongside. The gRPC server is asyncio (grpc.aio): Submit awaits the engine's per-request
stream directly. The engine's Prometheus metrics (dspark/observability/metrics.py) are served
over HTTP on observability.metrics_port (default 9464; 0 = none), on scheduler.host.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import os
import socket
import threading
import time
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from dspark.drafters.base import NoDrafter
from dspark.engine.async_engine import AsyncEngine, EngineError, GenerationDelta
from dspark.engine.faults import FaultPolicy
from dspark.engine.speculative import SpeculativeEngine, StepOutput
from dspark.observability.grpc_tracing import AioServerTracingInterceptor
from dspark.observability.metrics import start_metrics_server
from dspark.protos import SCHEDULER_SERVICE, convert, validate
from dspark.protos.dspark.v1 import scheduler_pb2, scheduler_pb2_grpc
from dspark.protos.validate import ValidationError
from dspark.serving_config import ServingConfig
from services.grpc_auth import AsyncTokenAuthInterceptor, warn_if_exposed
from services.grpc_common import HEALTH_SERVICE, channel_options
from services.grpc_tls import TlsCredentials, add_port, load_tls

__all__ = [
    "SchedulerServer", "SchedulerServicer", "build_remote_engine", "build_remote_speculative_engine", "serve_scheduler",
    "start_scheduler_server",
]

log = logging.getLogger(__name__)

STATS_WINDOW_S = 30.0  # Stats' rates are over about this many recent seconds


def build_remote_speculative_engine(config: ServingConfig) -> SpeculativeEngine:
    """SpeculativeEngine(RemoteVerifier, RemoteDrafter) for `config` (waits for both services)."""
    from dspark.scheduling.policies import parse_policy
    from services.drafter.client import RemoteDrafter
    from services.verifier.client import RemoteVerifier

    rpc = config.rpc
    tls = load_tls(rpc)
    policy = parse_policy(config.scheduler.policy) if config.scheduler.policy else None
    verifier = RemoteVerifier(config.verifier.dial, deadline_s=rpc.deadline_s, verify_deadline_s=rpc.verify_deadline_s,
                              connect_timeout_s=rpc.connect_timeout_s, max_message_mb=rpc.max_message_mb,
                              auth_token=rpc.auth_token, tls=tls)
    drafter = None
    if config.drafter.name != "none":
        drafter = RemoteDrafter(config.drafter.dial, deadline_s=rpc.deadline_s, draft_deadline_s=rpc.draft_deadline_s,
                                connect_timeout_s=rpc.connect_timeout_s, max_message_mb=rpc.max_message_mb,
                                auth_token=rpc.auth_token, tls=tls)
        if drafter.vocab_size != verifier.vocab_size:
            raise ValueError(f"the drafter at {drafter.address} serves a vocabulary of {drafter.vocab_size}, "
                             f"the verifier at {verifier.address} one of {verifier.vocab_size}: not the same model")
    # A failed verifier is waited for as long as a starting one (dspark/engine/faults.py).
    engine = SpeculativeEngine.from_parts(verifier=verifier, drafter=drafter, num_speculative_tokens=config.scheduler.gamma,
                                          policy=policy, faults=FaultPolicy(verifier_timeout_s=rpc.connect_timeout_s))
    if policy is not None and policy.needs_sps_profile and engine.sps_profile is None:
        raise ValueError(f"policy {policy.spec!r} needs the verifier's SPS(B) profile: start the verifier with sps_max_batch > 0")
    return engine


def build_remote_engine(config: ServingConfig) -> AsyncEngine:
    """The started AsyncEngine over the remote verifier and drafter (what the bus worker and the
    Scheduler service drive)."""
    return AsyncEngine(build_remote_speculative_engine(config)).start()


class SchedulerServicer(scheduler_pb2_grpc.SchedulerServicer):
    """Submit / Cancel / Stats over an AsyncEngine (any engine: remote parts or in-process)."""

    def __init__(self, engine: AsyncEngine):
        self.engine = engine
        self._cancels: dict[str, asyncio.Event] = {}  # running Submit calls, by request id
        # (time, counters) snapshots taken by Stats calls: rates are over the oldest kept one and now
        self._samples: collections.deque[tuple[float, tuple[int, int, int, int]]] = collections.deque([(time.monotonic(), self._counters())])

    def _counters(self) -> tuple[int, int, int, int]:
        c = self.engine.engine.counters  # plain ints written by the engine thread: a racy read is a slightly old one
        return c.emitted_tokens, c.decode_request_rounds, c.emitted_in_decode_rounds, c.finished

    async def Submit(self, request: scheduler_pb2.GenerationRequest, context: grpc.aio.ServicerContext):
        try:
            validate.generation_request(request, vocab_size=self.engine.engine.vocab_size)
        except ValidationError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        rid = request.request_id
        if rid in self._cancels:
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, f"request id {rid!r} is already running")
        try:
            stream = await self.engine.submit(convert.generation_request_from_proto(request))
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except EngineError as e:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
        cancelled = self._cancels[rid] = asyncio.Event()
        waiter = asyncio.ensure_future(cancelled.wait())
        step = None
        try:
            while True:  # next delta, or a Cancel: whichever comes first
                step = asyncio.ensure_future(stream.__anext__())
                await asyncio.wait({step, waiter}, return_when=asyncio.FIRST_COMPLETED)
                if not step.done():
                    yield convert.step_output_to_proto(StepOutput(rid, [], "abort"))
                    return
                try:
                    delta: GenerationDelta = step.result()
                except StopAsyncIteration:
                    return
                yield convert.step_output_to_proto(StepOutput(rid, delta.new_token_ids, delta.finish_reason, delta.logprobs))
                if delta.finish_reason is not None:
                    return
        except EngineError as e:
            await context.abort(grpc.StatusCode.INTERNAL, f"generation failed: {e}")
        finally:
            waiter.cancel()
            if step is not None and not step.done():
                step.cancel()
            self._cancels.pop(rid, None)
            stream.abort()  # no-op once finished; frees KV and drafter state if cancelled or the client went away

    async def Cancel(self, request: scheduler_pb2.CancelRequest, context) -> scheduler_pb2.CancelResponse:
        try:
            validate.cancel_request(request)
        except ValidationError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        event = self._cancels.get(request.request_id)
        if event is None or event.is_set():
            return scheduler_pb2.CancelResponse(cancelled=False)
        event.set()
        return scheduler_pb2.CancelResponse(cancelled=True)

    async def Stats(self, request: scheduler_pb2.StatsRequest, context) -> scheduler_pb2.SchedulerStats:
        spec = self.engine.engine
        now, sample = time.monotonic(), self._counters()
        self._samples.append((now, sample))
        while len(self._samples) > 2 and now - self._samples[1][0] >= STATS_WINDOW_S:
            self._samples.popleft()  # keep one snapshot at or before the window's start
        t0, first = self._samples[0]
        tokens, rounds, emitted = (b - a for a, b in zip(first[:3], sample[:3]))
        drafters, verifiers = await asyncio.to_thread(_reachable, spec)
        return scheduler_pb2.SchedulerStats(
            num_waiting=self.engine.num_waiting, num_running=self.engine.num_running, num_finished=sample[3],
            num_rounds=spec.counters.steps, generation_tokens_per_second=tokens / (now - t0) if now > t0 else 0.0,
            mean_accepted_length=emitted / rounds if rounds else 0.0, num_drafters=drafters, num_verifiers=verifiers,
        )


def _reachable(engine: SpeculativeEngine) -> tuple[int, int]:
    """(drafters, verifiers) answering SERVING now: a remote part's health check; an in-process
    part counts as reachable, plain decoding (no drafter) as no drafter."""
    from services.drafter.client import RemoteDrafter
    from services.verifier.client import RemoteVerifier

    counts = []
    for part, remote in ((engine.drafter, RemoteDrafter), (engine.verifier, RemoteVerifier)):
        counts.append(0 if isinstance(part, NoDrafter) else int(part.is_serving() if isinstance(part, remote) else True))
    return counts[0], counts[1]


# ---- the server ---------------------------------------------------------------------------------


@dataclass
class SchedulerServer:
    """A grpc.aio server running on its own thread and event loop (`port`: the bound port)."""

    port: int
    _loop: asyncio.AbstractEventLoop
    _server: grpc.aio.Server
    _health: health.HealthServicer
    _thread: threading.Thread

    def stop(self, grace: float | None = 1.0) -> None:
        async def shutdown() -> None:
            await self._health.enter_graceful_shutdown()
            await self._server.stop(grace)

        if self._thread.is_alive():
            asyncio.run_coroutine_threadsafe(shutdown(), self._loop).result()
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10.0)

    def wait_for_termination(self) -> None:
        self._thread.join()


def start_scheduler_server(engine: AsyncEngine, *, bind: str = "127.0.0.1:0", max_message_mb: int = 512,
                           auth_token: str = "", tls: TlsCredentials | None = None) -> SchedulerServer:
    """Serve the Scheduler API over a started AsyncEngine on `bind` (port 0: any free port), with
    health (SERVING) and reflection, on a new thread with its own event loop; every call but
    health needs `auth_token` when one is given (services/grpc_auth.py), every connection a
    client certificate under `tls` (services/grpc_tls.py)."""
    if tls is None:  # under mutual TLS only holders of a certificate of the CA connect at all
        warn_if_exposed(bind, auth_token, SCHEDULER_SERVICE)
    loop = asyncio.new_event_loop()
    started: dict = {}
    ready = threading.Event()

    async def start() -> None:
        # Submit is an entry point: a call without a traceparent starts a trace of its own.
        tracing_interceptor = AioServerTracingInterceptor(root_spans=True)
        server = grpc.aio.server(options=channel_options(max_message_mb),
                                 interceptors=[tracing_interceptor] + ([AsyncTokenAuthInterceptor(auth_token)] if auth_token else []))
        scheduler_pb2_grpc.add_SchedulerServicer_to_server(SchedulerServicer(engine), server)
        health_servicer = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
        reflection.enable_server_reflection((SCHEDULER_SERVICE, HEALTH_SERVICE, reflection.SERVICE_NAME), server)
        port = add_port(server, bind, tls)
        await server.start()
        for name in ("", SCHEDULER_SERVICE):
            await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
        started.update(server=server, port=port, health=health_servicer)

    def main() -> None:
        asyncio.set_event_loop(loop)
        try:
            loop.run_until_complete(start())
        except Exception as e:  # noqa: BLE001  (re-raised on the caller's thread below)
            started["error"] = e
            ready.set()
            return
        ready.set()
        loop.run_forever()
        loop.close()

    thread = threading.Thread(target=main, name="dspark-scheduler-grpc", daemon=True)
    thread.start()
    ready.wait()
    if "error" in started:
        raise started["error"]
    if not started["port"]:
        raise OSError(f"could not bind the scheduler's gRPC server to {bind}")
    return SchedulerServer(port=started["port"], _loop=loop, _server=started["server"], _health=started["health"], _thread=thread)


def _start_bus_worker(engine: AsyncEngine, config: ServingConfig):
    """The Redis bus worker feeding `engine` when `redis.url` is set (None otherwise)."""
    if not config.redis.url:
        return None
    from dspark.bus.redis_bus import RedisBus
    from dspark.bus.worker import start_worker_thread

    # Named by host and port, so the name survives a restart of this process (a Kubernetes container
    # restart, `dspark up` restarting it): the new process takes its predecessor's pending requests
    # back at once instead of after claim_idle_s. Two live schedulers never share a host and port.
    consumer = f"scheduler-{socket.gethostname()}-{config.scheduler.port or os.getpid()}"
    log.info("consuming requests from the bus at %s as %s", config.redis.url, consumer)
    return start_worker_thread(lambda: RedisBus.from_url(config.redis.url), engine, consumer=consumer)


def serve_scheduler(config: ServingConfig) -> None:
    """`dspark scheduler`: connect to the verifier and drafter, serve until SIGTERM / Ctrl-C."""
    import signal

    engine = build_remote_engine(config)  # its clients load rpc.tls_* first: a bad file fails before any dialling
    tls = load_tls(config.rpc)  # the same files, for the server
    worker = _start_bus_worker(engine, config)
    metrics_port = config.observability.metrics_port
    metrics_server = start_metrics_server(metrics_port, host=config.scheduler.host) if metrics_port else None
    server = start_scheduler_server(engine, bind=config.scheduler.bind, max_message_mb=config.rpc.max_message_mb,
                                    auth_token=config.rpc.auth_token, tls=tls)
    log.info("scheduler serving on %s:%d (verifier %s, drafter %s, gamma %d, policy %s)", config.scheduler.host, server.port,
             config.verifier.dial, config.drafter.dial, config.scheduler.gamma, config.scheduler.policy or "all drafts")
    stop = threading.Event()
    previous = {sig: signal.signal(sig, lambda signum, frame: stop.set()) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        while not stop.wait(1.0):
            if not engine.is_running:
                log.error("the engine loop stopped; exiting")
                break
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        server.stop(5.0)
        if worker is not None:
            worker.stop()
        if metrics_server is not None:
            metrics_server.shutdown()
        engine.shutdown()
