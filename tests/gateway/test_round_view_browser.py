"""The round view in a real browser: headless Chromium (Debian's) driven by Playwright.

Specification: on the tiny random model behind the embedded server (the project's uvicorn
configuration), a prompt sent from the page's box decodes beside other requests, and the tokens
the page shows as the request's output (accepted drafts, corrections, bonus tokens, in order) are
exactly the API's answer to the same greedy request, and the page's own streamed answer; the
request's numbers on the page (rounds, drafts verified, accepted, τ, tokens) are the engine's
statistics in that answer; every row of the page's rounds table is the engine's round event of
that id (R, B, Σℓ, accepted, emitted, Θ, why Algorithm 1 stopped) and the SPS panel describes the
last scheduled round; with API keys the page asks for the key and works with it; when the server
restarts the page reconnects by itself and keeps working. One slow test does the first on the
real default model. Skipped where Playwright or /usr/bin/chromium is missing (.ci/run installs it).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import socket
import threading
import time

import httpx
import pytest

from dspark.drafters.ngram import NgramDrafter
from dspark.engine.async_engine import AsyncEngine
from dspark.engine.speculative import SpeculativeEngine
from dspark.observability.round_feed import RoundEvent
from dspark.profiling.sps import SPSProfile
from dspark.scheduling.draft_gate import DraftGate
from dspark.scheduling.policies import parse_policy
from dspark.serving_config import GatewaySection
from gateway.connection_limits import uvicorn_config
from gateway.server import embedded_gateway
from tests.conftest import make_tiny_runtime
from tests.drafters.test_dspark_serving import make_serving_drafter
from tests.gateway.conftest import ByteTokenizer

pytestmark = [pytest.mark.browser, pytest.mark.processes]  # Chromium and Playwright's driver are processes

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
MODEL = "tiny-random"
KEY = "sk-browser-test"
PROMPT = "abcabcabcabc"  # the n-gram drafter finds matches in it
# A verifier whose step time grows slowly with B: Algorithm 1 admits some drafts and breaks.
PROFILE = SPSProfile(batch_sizes=[1, 4, 8, 16, 64], step_seconds=[0.010, 0.011, 0.013, 0.020, 0.080])
TIMEOUT_MS = 60_000


@pytest.fixture(scope="module")
def browser():
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed (the test extras)")
    if not os.path.exists(CHROMIUM):
        pytest.skip(f"no Chromium at {CHROMIUM} (apt-get install chromium)")
    with sync_api.sync_playwright() as p:
        # --no-sandbox: CI runs as root, where Chromium's sandbox refuses to start
        b = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        yield b
        b.close()


def ngram_engine() -> SpeculativeEngine:
    return SpeculativeEngine(make_tiny_runtime(), NgramDrafter(), num_speculative_tokens=3)


def dspark_engine() -> SpeculativeEngine:
    runtime = make_tiny_runtime(capture_layers=(1, 3))
    engine = SpeculativeEngine(runtime, make_serving_drafter(runtime), num_speculative_tokens=4, policy=parse_policy("dspark"))
    engine.sps_profile = PROFILE
    # the page must show rounds Algorithm 1 ran on: a random drafter never pays on the tiny model,
    # and a 1 % probe budget would leave it a handful of probes, so the gate keeps only its back-off
    engine.draft_gate = DraftGate(probe_budget=None)
    return engine


class Server:
    """The embedded server (engine, in-memory bus, worker, gateway) under uvicorn as `dspark serve`
    configures it, on a port it can be started on again."""

    def __init__(self, make_engine, *, port: int | None = None, step_delay_s: float = 0.0, **gateway_kwargs):
        self.make_engine, self.step_delay_s, self.gateway_kwargs = make_engine, step_delay_s, gateway_kwargs
        self.port = port or _free_port()
        self.url = f"http://127.0.0.1:{self.port}"

    def start(self) -> Server:
        import uvicorn

        spec = self.make_engine()
        if self.step_delay_s:  # slower rounds: requests overlap, the page has time to watch
            step = spec.step
            spec.step = lambda: (time.sleep(self.step_delay_s), step())[1]
        self.engine = AsyncEngine(spec, idle_poll_s=0.01).start()
        self.gateway = embedded_gateway(self.engine, ByteTokenizer(), model_name=MODEL, max_tokens_limit=512,
                                        **self.gateway_kwargs)
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # the same port again after a stop
        self.sock.bind(("127.0.0.1", self.port))
        config = uvicorn_config(self.gateway.app, limits=GatewaySection(), host="127.0.0.1", port=self.port,
                                log_level="warning", lifespan="off")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "uvicorn did not start"
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(20)
        assert not self.thread.is_alive(), "the server did not shut down (an open page must not hold it)"
        self.sock.close()
        self.gateway.close()
        self.engine.shutdown()

    def __enter__(self) -> Server:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def chat(url: str, content: str, max_tokens: int, *, headers: dict | None = None) -> dict:
    r = httpx.post(f"{url}/v1/chat/completions", headers=headers, timeout=120, json={
        "model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens, "temperature": 0})
    assert r.status_code == 200, r.text
    return r.json()


@contextlib.contextmanager
def busy(url: str, count: int, max_tokens: int):
    """`count` greedy requests decoding in the background (other users)."""
    threads = [threading.Thread(target=chat, args=(url, f"{PROMPT} user {i}", max_tokens), daemon=True) for i in range(count)]
    for t in threads:
        t.start()
    try:
        yield
    finally:
        for t in threads:
            t.join(120)


def open_page(browser, url: str):
    page = browser.new_page(viewport={"width": 1500, "height": 1100})
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.errors = errors
    page.goto(f"{url}/ui")
    return page


def wait_live(page) -> None:
    """The stream is open and the engine's relay has announced itself: rounds reach the page from now on."""
    page.wait_for_selector('#status[data-state="live"]', timeout=TIMEOUT_MS)
    page.wait_for_function("document.getElementById('sources').textContent.includes('embedded')", timeout=TIMEOUT_MS)


