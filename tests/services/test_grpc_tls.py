"""Mutual TLS of the internal gRPC calls (services/grpc_tls.py), on the real servers.

Specification: with rpc.tls_ca_path / tls_cert_path / tls_key_path set (all three or none, from a
file or DSPARK_RPC_TLS_*), every service (verifier, drafter: thread-pool servers; scheduler:
grpc.aio) serves a client that presents a certificate of the deployment's CA, over TLS, with the
token still required on top; it refuses (UNAVAILABLE: the handshake fails) a client with no
certificate, with a certificate of another CA, and a plaintext client; a client refuses a server
whose certificate another CA signed. The Remote* clients, the scheduler's remote engine and `dspark
up`'s health wait all speak TLS from the configuration; `dspark up` with the three files (slow,
real processes) starts services that reach each other over TLS and serve only TLS clients. A missing, unreadable, non-PEM or
encrypted file, or a key that is not the certificate's, is a start-up error that names the key
and the file (`dspark <service>` exits 2 before loading anything).

The certificates are made here with `cryptography`: a throwaway CA, a server certificate for
127.0.0.1 / localhost, a client certificate, a "service" certificate for both roles (what one
certificate per deployment looks like), and a second CA with a client certificate of its own.
"""

from __future__ import annotations

import datetime
import ipaddress
import json
import os
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from dspark.drafters.ngram import NgramDrafter
from dspark.protos import SCHEDULER_SERVICE
from dspark.protos.dspark.v1 import common_pb2, drafter_pb2, drafter_pb2_grpc, scheduler_pb2, scheduler_pb2_grpc
from dspark.serving_config import ServingConfig
from services.drafter.client import RemoteDrafter
from services.grpc_auth import generate_token
from services.grpc_common import ServiceUnavailable, check_health, make_channel, wait_until_serving
from services.grpc_tls import TlsConfigError, TlsCredentials, load_tls
from services.verifier.client import RemoteVerifier
from tests.services.conftest import SERVICE_NAMES, calls_to_each_service, closing_all, health_reply, rpc_error, tiny_services

TOKEN = generate_token()
CALL_TIMEOUT_S = 10


# ---- a throwaway PKI ----------------------------------------------------------------------------


def _pem_key(key: ec.EllipticCurvePrivateKey, password: bytes | None = None) -> bytes:
    encryption = serialization.BestAvailableEncryption(password) if password else serialization.NoEncryption()
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, encryption)


def _certificate(subject: str, key, issuer: x509.Certificate | None, issuer_key, *, ca: bool, sans=(), usages=()) -> x509.Certificate:
    now = datetime.datetime.now(datetime.UTC)
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)])
    builder = (x509.CertificateBuilder().subject_name(name).issuer_name(issuer.subject if issuer else name)
               .public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
               .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if sans:
        builder = builder.add_extension(x509.SubjectAlternativeName(list(sans)), critical=False)
    if usages:
        builder = builder.add_extension(x509.ExtendedKeyUsage(list(usages)), critical=False)
    if ca:
        builder = builder.add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True, content_commitment=False,
                                                      key_encipherment=False, data_encipherment=False, key_agreement=False,
                                                      encipher_only=False, decipher_only=False), critical=True)
    return builder.sign(issuer_key or key, hashes.SHA256())


@dataclass(frozen=True)
class Pki:
    """PEM files in one directory: ca.pem; server.pem/.key (127.0.0.1, localhost); client.pem/.key;
    service.pem/.key (server and client, 127.0.0.1 / localhost); other-ca.pem and
    other-client.pem/.key (another CA's)."""

    directory: Path

    def path(self, name: str) -> str:
        return str(self.directory / name)

    def credentials(self, cert: str, ca: str = "ca.pem") -> TlsCredentials:
        return TlsCredentials.from_files(ca_path=self.path(ca), cert_path=self.path(f"{cert}.pem"), key_path=self.path(f"{cert}.key"))

    def rpc_env(self, cert: str = "client") -> dict[str, str]:
        return {"DSPARK_RPC_TLS_CA_PATH": self.path("ca.pem"), "DSPARK_RPC_TLS_CERT_PATH": self.path(f"{cert}.pem"),
                "DSPARK_RPC_TLS_KEY_PATH": self.path(f"{cert}.key")}


