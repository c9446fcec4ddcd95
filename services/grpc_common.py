"""What every gRPC service and client of the serving system shares.

Servers (`create_server`): a thread-pool gRPC server with the standard grpc.health.v1 health
service and server reflection next to our services, message size limits from the configuration,
and `rpc_errors(context)`: the one place where library exceptions become status codes
(ValidationError / ValueError -> INVALID_ARGUMENT, KVBudgetExceeded -> RESOURCE_EXHAUSTED,
`RpcAbort(code, message)` -> that code, anything else -> INTERNAL), always with a message.

Clients (`call`, `make_channel`): every call carries a deadline, and a failed call becomes an
exception that says which service and RPC failed and why: ValueError (INVALID_ARGUMENT),
KVBudgetExceeded (RESOURCE_EXHAUSTED raised by a verifier for lack of KV), DeadlineExceeded,
ServiceUnavailable, or ServiceError for the rest. A KVBudgetExceeded queues the request; a
ServiceError (all three) is a PartFailure the engine recovers from (dspark/engine/faults.py).

Both sides take `auth_token` (rpc.auth_token): servers then refuse every call but health without
it (UNAUTHENTICATED), channels send it on every call (services/grpc_auth.py). Both take `tls`
(services/grpc_tls.py, from rpc.tls_*): servers then listen with mutual TLS only, channels present
the certificate and check the server's; None = plaintext. Every channel and
server also carries the W3C trace context in the metadata, with CLIENT / SERVER spans while
tracing is on (dspark/observability/grpc_tracing.py).
"""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from dspark.engine.faults import PartFailure
from dspark.model.kv_cache import KVBudgetExceeded
from dspark.observability.grpc_tracing import ClientTracingInterceptor, ServerTracingInterceptor
from dspark.protos.validate import ValidationError
from services.grpc_auth import TokenAuthInterceptor, authenticated_channel, warn_if_exposed
from services.grpc_tls import TlsCredentials, add_port, open_channel

__all__ = [
    "DeadlineExceeded", "GrpcServer", "RpcAbort", "ServiceError", "ServiceUnavailable", "call", "channel_options", "check_health",
    "check_reply", "connect_client", "create_server", "make_channel", "rpc_errors", "serve_until_signalled", "wait_until_serving",
]

log = logging.getLogger(__name__)

KV_BUDGET_METADATA = ("dspark-error", "kv-budget-exceeded")  # marks a RESOURCE_EXHAUSTED that means "no KV now"
HEALTH_SERVICE = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name  # "grpc.health.v1.Health"


# ---- client side -------------------------------------------------------------------------------


class ServiceError(PartFailure):
    """A call to another service failed for a reason that is not the request's fault (the engine
    recovers from it: dspark/engine/faults.py)."""


class DeadlineExceeded(ServiceError):
    """A call got no answer within its deadline."""


class ServiceUnavailable(ServiceError):
    """The service could not be reached (not started, crashed, wrong address)."""


def channel_options(max_message_mb: int) -> list[tuple[str, int]]:
    size = max_message_mb * 2**20
    return [("grpc.max_send_message_length", size), ("grpc.max_receive_message_length", size)]


# A restarted service is dialled again within about a second (gRPC's default backoff grows to 120 s).
RECONNECT_OPTIONS = [("grpc.initial_reconnect_backoff_ms", 250), ("grpc.min_reconnect_backoff_ms", 250),
                     ("grpc.max_reconnect_backoff_ms", 1000)]


def make_channel(address: str, *, max_message_mb: int = 512, auth_token: str = "",
                 tls: TlsCredentials | None = None) -> grpc.Channel:
    """A channel to `address` whose calls carry `auth_token` (services/grpc_auth.py; "" = none),
    over mutual TLS with `tls` (services/grpc_tls.py; None = plaintext)."""
    channel = authenticated_channel(open_channel(address, tls, options=channel_options(max_message_mb) + RECONNECT_OPTIONS),
                                    auth_token)
    return grpc.intercept_channel(channel, ClientTracingInterceptor())  # trace context in the metadata (dspark/observability)


def translate_rpc_error(err: grpc.RpcError, *, where: str, timeout: float | None) -> Exception:
    """The exception a failed call raises in the caller (see the module docstring)."""
    code, details = err.code(), err.details() or ""
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        return ValueError(f"{where}: {details}")
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED and KV_BUDGET_METADATA in tuple(err.trailing_metadata() or ()):
        return KVBudgetExceeded(f"{where}: {details}")
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return DeadlineExceeded(f"{where}: no answer within the {timeout} s deadline")
    if code == grpc.StatusCode.UNAVAILABLE:
        return ServiceUnavailable(f"{where}: service unavailable: {details}")
    return ServiceError(f"{where} failed with {code.name}: {details}")


def call(method: Callable, request, *, timeout: float, where: str, wait_for_ready: bool = False):
    """A unary call with a deadline; a failure raises translate_rpc_error's exception."""
    try:
        return method(request, timeout=timeout, wait_for_ready=wait_for_ready)
    except grpc.RpcError as err:
        raise translate_rpc_error(err, where=where, timeout=timeout) from None