def send_from_page(page, prompt: str, max_tokens: int) -> str:
    """Type a greedy request into the page's box, send it, wait for its answer; its request id."""
    page.fill("#prompt", prompt)
    page.fill("#temperature", "0")
    page.fill("#max-tokens", str(max_tokens))
    page.click("#send")
    page.wait_for_selector("#answer[data-finish]", timeout=TIMEOUT_MS)
    rid = page.get_attribute("#answer", "data-request-id")
    page.wait_for_function(  # its final round has reached the page too
        "rid => { const c = document.querySelector(`.card[data-request-id=\"${rid}\"] [data-stat=state]`);"
        " return c && c.textContent.startsWith('finished'); }", arg=rid, timeout=TIMEOUT_MS)
    return rid


def shown_output(page, rid: str) -> list[tuple[str, str]]:
    """(kind, text) of every output token the page shows for the request, in order."""
    return page.eval_on_selector_all(f'.card[data-request-id="{rid}"] .transcript .tok',
                                     "els => els.map(e => [e.dataset.kind, e.textContent])")


def shown_stats(page, rid: str) -> dict[str, str]:
    return page.eval_on_selector_all(f'.card[data-request-id="{rid}"] [data-stat]',
                                     "els => Object.fromEntries(els.map(e => [e.dataset.stat, e.textContent]))")