def write_pki(directory: Path) -> Pki:
    def write(name: str, data: bytes) -> None:
        (directory / name).write_bytes(data)

    server_names = [x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")]
    roles = {"server": [ExtendedKeyUsageOID.SERVER_AUTH], "service": [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]}
    for ca_name, issued in (("ca", ("server", "client", "service")), ("other-ca", ("other-client",))):
        ca_key = ec.generate_private_key(ec.SECP256R1())
        ca_cert = _certificate(f"dspark test {ca_name}", ca_key, None, None, ca=True)
        write(f"{ca_name}.pem", ca_cert.public_bytes(serialization.Encoding.PEM))
        for name in issued:
            key = ec.generate_private_key(ec.SECP256R1())
            usages = roles.get(name, [ExtendedKeyUsageOID.CLIENT_AUTH])
            cert = _certificate(name, key, ca_cert, ca_key, ca=False, sans=server_names if name in roles else (), usages=usages)
            write(f"{name}.pem", cert.public_bytes(serialization.Encoding.PEM))
            write(f"{name}.key", _pem_key(key))
    return Pki(directory)


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> Pki:
    return write_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture
def tls_servers(tiny_runtime_factory, pki):
    """(verifier, drafter, scheduler) addresses, each requiring mutual TLS and TOKEN."""
    with tiny_services(tiny_runtime_factory(kv_budget_tokens=100), NgramDrafter(), auth_token=TOKEN,
                       tls=pki.credentials("server")) as addresses:
        yield addresses


def _calls(channels):
    """A unary call on each service, and the scheduler's server-streaming Submit."""
    calls = calls_to_each_service(channels, request_id="tls", timeout=CALL_TIMEOUT_S)
    return [calls["Verifier.GetInfo"], calls["Drafter.GetInfo"], calls["Scheduler.Submit"]]


def _code(call) -> grpc.StatusCode:
    return rpc_error(call)[0]


# ---- served and refused ------------------------------------------------------------------------


def test_a_client_with_a_certificate_of_the_ca_and_the_token_is_served_by_every_service(tls_servers, pki):
    with closing_all([make_channel(address, auth_token=TOKEN, tls=pki.credentials("client"))
                      for address in tls_servers]) as channels:
        verifier_info, drafter_info, outputs = (call() for call in _calls(channels))
        assert verifier_info.vocab_size == 256 and drafter_info.name == "ngram"
        assert outputs[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH and sum(len(o.new_token_ids) for o in outputs) == 2
        for channel, service in zip(channels, SERVICE_NAMES):
            assert check_health(channel, service)


def test_the_token_is_still_required_over_tls(tls_servers, pki):
    with closing_all([make_channel(address, tls=pki.credentials("client")) for address in tls_servers]) as channels:
        assert [_code(call) for call in _calls(channels)] == [grpc.StatusCode.UNAUTHENTICATED] * 3


def _without_certificate(address: str, pki: Pki) -> grpc.Channel:
    """TLS that trusts the server but presents no client certificate."""
    return grpc.secure_channel(address, grpc.ssl_channel_credentials(Path(pki.path("ca.pem")).read_bytes()))


def _other_cas_certificate(address: str, pki: Pki) -> grpc.Channel:
    """TLS that trusts the server, presenting a client certificate that another CA signed."""
    return grpc.secure_channel(address, grpc.ssl_channel_credentials(
        Path(pki.path("ca.pem")).read_bytes(), Path(pki.path("other-client.key")).read_bytes(),
        Path(pki.path("other-client.pem")).read_bytes()))


def _plaintext(address: str, pki: Pki) -> grpc.Channel:
    return grpc.insecure_channel(address)


@pytest.mark.parametrize("open_channel", [_without_certificate, _other_cas_certificate, _plaintext])
def test_a_client_without_a_certificate_of_the_ca_is_refused_by_every_service_even_for_health(tls_servers, pki, open_channel):
    with closing_all([open_channel(address, pki) for address in tls_servers]) as channels:
        for call in _calls(channels):
            assert _code(call) == grpc.StatusCode.UNAVAILABLE  # the handshake fails: no call reaches a servicer
        for channel in channels:
            assert _code(lambda c=channel: health_reply(c, timeout=CALL_TIMEOUT_S)) == grpc.StatusCode.UNAVAILABLE


def test_a_client_refuses_a_server_whose_certificate_another_ca_signed(tls_servers, pki):
    distrustful = pki.credentials("client", ca="other-ca.pem")  # trusts only the other CA
    with make_channel(tls_servers[1], auth_token=TOKEN, tls=distrustful) as channel:
        code = _code(lambda: drafter_pb2_grpc.DrafterStub(channel).GetInfo(drafter_pb2.GetDrafterInfoRequest(), timeout=CALL_TIMEOUT_S))
    assert code == grpc.StatusCode.UNAVAILABLE


def test_the_remote_clients_and_the_scheduler_engine_speak_tls_from_the_configuration(tls_servers, pki):
    from services.scheduler.server import build_remote_speculative_engine

    verifier_address, drafter_address, scheduler_address = tls_servers
    config = ServingConfig.load(env={**pki.rpc_env(), "DSPARK_RPC_AUTH_TOKEN": TOKEN, "DSPARK_VERIFIER_ADDRESS": verifier_address,
                                     "DSPARK_DRAFTER_ADDRESS": drafter_address, "DSPARK_DRAFTER_NAME": "ngram",
                                     "DSPARK_SCHEDULER_POLICY": "", "DSPARK_RPC_CONNECT_TIMEOUT_S": "20"})
    tls = load_tls(config.rpc)
    assert RemoteVerifier(verifier_address, auth_token=TOKEN, tls=tls).vocab_size == 256
    assert RemoteDrafter(drafter_address, auth_token=TOKEN, tls=tls).spec.name == "ngram"
    engine = build_remote_speculative_engine(config)  # what `dspark scheduler` dials with
    assert engine.verifier.vocab_size == engine.drafter.vocab_size == 256
    wait_until_serving(scheduler_address, SCHEDULER_SERVICE, timeout=CALL_TIMEOUT_S, tls=tls)  # what `dspark up` waits with
    with pytest.raises(ServiceUnavailable, match="not reachable"):  # without the certificate: never ready
        RemoteDrafter(drafter_address, auth_token=TOKEN, connect_timeout_s=2)


# ---- configuration and bad files ---------------------------------------------------------------


def test_the_three_files_come_from_the_environment_together_or_not_at_all(pki):
    rpc = ServingConfig.load(env=pki.rpc_env()).rpc
    assert (rpc.tls_ca_path, rpc.tls_cert_path, rpc.tls_key_path) == (pki.path("ca.pem"), pki.path("client.pem"), pki.path("client.key"))
    assert load_tls(ServingConfig().rpc) is None  # default: plaintext
    partial = {k: v for k, v in pki.rpc_env().items() if k != "DSPARK_RPC_TLS_KEY_PATH"}
    with pytest.raises(ValueError, match=r"set all three or none, got only \['rpc.tls_ca_path', 'rpc.tls_cert_path'\]"):
        ServingConfig.load(env=partial)


def test_bad_files_are_start_up_errors_that_name_the_key_and_the_file(pki, tmp_path):
    def load(**paths) -> str:
        files = {"ca_path": pki.path("ca.pem"), "cert_path": pki.path("client.pem"), "key_path": pki.path("client.key"), **paths}
        with pytest.raises(TlsConfigError) as info:
            TlsCredentials.from_files(**files)
        return str(info.value)

    missing = str(tmp_path / "missing.pem")
    assert load(ca_path=missing) == f"rpc.tls_ca_path: CA certificate file {missing} does not exist"
    assert load(cert_path=str(tmp_path)) == f"rpc.tls_cert_path: {tmp_path} is a directory, not the certificate file"
    (tmp_path / "junk.pem").write_text("not a certificate\n")
    assert "rpc.tls_key_path" in load(key_path=str(tmp_path / "junk.pem")) and "is not a PEM private key" in load(key_path=str(tmp_path / "junk.pem"))
    (tmp_path / "broken.pem").write_text("-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n")
    assert load(ca_path=str(tmp_path / "broken.pem")).startswith(f"rpc.tls_ca_path: {tmp_path / 'broken.pem'} holds no valid CA certificate")
    assert load(key_path=pki.path("server.key")) == (f"rpc.tls_key_path: the key in {pki.path('server.key')} does not belong to "
                                                     f"the certificate in {pki.path('client.pem')}")
    from cryptography.hazmat.primitives.serialization import load_pem_private_key

    key = load_pem_private_key(Path(pki.path("client.key")).read_bytes(), password=None)
    (tmp_path / "encrypted.key").write_bytes(_pem_key(key, password=b"secret"))
    assert "the private key is encrypted" in load(key_path=str(tmp_path / "encrypted.key"))
    if os.geteuid() != 0:  # root reads any file
        (tmp_path / "unreadable.key").write_bytes(Path(pki.path("client.key")).read_bytes())
        (tmp_path / "unreadable.key").chmod(0)
        assert "cannot be read: Permission denied" in load(key_path=str(tmp_path / "unreadable.key"))


def test_a_service_with_a_missing_tls_file_exits_with_the_message_before_loading_anything(monkeypatch, capsys, pki, tmp_path):
    from dspark.cli import main

    env = {**pki.rpc_env("server"), "DSPARK_RPC_TLS_KEY_PATH": str(tmp_path / "nowhere.key")}
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert main(["drafter"]) == 2
    assert f"rpc.tls_key_path: private key file {tmp_path / 'nowhere.key'} does not exist" in capsys.readouterr().err


# ---- dspark up: real processes -------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.processes
def test_up_with_the_tls_files_runs_every_call_over_mutual_tls(tiny_model_dir, pki):
    from tests.services.test_cli import ROOT, _free_ports

    scheduler_port, drafter_port, verifier_port, gateway_port = _free_ports(4)
    env = {**os.environ, **pki.rpc_env("service"), "DSPARK_SCHEDULER_PORT": str(scheduler_port), "DSPARK_DRAFTER_PORT": str(drafter_port),
           "DSPARK_VERIFIER_PORT": str(verifier_port), "DSPARK_GATEWAY_PORT": str(gateway_port), "DSPARK_REDIS_URL": "",
           "DSPARK_RPC_AUTH_TOKEN": TOKEN}
    cmd = [sys.executable, "-m", "dspark.cli", "up", "--model", str(tiny_model_dir), "--drafter", "ngram", "--policy", "fixed:4",
           "--gamma", "4", "--sps-max-batch", "0", "--log-level", "warning"]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True)
    try:
        ready: dict = {}
        reader = threading.Thread(target=lambda: ready.update(json.loads(proc.stdout.readline() or "{}")), daemon=True)
        reader.start()
        reader.join(300)
        # `up` saw each service SERVING over TLS, and the scheduler reached verifier and drafter over TLS
        assert set(ready.get("ready", {})) == {"verifier", "drafter", "scheduler"}, f"not ready: {ready}, exit {proc.poll()}"
        address = f"127.0.0.1:{scheduler_port}"
        request = scheduler_pb2.GenerationRequest(request_id="up-tls", prompt_ids=[5, 6, 7, 8], max_new_tokens=6,
                                                  params=common_pb2.SamplingParams(temperature=0.0, top_p=1.0))
        with make_channel(address, auth_token=TOKEN, tls=pki.credentials("client")) as channel:
            outputs = list(scheduler_pb2_grpc.SchedulerStub(channel).Submit(request, timeout=120))
        assert sum(len(o.new_token_ids) for o in outputs) == 6
        for port in (scheduler_port, drafter_port, verifier_port):
            with make_channel(f"127.0.0.1:{port}", auth_token=TOKEN) as plaintext:
                assert _code(lambda c=plaintext: health_reply(c, timeout=CALL_TIMEOUT_S)) == grpc.StatusCode.UNAVAILABLE
        proc.send_signal(signal.SIGINT)
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
