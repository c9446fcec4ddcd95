"""Mutual TLS of the calls between the services: the one place that builds gRPC credentials.

    tls = load_tls(config.rpc)                           # None: rpc.tls_* empty, plaintext (h2c)
    port = add_port(server, "0.0.0.0:50053", tls)        # grpc.server or grpc.aio.server
    channel = open_channel("verifier:50053", tls, options=[...])

With rpc.tls_ca_path, rpc.tls_cert_path and rpc.tls_key_path set (DSPARK_RPC_TLS_CA_PATH, ...;
PEM files, all three or none), every server listens with TLS and refuses a client that does not
present a certificate signed by the CA bundle (`require_client_auth=True`: the handshake fails,
the client sees UNAVAILABLE), and every channel presents this process's certificate and accepts
only a server whose certificate the same CA bundle signed and that names the host it dials (a
DNS or IP subject alternative name: `verifier`, `127.0.0.1`, ...). A plaintext client gets no
answer either. One certificate per deployment may serve every service as server and client
(extended key usage serverAuth + clientAuth, every dialled name as SAN), or each its own.

The token of services/grpc_auth.py is still checked on top: TLS decides who may connect, the
token which calls a connected peer may make. Health is open to token-less callers, but under
mTLS only to callers with a certificate, so the kubelet's gRPC probes (plaintext) cannot reach it:
`dspark healthcheck` (services/healthcheck.py) is the exec probe that can (deploy/k8s/components/mtls).
The files are read once, when a server or channel is made: a renewed certificate takes effect on
restart. Bad files fail at start with a message that names the key and the file, not at the
first handshake.
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import grpc

if TYPE_CHECKING:
    from dspark.serving_config import RpcSection

__all__ = ["TlsConfigError", "TlsCredentials", "add_port", "load_tls", "open_channel"]

CA_KEY, CERT_KEY, KEY_KEY = "rpc.tls_ca_path", "rpc.tls_cert_path", "rpc.tls_key_path"


class TlsConfigError(ValueError):
    """A TLS file is missing, unreadable, not PEM, or the key does not match its certificate."""


def _read(path: str, key: str, what: str, marker: bytes) -> bytes:
    """The bytes of the PEM file `path` (configuration key `key`), which must contain `marker`."""
    file = Path(path)
    try:
        data = file.read_bytes()
    except FileNotFoundError:
        raise TlsConfigError(f"{key}: {what} file {path} does not exist") from None
    except IsADirectoryError:
        raise TlsConfigError(f"{key}: {path} is a directory, not the {what} file") from None
    except OSError as e:
        raise TlsConfigError(f"{key}: {what} file {path} cannot be read: {e.strerror or e}") from None
    if marker not in data:
        raise TlsConfigError(f"{key}: {path} is not a PEM {what} (no '{marker.decode()}' line)")
    return data


def _no_password() -> bytes:
    raise TlsConfigError(f"{KEY_KEY}: the private key is encrypted; gRPC needs an unencrypted PEM key "
                         "(keep it in a Secret readable by the service only)")


@dataclass(frozen=True)
class TlsCredentials:
    """The PEM bytes of the CA bundle, this process's certificate (chain) and its private key."""

    root_certificates: bytes = field(repr=False)
    certificate_chain: bytes = field(repr=False)
    private_key: bytes = field(repr=False)

    @classmethod
    def from_files(cls, *, ca_path: str, cert_path: str, key_path: str) -> TlsCredentials:
        """Read and check the three files (TlsConfigError naming the key and file otherwise)."""
        ca = _read(ca_path, CA_KEY, "CA certificate", b"-----BEGIN CERTIFICATE-----")
        cert = _read(cert_path, CERT_KEY, "certificate", b"-----BEGIN CERTIFICATE-----")
        key = _read(key_path, KEY_KEY, "private key", b"PRIVATE KEY-----")
        # gRPC itself would accept broken files here and fail every handshake later, with a
        # message in its C core's log only: parse them with the standard library now instead.
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        try:
            context.load_verify_locations(cadata=ca.decode("ascii", errors="replace"))
        except ssl.SSLError as e:
            raise TlsConfigError(f"{CA_KEY}: {ca_path} holds no valid CA certificate: {e.reason or e}") from None
        try:
            context.load_cert_chain(cert_path, key_path, password=_no_password)
        except ssl.SSLError as e:
            if e.reason == "KEY_VALUES_MISMATCH":
                raise TlsConfigError(f"{KEY_KEY}: the key in {key_path} does not belong to the certificate in {cert_path}") from None
            raise TlsConfigError(f"{CERT_KEY} / {KEY_KEY}: {cert_path} and {key_path} are not a valid certificate and "
                                 f"private key: {e.reason or e}") from None
        return cls(root_certificates=ca, certificate_chain=cert, private_key=key)

    def server_credentials(self) -> grpc.ServerCredentials:
        """TLS with a client certificate signed by the CA bundle required of every connection."""
        return grpc.ssl_server_credentials([(self.private_key, self.certificate_chain)],
                                           root_certificates=self.root_certificates, require_client_auth=True)

    def channel_credentials(self) -> grpc.ChannelCredentials:
        """TLS verifying the server against the CA bundle, presenting this process's certificate."""
        return grpc.ssl_channel_credentials(self.root_certificates, self.private_key, self.certificate_chain)


def load_tls(rpc: RpcSection) -> TlsCredentials | None:
    """The credentials of the `rpc` section's TLS files; None when they are not set (plaintext)."""
    if not rpc.tls_ca_path:  # the section checks that the three come together
        return None
    return TlsCredentials.from_files(ca_path=rpc.tls_ca_path, cert_path=rpc.tls_cert_path, key_path=rpc.tls_key_path)


def add_port(server: grpc.Server | grpc.aio.Server, bind: str, tls: TlsCredentials | None) -> int:
    """Listen on `bind` (host:port; port 0 = a free one) with mutual TLS, or plaintext when `tls`
    is None; the bound port, 0 if it could not be bound."""
    if tls is None:
        return server.add_insecure_port(bind)
    return server.add_secure_port(bind, tls.server_credentials())


def open_channel(address: str, tls: TlsCredentials | None, *, options: list[tuple[str, int | str]] | None = None) -> grpc.Channel:
    """A channel to `address` with mutual TLS, or plaintext when `tls` is None."""
    if tls is None:
        return grpc.insecure_channel(address, options=options)
    return grpc.secure_channel(address, tls.channel_credentials(), options=options)
