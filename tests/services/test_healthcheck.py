"""`dspark healthcheck` (services/healthcheck.py): the exec probe of the gRPC services under mutual TLS.

Specification: against a real drafter server that requires mutual TLS and the internal token,
`dspark healthcheck --target HOST:PORT` with the deployment's certificate in DSPARK_RPC_TLS_*
(what the pods have) exits 0 and prints SERVING, without sending the token (health is open to
token-less callers). Otherwise it exits 1 with one line on stderr that says why: the server
reports NOT_SERVING; no certificates configured (the server closes the plaintext connection);
a certificate of another CA; a server certificate that does not name --server-name; nothing
listening on the port; no answer within --timeout; a TLS file that does not exist. As a process
(what the kubelet runs) it writes exactly that one line (no gRPC log lines) and imports no torch.

The certificates are tests/services/test_grpc_tls.py's throwaway PKI (write_pki): the server's
names 127.0.0.1 and localhost.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import pytest

from dspark.cli import main
from dspark.drafters.ngram import NgramDrafter
from dspark.protos import DRAFTER_SERVICE
from services.drafter.server import start_drafter_server
from services.grpc_auth import generate_token
from tests.services.test_cli import ROOT, _free_ports
from tests.services.test_grpc_tls import Pki, write_pki

TOKEN = generate_token()


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> Pki:
    return write_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture
def tls_server(pki):
    """A drafter server requiring mutual TLS (certificate `server`: 127.0.0.1, localhost) and TOKEN."""
    server = start_drafter_server(NgramDrafter(), vocab_size=256, auth_token=TOKEN, tls=pki.credentials("server"))
    yield server
    server.stop(None)


def _configuration_env(monkeypatch, tls_env: dict[str, str]) -> None:
    """The process environment as a pod's: only the given DSPARK_RPC_TLS_* (no config file)."""
    for name in [n for n in os.environ if n.startswith("DSPARK_")]:
        monkeypatch.delenv(name)
    for name, value in tls_env.items():
        monkeypatch.setenv(name, value)


def healthcheck(monkeypatch, capsys, tls_env: dict[str, str], *args: str) -> tuple[int, str, str]:
    """`dspark healthcheck ARGS` in this process: (exit status, stdout, stderr)."""
    _configuration_env(monkeypatch, tls_env)
    status = main(["healthcheck", *args])
    out, err = capsys.readouterr()
    return status, out, err


def _one_line(text: str) -> str:
    assert text.endswith("\n") and text.count("\n") == 1, f"not one line: {text!r}"
    return text


# ---- served ------------------------------------------------------------------------------------


@pytest.mark.parametrize("certificate", ["service", "client"])  # one certificate per deployment, or a client's own
def test_exits_0_with_a_certificate_of_the_ca_and_no_token(monkeypatch, capsys, pki, tls_server, certificate):
    target = f"127.0.0.1:{tls_server.port}"
    status, out, err = healthcheck(monkeypatch, capsys, pki.rpc_env(certificate), "--target", target)
    assert (status, err) == (0, "") and _one_line(out) == f"{target}: SERVING\n"
    status, out, _ = healthcheck(monkeypatch, capsys, pki.rpc_env(certificate), "--target", target, "--service", DRAFTER_SERVICE)
    assert status == 0 and out == f"{DRAFTER_SERVICE} at {target}: SERVING\n"


def test_server_name_is_the_name_the_servers_certificate_must_carry(monkeypatch, capsys, pki, tls_server):
    target = f"127.0.0.1:{tls_server.port}"
    status, out, _ = healthcheck(monkeypatch, capsys, pki.rpc_env(), "--target", target, "--server-name", "localhost")
    assert status == 0 and out.endswith("SERVING\n")
    status, out, err = healthcheck(monkeypatch, capsys, pki.rpc_env(), "--target", target, "--server-name", "verifier")
    assert (status, out) == (1, "")
    assert _one_line(err).startswith(f"{target}: TLS handshake refused: the server's certificate does not name 'verifier'")


# ---- not served: exit 1 and why ----------------------------------------------------------------


def test_exits_1_when_the_server_reports_not_serving(monkeypatch, capsys, pki, tls_server):
    tls_server.set_serving(False)  # what a server does while it stops
    status, out, err = healthcheck(monkeypatch, capsys, pki.rpc_env(), "--target", f"127.0.0.1:{tls_server.port}")
    assert (status, out, err) == (1, "", f"127.0.0.1:{tls_server.port}: NOT_SERVING\n")