def check_request_against_the_api(page, rid: str, url: str, prompt: str, max_tokens: int, headers: dict | None = None):
    output = shown_output(page, rid)
    kinds = [k for k, _ in output]
    api = chat(url, prompt, max_tokens, headers=headers)  # the same greedy request, through the API
    text = api["choices"][0]["message"]["content"]
    assert "".join(t for _, t in output) == text == page.inner_text("#answer-text")
    assert kinds[0] == "prefill" and kinds.count("prefill") == 1 and set(kinds) <= {"prefill", "accepted", "corrected", "bonus"}
    assert len(output) == api["usage"]["completion_tokens"] == max_tokens
    spec, stats = api["speculative"], shown_stats(page, rid)
    assert (int(stats["rounds"]), int(stats["verified"]), int(stats["accepted"]), int(stats["tokens"])) == (
        spec["rounds"], spec["draft_tokens"], spec["accepted_tokens"], api["usage"]["completion_tokens"])
    assert float(stats["tau"]) == pytest.approx(spec["mean_accepted_length"], abs=5e-4)
    assert kinds.count("accepted") == spec["accepted_tokens"] > 0  # not vacuous: the page showed accepted drafts
    answer = page.eval_on_selector("#answer-stats", "e => ({...e.dataset})")  # what the page's own answer said
    assert (int(answer["rounds"]), int(answer["draftTokens"]), int(answer["acceptedTokens"])) == (
        spec["rounds"], spec["draft_tokens"], spec["accepted_tokens"])


def test_the_page_shows_as_accepted_exactly_the_apis_greedy_answer_and_the_engines_statistics(browser):
    with Server(ngram_engine, step_delay_s=0.01) as server:
        page = open_page(browser, server.url)
        wait_live(page)
        with busy(server.url, 3, 48):
            rid = send_from_page(page, PROMPT, 32)
        assert int(page.inner_text("#request-count").split()[-2]) >= 2  # it decoded beside the others
        check_request_against_the_api(page, rid, server.url, PROMPT, 32)
        assert not page.errors
        page.close()


class FeedRecorder:
    """The engine's round events, recorded on a thread of their own (a second subscriber)."""

    def __init__(self, feed):
        self.feed, self.events = feed, {}
        self._stop = threading.Event()
        ready = threading.Event()

        async def run():
            sub = feed.subscribe()
            ready.set()
            while not self._stop.is_set():
                message = await sub.get(timeout=0.1)
                if isinstance(message, RoundEvent):
                    self.events[message.round_id] = message
            sub.close()

        self.thread = threading.Thread(target=lambda: asyncio.run(run()), daemon=True)
        self.thread.start()
        ready.wait(10)

    def close(self) -> None:
        self._stop.set()
        self.thread.join(10)


def test_every_round_on_the_page_is_the_engines_round_and_the_sps_panel_its_last_schedule(browser):
    with Server(dspark_engine, step_delay_s=0.02) as server:
        recorder = FeedRecorder(server.engine.engine.round_feed)
        page = open_page(browser, server.url)
        wait_live(page)
        with busy(server.url, 2, 40):
            send_from_page(page, PROMPT, 40)
        time.sleep(0.3)  # the last rounds' messages
        recorder.close()
        rows = page.eval_on_selector_all(
            "#rounds tbody tr", "rows => rows.map(r => Object.fromEntries([...r.cells].map(c => [c.dataset.col, c.textContent])))")
        assert len(rows) >= 20
        stops = set()
        for row in rows:
            e = recorder.events[int(row["round"])]
            decoding = [r for r in e.requests if not r.prefill]
            assert (int(row["R"]), int(row["B"]), int(row["ell"]), int(row["accepted"]), int(row["emitted"])) == (
                len(e.requests), e.batch_tokens, sum(r.admitted for r in decoding), sum(r.accepted for r in decoding),
                sum(len(r.emitted) for r in e.requests)), row
            if e.schedule is None:
                assert row["theta"] == "–", row
            else:  # shown to 0.1 tok/s (JavaScript's rounding: compare the number)
                assert float(row["theta"]) == pytest.approx(e.schedule.theta, abs=0.051), row
            stop = e.schedule.stop if e.schedule else "–"
            if not e.drafting:
                stop = f"{stop} (gate: lookups only)" if any(r.drafted for r in e.requests) else "gate: no drafts"
            assert row["stop"] == stop, row
            assert float(row["verify"]) == pytest.approx(e.verify_s * 1000, abs=0.051)
            stops.add(row["stop"])
        assert "break" in stops, stops  # Algorithm 1's break fired on rounds the page shows
        last = recorder.events[max(i for i, e in recorder.events.items()  # the SPS panel: the last round with drafts scheduled
                                   if e.schedule is not None and any(r.drafted for r in e.requests))]
        caption = page.inner_text("#sps-caption")
        shown_theta = float(caption.split("Θ = ")[1].split(" tok/s")[0])
        assert f"B = {last.batch_tokens} " in caption and shown_theta == pytest.approx(last.schedule.theta, abs=0.051), caption
        assert page.inner_text("#sps-round") == f"round {last.round_id}"
        assert page.inner_text("#policy") == "dspark" and not page.errors
        page.close()


