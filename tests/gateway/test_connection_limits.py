"""The gateway's HTTP connection limits (gateway/connection_limits.py), with raw sockets against a
real uvicorn server: the embedded gateway on the tiny random model.

Specification: a connection that sends nothing is closed after the header timeout; a client that
trickles its headers, or its body, gets 408 with OpenAI's error body and is cut off; headers over
`max_header_bytes` get 431 (400 while still arriving), a request that is not HTTP 400, with that
body; an idle
kept-alive connection is closed after the keep-alive timeout; beyond `max_connections` a request
is answered 503 (OpenAI's error body, `connection: close`) at once, but for the probes (/live,
/health), and a generation already streaming meanwhile (while a body over the size limit is also
refused, 413) completes with exactly the tokens it would have had alone; slots come back when
connections close. A client that opens a stream and never reads it is cut off once the server's
write buffer has stayed full for `slow_reader_timeout_s`: its generation is cancelled before it
ends and its slots (connection, per-key concurrency) come back, while another client is served
meanwhile. The limits come from the serving configuration's gateway section.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import socket
import threading
import time

import httpx
import pytest
import uvicorn

from dspark.drafters.ngram import NgramDrafter
from dspark.engine.async_engine import AsyncEngine
from dspark.engine.speculative import SpeculativeEngine
from dspark.serving_config import GatewaySection, ServingConfig
from gateway.api_keys import ApiKeys
from gateway.connection_limits import uvicorn_config
from gateway.openai_schema import ErrorResponse
from gateway.rate_limit import MemoryRateLimiter, RateLimits
from gateway.server import embedded_gateway
from tests.conftest import make_tiny_runtime
from tests.gateway.conftest import ByteTokenizer
from tests.polling import wait_until

MODEL = "tiny-random"
LIMITS = GatewaySection(max_connections=8, header_timeout_s=0.5, body_timeout_s=1.0, keep_alive_timeout_s=1.0)
SLACK_S = 3.0  # a loaded 2-core machine may be late by this much; never early


@pytest.fixture(scope="module")
def gateway():
    """The embedded gateway; each engine step sleeps 5 ms, so that a 200-token stream lasts about a second."""
    spec = SpeculativeEngine(make_tiny_runtime(), NgramDrafter(), num_speculative_tokens=3)
    step = spec.step

    def slow_step():
        time.sleep(0.005)
        return step()

    spec.step = slow_step
    engine = AsyncEngine(spec, idle_poll_s=0.01).start()
    gateway = embedded_gateway(engine, ByteTokenizer(), model_name=MODEL, max_tokens_limit=256)
    yield gateway
    gateway.close()
    engine.shutdown()


@contextlib.contextmanager
def limited_server(app, limits: GatewaySection):
    """`app` behind a real uvicorn server with `limits`, on a free port; yields (server, port)."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn_config(app, limits=limits, host="127.0.0.1", port=sock.getsockname()[1],
                                           log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    assert wait_until(lambda: server.started, timeout=20), "uvicorn did not start"
    try:
        yield server, sock.getsockname()[1]
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()


def connect(port: int) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    sock.settimeout(10)
    return sock