def test_exits_1_without_certificates_saying_that_the_server_may_require_mutual_tls(monkeypatch, capsys, tls_server):
    status, out, err = healthcheck(monkeypatch, capsys, {}, "--target", f"127.0.0.1:{tls_server.port}")
    assert (status, out) == (1, "")
    assert "the server closed the connection: it may require mutual TLS, and this check spoke plaintext" in _one_line(err)
    assert "DSPARK_RPC_TLS_*" in err


def test_exits_1_with_a_certificate_of_another_ca_saying_that_the_server_refused_it(monkeypatch, capsys, pki, tls_server):
    env = {**pki.rpc_env("other-client"), "DSPARK_RPC_TLS_CA_PATH": pki.path("ca.pem")}  # trusts the server, is not trusted
    status, _, err = healthcheck(monkeypatch, capsys, env, "--target", f"127.0.0.1:{tls_server.port}")
    assert status == 1 and "TLS handshake refused: the server closed the connection, refusing our certificate" in _one_line(err)


def test_exits_1_against_a_closed_port(monkeypatch, capsys, pki):
    (port,) = _free_ports(1)  # nothing listens there
    status, out, err = healthcheck(monkeypatch, capsys, pki.rpc_env(), "--target", f"127.0.0.1:{port}")
    assert (status, out) == (1, "")
    assert _one_line(err).startswith(f"127.0.0.1:{port}: unreachable: connection refused")


def test_exits_1_after_timeout_when_the_server_does_not_answer(monkeypatch, capsys, pki):
    with socket.socket() as silent:  # accepts connections (the kernel's backlog) and never speaks
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        target = f"127.0.0.1:{silent.getsockname()[1]}"
        start = time.monotonic()
        status, _, err = healthcheck(monkeypatch, capsys, pki.rpc_env(), "--target", target, "--timeout", "0.5")
        elapsed = time.monotonic() - start
    assert status == 1 and err == f"{target}: no answer within 0.5 s (timeout)\n"
    assert 0.4 <= elapsed < 5


def test_exits_1_when_a_tls_file_is_missing_naming_the_key(monkeypatch, capsys, pki, tmp_path, tls_server):
    env = {**pki.rpc_env(), "DSPARK_RPC_TLS_KEY_PATH": str(tmp_path / "nowhere.key")}
    status, _, err = healthcheck(monkeypatch, capsys, env, "--target", f"127.0.0.1:{tls_server.port}")
    assert status == 1 and err == f"error: rpc.tls_key_path: private key file {tmp_path / 'nowhere.key'} does not exist\n"


# ---- as the kubelet runs it: a process ---------------------------------------------------------


def _run(args: list[str], tls_env: dict[str, str], *, code: str | None = None) -> subprocess.CompletedProcess:
    env = {name: value for name, value in os.environ.items() if not name.startswith("DSPARK_")} | tls_env
    command = [sys.executable, "-c", code, *args] if code else [sys.executable, "-m", "dspark.cli", *args]
    return subprocess.run(command, check=False, cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)


@pytest.mark.processes
def test_the_process_exits_0_or_1_with_one_line_and_no_grpc_log_lines(pki, tls_server):
    target = f"127.0.0.1:{tls_server.port}"
    served = _run(["healthcheck", "--target", target], pki.rpc_env())
    assert (served.returncode, served.stdout, served.stderr) == (0, f"{target}: SERVING\n", "")
    # a refused handshake makes gRPC's C core log (GRPC_VERBOSITY), which would bury the reason
    refused = _run(["healthcheck", "--target", target, "--server-name", "verifier"], pki.rpc_env())
    assert refused.returncode == 1 and refused.stdout == ""
    assert _one_line(refused.stderr).startswith(f"{target}: TLS handshake refused")


@pytest.mark.processes
def test_the_process_imports_no_torch(pki, tls_server):
    code = ("import sys\nfrom dspark.cli import main\nstatus = main(sys.argv[1:])\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'numpy', 'transformers')))\nsys.exit(status)")
    result = _run(["healthcheck", "--target", f"127.0.0.1:{tls_server.port}"], pki.rpc_env(), code=code)
    assert result.returncode == 0 and result.stdout.splitlines()[-1] == "[]", result.stdout + result.stderr