def test_with_api_keys_the_page_asks_for_the_key_and_works_with_it(browser):
    with Server(ngram_engine, api_keys=(KEY,)) as server:
        page = open_page(browser, server.url)
        page.wait_for_selector('#status[data-state="auth"]', timeout=TIMEOUT_MS)
        assert page.is_visible("#key-form")
        page.fill("#key", KEY)
        page.click("#key-form button")
        wait_live(page)
        rid = send_from_page(page, PROMPT, 16)
        check_request_against_the_api(page, rid, server.url, PROMPT, 16, headers={"Authorization": f"Bearer {KEY}"})
        page.close()


def test_the_page_keeps_working_when_the_server_restarts(browser):
    server = Server(ngram_engine).start()
    page = open_page(browser, server.url)
    try:
        wait_live(page)
        first = send_from_page(page, PROMPT, 16)
        check_request_against_the_api(page, first, server.url, PROMPT, 16)
        server.stop()  # (asserts that the open page did not hold the shutdown)
        page.wait_for_selector('#status[data-state="reconnecting"]', timeout=TIMEOUT_MS)
        server = Server(ngram_engine, port=server.port).start()  # a new process would look the same: nothing kept
        page.wait_for_selector('#status[data-state="live"]', timeout=TIMEOUT_MS)
        wait_live(page)
        second = send_from_page(page, PROMPT + "!", 24)
        check_request_against_the_api(page, second, server.url, PROMPT + "!", 24)
        assert page.locator(f'.card[data-request-id="{first}"]').count() == 1  # what it showed before is still there
        assert not page.errors
    finally:
        page.close()
        server.stop()


@pytest.mark.slow
def test_on_the_real_default_model_the_page_shows_the_apis_greedy_answer(browser, served, live_url):
    prompt = "Write a haiku about CPUs"
    page = open_page(browser, live_url)
    try:
        wait_live(page)
        page.fill("#prompt", prompt)
        page.fill("#temperature", "0")
        page.fill("#max-tokens", "32")
        page.click("#send")
        page.wait_for_selector("#answer[data-finish]", timeout=TIMEOUT_MS)
        rid = page.get_attribute("#answer", "data-request-id")
        page.wait_for_function(
            "rid => { const c = document.querySelector(`.card[data-request-id=\"${rid}\"] [data-stat=state]`);"
            " return c && c.textContent.startsWith('finished'); }", arg=rid, timeout=TIMEOUT_MS)
        output = shown_output(page, rid)
        r = httpx.post(f"{live_url}/v1/chat/completions", timeout=120, json={
            "model": served.model_name, "messages": [{"role": "user", "content": prompt}], "max_tokens": 32, "temperature": 0})
        api = r.json()
        text = api["choices"][0]["message"]["content"]
        assert "".join(t for _, t in output) == text == page.inner_text("#answer-text") and text
        stats = shown_stats(page, rid)
        assert int(stats["rounds"]) == api["speculative"]["rounds"]
        assert int(stats["accepted"]) == api["speculative"]["accepted_tokens"]
    finally:
        page.close()