def read_response(sock: socket.socket) -> tuple[int, dict[str, str], bytes]:
    """One HTTP/1.1 response with a content-length body: (status, headers, body)."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionError(f"closed before a full response: {data!r}")
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    while len(body) < int(headers.get("content-length", 0)):
        body += sock.recv(65536)
    return int(lines[0].split()[1]), headers, body


def closed_by_server(sock: socket.socket) -> bool:
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


def trickle(sock: socket.socket, data: bytes) -> bytes:
    """Send `data` a byte at a time, as a slow client would, until the server answers or cuts the
    connection off: what it answered (b"" if nothing)."""
    sock.settimeout(0.1)
    for byte in data:
        try:
            sock.sendall(bytes([byte]))
            return sock.recv(65536)
        except TimeoutError:
            continue
        except (BrokenPipeError, ConnectionResetError):
            break
    return b""


def assert_error_body(body: bytes, code: str) -> None:
    assert ErrorResponse.model_validate(json.loads(body)).error.code == code


def test_the_limits_are_the_serving_configurations_gateway_section():
    config = ServingConfig.load(env={"DSPARK_GATEWAY_MAX_CONNECTIONS": "64", "DSPARK_GATEWAY_HEADER_TIMEOUT_S": "2.5"})
    limits = config.gateway
    assert (limits.max_connections, limits.header_timeout_s) == (64, 2.5)
    uv = uvicorn_config(object(), limits=limits)
    assert (uv.host, uv.port) == (limits.host, limits.port)
    assert uv.timeout_keep_alive == limits.keep_alive_timeout_s and uv.h11_max_incomplete_event_size == limits.max_header_bytes
    with pytest.raises(ValueError, match="gateway.body_timeout_s must be > 0"):
        GatewaySection(body_timeout_s=0)
    assert ServingConfig.load(env={"DSPARK_GATEWAY_SLOW_READER_TIMEOUT_S": "12"}).gateway.slow_reader_timeout_s == 12.0
    with pytest.raises(ValueError, match="gateway.slow_reader_timeout_s must be > 0"):
        GatewaySection(slow_reader_timeout_s=-1)


def test_a_silent_connection_is_closed_after_the_header_timeout_and_an_idle_one_after_keep_alive(gateway):
    with limited_server(gateway.app, LIMITS) as (_, port):
        silent, kept = connect(port), connect(port)
        t0 = time.monotonic()
        kept.sendall(b"GET /live HTTP/1.1\r\nHost: t\r\n\r\n")
        status, _, body = read_response(kept)
        assert status == 200 and json.loads(body) == {"status": "ok"}
        assert closed_by_server(silent)  # nothing was asked: closed without a response
        assert LIMITS.header_timeout_s * 0.9 <= time.monotonic() - t0 <= LIMITS.header_timeout_s + SLACK_S
        assert closed_by_server(kept)
        assert LIMITS.keep_alive_timeout_s * 0.9 <= time.monotonic() - t0 <= LIMITS.keep_alive_timeout_s + SLACK_S


def test_a_client_trickling_its_headers_gets_408_and_is_cut_off(gateway):
    with limited_server(gateway.app, LIMITS) as (_, port):
        sock, t0 = connect(port), time.monotonic()
        response = trickle(sock, b"GET /v1/models HTTP/1.1\r\nHost: t\r\nX-Slow: " + b"z" * 200)
        elapsed = time.monotonic() - t0
        assert LIMITS.header_timeout_s * 0.9 <= elapsed <= LIMITS.header_timeout_s + SLACK_S
        assert response.startswith(b"HTTP/1.1 408"), response
        assert_error_body(response.partition(b"\r\n\r\n")[2], "request_timeout")


@pytest.mark.parametrize(("request_bytes", "status", "code"), [
    (b"GET /live HTTP/1.1\r\nHost: t\r\nX-Big: " + b"z" * 20_000 + b"\r\n\r\n", 431, "request_header_fields_too_large"),
    (b"GET /live HTTP/1.1\r\nHost: t\r\n" + b"X-Many: z\r\n" * 1500, 400, "invalid_http_request"),  # too big unfinished
    (b"NOT HTTP AT ALL\r\n\r\n", 400, "invalid_http_request"),
])
def test_headers_over_the_limit_or_malformed_get_4xx_with_the_error_body(gateway, request_bytes, status, code):
    with limited_server(gateway.app, LIMITS) as (_, port):
        sock = connect(port)
        sock.sendall(request_bytes)
        got, headers, body = read_response(sock)
        assert got == status and headers["connection"] == "close"
        assert_error_body(body, code)
        assert closed_by_server(sock)


def test_a_client_trickling_its_body_gets_408_and_the_server_keeps_serving(gateway):
    body = json.dumps({"model": MODEL, "prompt": "hello", "max_tokens": 4}).encode()
    with limited_server(gateway.app, LIMITS) as (_, port):
        sock = connect(port)
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: t\r\ncontent-type: application/json\r\n"
                     b"content-length: %d\r\n\r\n" % len(body))
        t0 = time.monotonic()
        response = trickle(sock, body)
        elapsed = time.monotonic() - t0
        assert LIMITS.body_timeout_s * 0.9 <= elapsed <= LIMITS.body_timeout_s + SLACK_S
        assert response.startswith(b"HTTP/1.1 408"), response
        assert_error_body(response.partition(b"\r\n\r\n")[2], "request_timeout")
        # the same request sent at once is served
        fast = httpx.post(f"http://127.0.0.1:{port}/v1/completions", content=body,
                          headers={"content-type": "application/json"}, timeout=30)
        assert fast.status_code == 200 and fast.json()["usage"]["completion_tokens"] == 4


def test_a_flood_of_connections_and_an_oversized_body_are_refused_while_a_stream_completes_exactly(gateway):
    request = {"model": MODEL, "prompt": "The flood", "max_tokens": 200, "temperature": 0}
    flood_size = 3 * LIMITS.max_connections
    with limited_server(gateway.app, LIMITS) as (server, port):
        base = f"http://127.0.0.1:{port}"
        with httpx.Client(base_url=base, timeout=60) as client, \
                client.stream("POST", "/v1/completions", json={**request, "stream": True}) as stream:
            events = (line[len("data: "):] for line in stream.iter_lines() if line.startswith("data: "))
            streamed = [json.loads(next(events))]  # the generation runs: now the flood
            flood = [connect(port) for _ in range(flood_size)]
            probe = connect(port)  # beyond the cap too, but a probe is answered: a flood makes Kubernetes restart nothing
            assert wait_until(lambda: len(server.server_state.connections) == 2 + flood_size, timeout=10), "flood not accepted"
            for sock in flood:
                sock.sendall(b"GET /v1/models HTTP/1.1\r\nHost: t\r\n\r\n")
            probe.sendall(b"GET /live HTTP/1.1\r\nHost: t\r\n\r\n")
            answers = [read_response(sock) for sock in flood]
            assert read_response(probe)[0] == 200
            probe.close()
            for sock in flood:
                sock.close()
            oversized = httpx.post(base + "/v1/completions", content=b"x" * (2 << 20), headers={"content-type": "application/json"},
                                   timeout=30)  # and a body over the limit (1 MiB), meanwhile
            assert oversized.status_code == 413
            assert_error_body(oversized.content, "request_too_large")
            streamed += [json.loads(e) for e in events if e != "[DONE]"]
        served = [a for a in answers if a[0] == 200]
        refused = [a for a in answers if a[0] == 503]
        assert len(served) == LIMITS.max_connections - 1  # the stream holds one slot
        assert len(refused) == flood_size - len(served)
        for _, headers, body in refused:
            assert headers["connection"] == "close" and headers["retry-after"] == "1"
            assert_error_body(body, "too_many_connections")
        # the stream finished normally, with the text of the same request served alone
        text = "".join(c["choices"][0]["text"] for c in streamed if c["choices"])
        assert streamed[-1]["usage"] is None and [c["choices"][0]["finish_reason"] for c in streamed if c["choices"]][-1] == "length"
        alone = httpx.post(base + "/v1/completions", json=request, timeout=60).json()
        assert text == alone["choices"][0]["text"] and alone["usage"]["completion_tokens"] == 200
        # every slot came back
        assert wait_until(lambda: len(server.server_state.connections) == 0, timeout=10), "connections left open"
        answers = [httpx.get(base + "/live", timeout=10).status_code for _ in range(LIMITS.max_connections)]
        assert answers == [200] * LIMITS.max_connections


# ---- slow readers -------------------------------------------------------------------------------


class WideTokenizer(ByteTokenizer):
    """ByteTokenizer whose every token is TOKEN_CHARS characters of text: a few dozen tokens fill
    the server's socket and transport buffers, long before a generation ends."""

    TOKEN_CHARS = 4096

    def decode(self, token_ids: list[int], *, skip_special_tokens: bool = True) -> str:
        return "".join(chr(0x41 + t % 26) * self.TOKEN_CHARS for t in token_ids)


