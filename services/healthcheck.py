"""`dspark healthcheck`: one grpc.health.v1 Check, as a Kubernetes exec probe can run it.

    dspark healthcheck --target 127.0.0.1:50053                        # exit 0: SERVING
    dspark healthcheck --target 127.0.0.1:50053 --server-name verifier  # mutual TLS, certificate for `verifier`
    dspark healthcheck --target verifier:50053 --service dspark.v1.Verifier --timeout 2

The kubelet's own `grpc:` probes speak plaintext and present no certificate, so under mutual TLS
(services/grpc_tls.py) they never reach the health service and the pods never become ready.
This command makes the same Check with the configuration the services read (`--config` or
$DSPARK_CONFIG, then DSPARK_<SECTION>_<KEY>): with rpc.tls_* set it dials with this pod's
certificate, otherwise plaintext. It sends no token: grpc.health.v1 is open to token-less
callers (services/grpc_auth.py, OPEN_SERVICES). `--server-name` is the name the server's
certificate must carry when that is not the dialled host (a probe dials 127.0.0.1; the
certificate names the Service, `verifier`).

Exit 0 and one line on stdout when the server reports SERVING; otherwise exit 1 and one line on
stderr that says why: NOT_SERVING (or another status), nothing listening, the TLS handshake
refused (a hint at rpc.tls_* without TLS, at the CA and the server name with it), no answer
within --timeout, or a bad configuration. An exec probe runs it every few seconds, so it imports
only grpc and the configuration (no torch; dspark/cli.py dispatches to it before anything else).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from dspark.command_config import add_config_arguments, command_config
from services.grpc_tls import TlsConfigError, TlsCredentials, load_tls, open_channel

__all__ = ["HealthCheck", "add_healthcheck_arguments", "check_once", "cmd_healthcheck", "healthcheck_main", "healthcheck_parser"]

DEFAULT_TIMEOUT_S = 3.0  # below the probes' timeoutSeconds (5), so that ours reports first, with a reason


@dataclass(frozen=True)
class HealthCheck:
    """The outcome of one Check: `serving`, and one line saying what was found."""

    serving: bool
    message: str


def _unavailable(target: str, details: str, tls: TlsCredentials | None, server_name: str) -> str:
    """Why an UNAVAILABLE (or a failed connection's UNKNOWN) Check failed, from gRPC's details:
    a failed TLS handshake is one of these too, and each side's reason has its own words."""
    seen = details.lower()
    if "connection refused" in seen:
        return f"{target}: unreachable: connection refused, nothing listens there ({details})"
    if "hostname verification" in seen or "no match found for server name" in seen:
        name = server_name or target.rpartition(":")[0]
        return (f"{target}: TLS handshake refused: the server's certificate does not name {name!r} "
                f"(give a name it carries with --server-name) ({details})")
    if "certificate_verify_failed" in seen:
        return f"{target}: TLS handshake refused: the server's certificate is not signed by the CA of rpc.tls_ca_path ({details})"
    if "wrong_version_number" in seen:
        return f"{target}: TLS handshake refused: the server speaks plaintext (it has no rpc.tls_* set) ({details})"
    if any(marker in seen for marker in ("socket closed", "connection reset", "end of tcp stream", "handshake")):
        if tls is None:  # a server under mutual TLS closes a plaintext connection without a word
            return (f"{target}: the server closed the connection: it may require mutual TLS, and this check spoke plaintext "
                    f"(set rpc.tls_ca_path, tls_cert_path and tls_key_path: DSPARK_RPC_TLS_*) ({details})")
        return (f"{target}: TLS handshake refused: the server closed the connection, refusing our certificate "
                f"(is rpc.tls_cert_path signed by a CA the server trusts?) ({details})")
    return f"{target}: unreachable ({details})"


def check_once(target: str, service: str = "", *, timeout: float, tls: TlsCredentials | None = None,
               server_name: str = "") -> HealthCheck:
    """One grpc.health.v1 Check of `service` ("" = the server as a whole) at `target` (host:port),
    over mutual TLS when `tls` is given (the server's certificate must name `server_name`, or
    the dialled host when that is empty), within `timeout` seconds including the connection."""
    options = [("grpc.ssl_target_name_override", server_name)] if tls is not None and server_name else None
    what = f"{service} at {target}" if service else target
    with open_channel(target, tls, options=options) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout)
        except grpc.RpcError as e:
            code, details = e.code(), " ".join((e.details() or "").split())  # one line
            if "failed to connect" in details.lower():  # gRPC's own UNKNOWN / UNAVAILABLE for a connection that failed
                return HealthCheck(False, _unavailable(target, details, tls, server_name))
            if code == grpc.StatusCode.DEADLINE_EXCEEDED:
                return HealthCheck(False, f"{what}: no answer within {timeout:g} s (timeout)")
            if code == grpc.StatusCode.UNAVAILABLE:
                return HealthCheck(False, _unavailable(target, details, tls, server_name))
            if code == grpc.StatusCode.NOT_FOUND:
                return HealthCheck(False, f"{target}: the server knows no service {service!r} (NOT_FOUND)")
            if code == grpc.StatusCode.UNIMPLEMENTED:
                return HealthCheck(False, f"{target}: the server has no grpc.health.v1 service (UNIMPLEMENTED)")
            return HealthCheck(False, f"{what}: {code.name}: {details}")
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    return HealthCheck(reply.status == health_pb2.HealthCheckResponse.SERVING, f"{what}: {status}")


def add_healthcheck_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", required=True, help="host:port of the gRPC server to check (a probe: 127.0.0.1:<its port>)")
    p.add_argument("--service", default="", help="service name to check, e.g. dspark.v1.Verifier (default: the server as a whole)")
    p.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S,
                   help=f"seconds for the connection and the call (default: {DEFAULT_TIMEOUT_S:g}; keep it below the probe's timeoutSeconds)")
    p.add_argument("--server-name", default="",
                   help="under mutual TLS: the name the server's certificate must carry, when not the target's host "
                        "(a probe dials 127.0.0.1, the certificate names `verifier`)")
    add_config_arguments(p)  # rpc.tls_* from the file and DSPARK_RPC_TLS_*, as the services read them
    p.set_defaults(func=cmd_healthcheck)


def cmd_healthcheck(args: argparse.Namespace) -> int:
    """Exit status 0 when SERVING, 1 otherwise (with the reason on stderr)."""
    if args.timeout <= 0:
        print(f"error: --timeout must be > 0 seconds, got {args.timeout:g}", file=sys.stderr)
        return 1
    try:
        tls = load_tls(command_config(args).rpc)
    except (TlsConfigError, ValueError, FileNotFoundError) as e:  # TlsConfigError is a ValueError; named for the reader
        print(f"error: {e}", file=sys.stderr)
        return 1
    result = check_once(args.target, args.service, timeout=args.timeout, tls=tls, server_name=args.server_name)
    print(result.message, file=sys.stdout if result.serving else sys.stderr)
    return 0 if result.serving else 1


def healthcheck_parser() -> argparse.ArgumentParser:
    """The parser of `dspark healthcheck`'s arguments alone (what follows `healthcheck`)."""
    parser = argparse.ArgumentParser(prog="dspark healthcheck", description=__doc__.splitlines()[0])
    add_healthcheck_arguments(parser)
    return parser


def healthcheck_main(argv: list[str]) -> int:
    """`dspark healthcheck ARGS` parsed on its own, without building the whole CLI (whose other
    commands import torch): what dspark/cli.py's main runs for it."""
    return cmd_healthcheck(healthcheck_parser().parse_args(argv))