def connect_client(address: str, stub_class: Callable, info_request, *, service: str, connect_timeout_s: float,
                   max_message_mb: int = 512, auth_token: str = "", tls: TlsCredentials | None = None,
                   wire_bytes: grpc.UnaryUnaryClientInterceptor | None = None) -> tuple[grpc.Channel, object, object]:
    """(channel, stub, GetInfo reply) of a client of `service` ("drafter", "verifier") at `address`:
    a make_channel channel, counted by `wire_bytes` (services/wire_bytes.py) if given. GetInfo
    waits for the server (wait_for_ready: one still loading its model) up to connect_timeout_s;
    past that the channel is closed and ServiceUnavailable raised."""
    channel = make_channel(address, max_message_mb=max_message_mb, auth_token=auth_token, tls=tls)
    if wire_bytes is not None:
        channel = grpc.intercept_channel(channel, wire_bytes)
    stub = stub_class(channel)
    try:
        info = call(stub.GetInfo, info_request, timeout=connect_timeout_s, where=f"{service} at {address}: GetInfo",
                    wait_for_ready=True)
    except DeadlineExceeded:
        channel.close()
        raise ServiceUnavailable(f"{service} at {address}: not reachable within {connect_timeout_s} s") from None
    return channel, stub, info


def check_reply(check: Callable[[], None], *, where: str) -> None:
    """Run `check` (a dspark/protos/validate.py check of a reply); its ValidationError becomes a
    ServiceError: a reply that cannot be trusted is the service's failure, not the request's."""
    try:
        check()
    except ValidationError as e:
        raise ServiceError(f"{where} sent an invalid reply: {e}") from None


def check_health(channel: grpc.Channel, service: str = "", *, timeout: float = 5.0) -> bool:
    """True if the server answers SERVING for `service` ("" = the server as a whole)."""
    try:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout)
    except grpc.RpcError:
        return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING


def wait_until_serving(address: str, service: str = "", *, timeout: float, poll_s: float = 0.2,
                       alive: Callable[[], bool] | None = None, tls: TlsCredentials | None = None) -> None:
    """Block until `address` reports SERVING; TimeoutError after `timeout` s, RuntimeError as soon
    as `alive()` (e.g. "the process still runs") turns False. `tls`: the servers' mutual TLS."""
    deadline = time.monotonic() + timeout
    with open_channel(address, tls) as channel:
        while True:
            if check_health(channel, service, timeout=min(5.0, max(0.1, deadline - time.monotonic()))):
                return
            if alive is not None and not alive():
                raise RuntimeError(f"{address}: the service exited before reporting SERVING")
            if time.monotonic() >= deadline:
                raise TimeoutError(f"{address}: not SERVING after {timeout} s")
            time.sleep(poll_s)


# ---- server side -------------------------------------------------------------------------------


class RpcAbort(Exception):
    """Raised inside a servicer to end the call with `code` and `message`."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code = code
        self.message = message


@contextlib.contextmanager
def rpc_errors(context: grpc.ServicerContext, what: str) -> Iterator[None]:
    """Map exceptions raised in the block to a status code with a message (module docstring)."""
    try:
        yield
    except RpcAbort as e:
        context.abort(e.code, e.message)
    except ValueError as e:  # ValidationError included: "field: message"
        context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
    except KVBudgetExceeded as e:
        context.set_trailing_metadata((KV_BUDGET_METADATA,))
        context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
    except Exception as e:  # a bug or a broken state: say what, keep serving
        log.exception("%s failed", what)
        context.abort(grpc.StatusCode.INTERNAL, f"{what} failed: {type(e).__name__}: {e}")


@dataclass
class GrpcServer:
    """A started server: `port` is the bound port (useful with port 0), `health` its health servicer."""

    server: grpc.Server
    port: int
    health: health.HealthServicer
    service_names: tuple[str, ...]

    def set_serving(self, serving: bool = True) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ("",) + self.service_names:
            self.health.set(name, status)

    def stop(self, grace: float | None = 1.0) -> None:
        self.set_serving(False)
        self.server.stop(grace).wait()

    def wait_for_termination(self) -> None:
        self.server.wait_for_termination()


def create_server(
    add_servicers: Callable[[grpc.Server], None],
    service_names: tuple[str, ...],
    *,
    bind: str,
    max_message_mb: int = 512,
    max_workers: int = 8,
    auth_token: str = "",  # required of every call but health (services/grpc_auth.py); "" = none
    tls: TlsCredentials | None = None,  # mutual TLS required of every connection (services/grpc_tls.py); None = plaintext
) -> GrpcServer:
    """Start a server on `bind` (host:port, port 0 = any free one) with our servicers, health
    (SERVING for "" and each service name) and reflection (our services + health + reflection)."""
    if tls is None:  # under mutual TLS only holders of a certificate of the CA connect at all
        warn_if_exposed(bind, auth_token, "/".join(service_names))
    interceptors = [ServerTracingInterceptor()] + ([TokenAuthInterceptor(auth_token)] if auth_token else [])
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=max_workers), options=channel_options(max_message_mb),
                         interceptors=interceptors)
    add_servicers(server)
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(service_names + (HEALTH_SERVICE, reflection.SERVICE_NAME), server)
    port = add_port(server, bind, tls)
    if port == 0:
        raise OSError(f"could not bind a gRPC server to {bind}")
    server.start()
    running = GrpcServer(server=server, port=port, health=health_servicer, service_names=service_names)
    running.set_serving(True)
    return running


def serve_until_signalled(server: GrpcServer, *, grace_s: float = 5.0) -> None:
    """Block until SIGTERM or SIGINT (Kubernetes stopping the pod, Ctrl-C), then report NOT_SERVING
    and stop, letting calls in flight finish for `grace_s` seconds. Main thread only."""
    stop = threading.Event()

    def request_stop(signum, frame) -> None:
        log.info("signal %d: stopping", signum)
        stop.set()

    previous = {sig: signal.signal(sig, request_stop) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        while not stop.wait(1.0):  # a timed wait, so that signals are handled promptly
            pass
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        server.stop(grace_s)
