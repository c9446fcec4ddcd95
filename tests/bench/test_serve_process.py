"""`dspark serve` per policy as a subprocess: the command line, waiting for /health, stopping.

Specification: policy `none` is served as plain decoding (no drafter); every other policy runs
the shared drafter with `--policy`; a started server is waited for until /health answers and
stopped afterwards; a server that exits, or never gets healthy, is an error quoting its log.
The processes here are real (a small HTTP server script), not the model server.
"""

from __future__ import annotations

import sys
import textwrap

import httpx
import pytest

from dspark.bench.serve_process import ServerSpec, free_port, running_server, serve_command

HEALTH_SERVER = textwrap.dedent("""
    import http.server, sys, time
    time.sleep(float(sys.argv[2]))  # a server that loads for a while first
    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if self.path == "/health" else 404)
            self.end_headers()
            self.wfile.write(b'{"status": "ok"}')
        def log_message(self, *a):
            pass
    print("listening", flush=True)
    http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
""")


def test_policy_none_is_plain_decoding_and_the_others_share_the_drafter():
    spec = ServerSpec(drafter="dspark", drafter_path="runs/d", gamma=5, sps_max_batch=32)
    none = serve_command("none", spec, port=8123)
    assert none[:4] == [sys.executable, "-m", "dspark.cli", "serve"]
    assert none[none.index("--drafter") + 1] == "none" and "--drafter-path" not in none
    assert none[none.index("--policy") + 1] == "none"  # the server's default policy (dspark) needs a drafter
    dspark = serve_command("dspark", spec, port=8123)
    assert dspark[dspark.index("--policy") + 1] == "dspark"
    assert dspark[dspark.index("--drafter") + 1] == "dspark" and dspark[dspark.index("--drafter-path") + 1] == "runs/d"
    assert dspark[dspark.index("--gamma") + 1] == "5" and dspark[dspark.index("--port") + 1] == "8123"
    assert dspark[dspark.index("--sps-max-batch") + 1] == "32" and "--kv-budget-mb" not in dspark


@pytest.mark.processes
def test_a_server_is_waited_for_until_healthy_and_stopped_after(tmp_path):
    script = tmp_path / "health_server.py"
    script.write_text(HEALTH_SERVER)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with running_server([sys.executable, str(script), str(port), "0.5"], url=url, log_path=tmp_path / "log.txt",
                        start_timeout_s=60) as got:
        assert got == url
        assert httpx.get(f"{url}/health").status_code == 200
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{url}/health", timeout=2)
    assert "listening" in (tmp_path / "log.txt").read_text()


@pytest.mark.processes
def test_a_server_that_exits_first_is_an_error_quoting_its_log(tmp_path):
    cmd = [sys.executable, "-c", "import sys; print('error: the dspark drafter needs a checkpoint'); sys.exit(2)"]
    with (pytest.raises(RuntimeError, match=r"(?s)exited with code 2.*needs a checkpoint"),
          running_server(cmd, url=f"http://127.0.0.1:{free_port()}", log_path=tmp_path / "log.txt", start_timeout_s=60)):
        pytest.fail("the body must not run")


@pytest.mark.processes
def test_a_server_that_never_gets_healthy_times_out_and_is_stopped(tmp_path):
    script = tmp_path / "health_server.py"
    script.write_text(HEALTH_SERVER)
    port = free_port()
    with (pytest.raises(TimeoutError, match="not healthy after 1 s"),
          running_server([sys.executable, str(script), str(port), "60"], url=f"http://127.0.0.1:{port}",
                         log_path=tmp_path / "log.txt", start_timeout_s=1)):
        pytest.fail("the body must not run")