SLOW_KEY, OTHER_KEY = "key-of-the-slow-reader", "key-of-another-client"
STALLED_MAX_TOKENS = 480  # at >= 10 ms a step, at least 4.8 s to finish by itself


@pytest.fixture(scope="module")
def wide_gateway():
    """The embedded gateway on WideTokenizer, each engine step 10 ms or more; API keys, one request
    in flight per key."""
    spec = SpeculativeEngine(make_tiny_runtime(), NgramDrafter(), num_speculative_tokens=3)
    step = spec.step

    def slow_step():
        time.sleep(0.01)
        return step()

    spec.step = slow_step
    engine = AsyncEngine(spec, idle_poll_s=0.01).start()
    gateway = embedded_gateway(engine, WideTokenizer(), model_name=MODEL, max_tokens_limit=STALLED_MAX_TOKENS,
                               api_keys=ApiKeys.from_entries([SLOW_KEY, OTHER_KEY]),
                               rate_limiter=MemoryRateLimiter(RateLimits(max_concurrent=1)))
    yield gateway
    gateway.close()
    engine.shutdown()


def test_a_client_that_never_reads_its_stream_is_cut_off_and_its_request_cancelled(wide_gateway):
    limits = dataclasses.replace(LIMITS, slow_reader_timeout_s=1.0)
    engine, bus = wide_gateway.engine, wide_gateway.bus
    cancelled: list[str] = []
    cancel = bus.cancel

    async def recording_cancel(request_id: str) -> None:
        cancelled.append(request_id)
        await cancel(request_id)

    bus.cancel = recording_cancel
    body = json.dumps({"model": MODEL, "prompt": "never read", "max_tokens": STALLED_MAX_TOKENS, "stream": True}).encode()
    emitted_before = engine.engine.counters.emitted_tokens
    try:
        with limited_server(wide_gateway.app, limits) as (server, port):
            base = f"http://127.0.0.1:{port}"
            slow = socket.socket()
            slow.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # a small window, and never read
            slow.connect(("127.0.0.1", port))
            slow.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: t\r\ncontent-type: application/json\r\n"
                         b"authorization: Bearer %s\r\ncontent-length: %d\r\n\r\n%s" % (SLOW_KEY.encode(), len(body), body))
            t0 = time.monotonic()
            assert wait_until(lambda: engine.num_running == 1, timeout=10), "the stalled request never ran"
            # it holds its key's one slot while it stalls; another client is served meanwhile
            small = {"model": MODEL, "prompt": "meanwhile", "max_tokens": 8}
            assert httpx.post(base + "/v1/completions", json=small, headers={"authorization": f"Bearer {SLOW_KEY}"},
                              timeout=30).status_code == 429
            other = httpx.post(base + "/v1/completions", json=small, headers={"authorization": f"Bearer {OTHER_KEY}"}, timeout=30)
            assert other.status_code == 200 and other.json()["usage"]["completion_tokens"] == 8
            # a few dozen tokens fill the buffers (a second or two); then slow_reader_timeout_s passes
            assert wait_until(lambda: cancelled, timeout=limits.slow_reader_timeout_s + 3.0 + SLACK_S), "never cancelled"
            elapsed = time.monotonic() - t0
            assert limits.slow_reader_timeout_s <= elapsed <= limits.slow_reader_timeout_s + 3.0 + SLACK_S
            assert cancelled[0].startswith("cmpl-")
            assert wait_until(lambda: engine.num_running == 0, timeout=10), "the engine still runs the stalled request"
            assert wait_until(lambda: len(server.server_state.connections) == 0, timeout=10), "the connection was not closed"
            # cut before it could end by itself: fewer tokens than it asked for were ever generated
            assert engine.engine.counters.emitted_tokens - emitted_before < STALLED_MAX_TOKENS
            # the key's slot came back
            again = httpx.post(base + "/v1/completions", json=small, headers={"authorization": f"Bearer {SLOW_KEY}"}, timeout=30)
            assert again.status_code == 200 and again.json()["usage"]["completion_tokens"] == 8
            received = b""
            with contextlib.suppress(OSError):  # what did arrive: a stream cut off mid-way, without [DONE]
                slow.settimeout(2)
                while chunk := slow.recv(1 << 16):
                    received += chunk
            assert received.startswith(b"HTTP/1.1 200") and b"data: {" in received and b"[DONE]" not in received
            slow.close()
    finally:
        bus.cancel = cancel
