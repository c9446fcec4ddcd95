"""The round view: a live page of the engine's rounds, served by the gateway (docs/round-view.md).

    GET /ui                          the page (gateway/ui/: plain HTML, JS and CSS, no build step)
    GET /ui/app.js, /ui/style.css    its script and style; open like the probes (they hold no data)
    GET /ui/events                   server-sent events: one `data: <JSON>` per message; the API key
                                     when keys are set (Bearer header: the page reads the stream with
                                     fetch), outside the per-key request limits (a page is no request)

Flow. One `RoundRelay` per gateway process runs while at least one page is open: it iterates
`bus.watch_rounds()` (which makes the schedulers publish their rounds, dspark/bus/round_relay.py),
adds the text of every token with the gateway's tokenizer, serialises each message once, and
hands it to every open page's bounded queue. A page whose queue is full (a slow browser, a tab in
the background) is dropped: its stream ends and the page reconnects. With no page open the relay
stops, the bus's watched flag expires, and the schedulers stop publishing: no cost at all.

Text. Drafts are shown one token at a time (`decode([id])`, cached per id). The tokens a request
got (accepted drafts, then the correction or bonus token) go through one incremental decoder per
request, which decodes a short window of the last tokens (as vLLM's detokenizer does): their
pieces concatenate to the text of the request's tokens, which is the API's answer for a request
without stop strings (tested in tests/gateway/test_round_view_browser.py).
"""

from __future__ import annotations

import asyncio
import collections
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from importlib import resources

from fastapi import FastAPI
from fastapi.responses import Response, StreamingResponse

from dspark.bus.base import Bus

__all__ = ["EVENTS_PATH", "OPEN_PATHS", "RoundRelay", "add_round_view"]

log = logging.getLogger(__name__)

PAGES = {"/ui": ("index.html", "text/html; charset=utf-8"), "/ui/app.js": ("app.js", "text/javascript; charset=utf-8"),
         "/ui/style.css": ("style.css", "text/css; charset=utf-8")}
OPEN_PATHS = tuple(PAGES)  # the static page: no key needed (the events are what is guarded)
EVENTS_PATH = "/ui/events"
KEEPALIVE_S = 10.0  # an SSE comment this often: proxies keep the stream open, a gone client is noticed
SOURCE_FRESH_S = 15.0  # a scheduler's announcement is passed on to a new page for this long (they come every 5 s)
_DROPPED = object()


class _IncrementalText:
    """One request's tokens in, the text each adds out, decoding a window of the last few tokens.

    `prefix:read` is text already handed out, kept as left context; a token whose decode ends in
    U+FFFD (an incomplete UTF-8 sequence) adds "" until the sequence completes."""

    def __init__(self, decode: Callable[[list[int]], str]):
        self._decode = decode
        self.ids: list[int] = []
        self._prefix = self._read = 0

    def push(self, token_id: int) -> str:
        self.ids.append(token_id)
        return self._advance(final=False)

    def finish(self) -> str:
        return self._advance(final=True)

    def _advance(self, *, final: bool) -> str:
        before = self._decode(self.ids[self._prefix:self._read])
        after = self._decode(self.ids[self._prefix:])
        if len(after) <= len(before) or (after.endswith("\ufffd") and not final):
            return ""
        self._prefix, self._read = self._read, len(self.ids)
        return after[len(before):]


class _Page:
    """One open page: a bounded queue of serialised messages."""

    def __init__(self, maxsize: int):
        self.queue: asyncio.Queue = asyncio.Queue(maxsize)
        self.dropped = False

    def offer(self, text: str) -> bool:
        if self.dropped:
            return False
        try:
            self.queue.put_nowait(text)
            return True
        except asyncio.QueueFull:
            self.dropped = True
            while not self.queue.empty():  # free what it did not read; tell it (if it ever reads again)
                self.queue.get_nowait()
            self.queue.put_nowait(_DROPPED)
            return False


class RoundRelay:
    """Bus round messages -> every open page, with token text (see the module docstring)."""

    def __init__(self, bus: Bus, decode: Callable[[list[int]], str], *, page_queue: int = 512, max_requests: int = 4096,
                 max_token_texts: int = 65536):
        self.bus, self._decode = bus, decode
        self.page_queue, self.max_requests, self.max_token_texts = page_queue, max_requests, max_token_texts
        self._pages: set[_Page] = set()
        self._task: asyncio.Task | None = None
        self._profiles: collections.OrderedDict[str, str] = collections.OrderedDict()  # key -> message, newest last
        self._sources: dict[str, tuple[float, str]] = {}  # source -> (monotonic time, its last announcement)
        self._texts: collections.OrderedDict[tuple[str, str], _IncrementalText] = collections.OrderedDict()
        self._token_text: dict[int, str] = {}
        self.dropped_pages = 0

    @property
    def running(self) -> bool:
        return self._task is not None and not self._task.done()

    @property
    def pages(self) -> int:
        return len(self._pages)

    def open(self) -> _Page:
        """A new page: gets the known SPS profiles and the schedulers announced lately first, then
        every message relayed from now on."""
        page = _Page(self.page_queue)
        now = time.monotonic()
        for message in [*self._profiles.values(), *(m for t, m in self._sources.values() if now - t < SOURCE_FRESH_S)]:
            page.offer(message)
        self._pages.add(page)
        if not self.running:
            self._task = asyncio.create_task(self._run(), name="dspark-round-relay")
        return page

    def close(self, page: _Page) -> None:
        self._pages.discard(page)
        self._stop_if_idle()

    def _stop_if_idle(self) -> None:
        if not self._pages and self._task is not None:
            self._task.cancel()  # the bus stops seeing this gateway watch: the schedulers stop publishing
            self._task = None
            self._texts.clear()  # a later relay starts over: its requests' text from what it sees
            self._sources.clear()  # and hears the schedulers announce themselves again

    async def _run(self) -> None:
        while True:
            watch = self.bus.watch_rounds()
            try:
                async for batch in watch:
                    for raw in batch:
                        self._relay(raw)
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("the round relay failed; starting again in 1 s")
                await asyncio.sleep(1.0)
            finally:
                await watch.aclose()

    def _relay(self, raw: str) -> None:
        try:
            message = json.loads(raw)
            text = json.dumps(self.render(message))
        except (ValueError, TypeError, KeyError) as e:
            log.warning("skipping a malformed round message: %s", e)
            return
        if message.get("type") == "source":
            self._sources[str(message["source"])] = (time.monotonic(), text)
        if message.get("type") == "sps":
            self._profiles[message["key"]] = text
            self._profiles.move_to_end(message["key"])
            while len(self._profiles) > 16:
                self._profiles.popitem(last=False)
        for page in list(self._pages):
            if not page.offer(text):
                self.dropped_pages += 1
                self._pages.discard(page)
                log.info("dropped a round view page that fell %d messages behind", self.page_queue)
        self._stop_if_idle()

    def render(self, message: dict) -> dict:
        """A bus message as the page gets it: a round gets its tokens' text."""
        if message.get("type") != "round":
            return message
        source = str(message.get("source", ""))
        for r in message["requests"]:
            r["drafted_text"] = [self._token(t) for t in r["drafted"]]
            key = (source, r["request_id"])
            stream = self._texts.get(key)
            r["joined"] = stream is None and not r["prefill"]  # first seen mid-way: its earlier text is not on the page
            if stream is None:
                stream = self._texts[key] = _IncrementalText(self._decode)
                while len(self._texts) > self.max_requests:
                    self._texts.popitem(last=False)  # aborted requests end without a final round
            self._texts.move_to_end(key)
            pieces = [stream.push(t) for t in r["emitted"]]
            if r["finish_reason"] is not None:
                if pieces:
                    pieces[-1] += stream.finish()
                del self._texts[key]
            r["emitted_text"] = pieces
        return message

    def _token(self, token_id: int) -> str:
        text = self._token_text.get(token_id)
        if text is None:
            if len(self._token_text) >= self.max_token_texts:
                self._token_text.clear()
            text = self._token_text[token_id] = self._decode([token_id])
        return text


def _page_file(name: str) -> bytes:
    return (resources.files("gateway") / "ui" / name).read_bytes()


def add_round_view(app: FastAPI, bus: Bus, decode: Callable[[list[int]], str], *, model_name: str,
                   page_queue: int = 512) -> RoundRelay:
    """Add the page and its event stream to `app` (see the module docstring); returns the relay."""
    relay = RoundRelay(bus, decode, page_queue=page_queue)
    app.state.round_relay = relay
    files = {path: (_page_file(name), media) for path, (name, media) in PAGES.items()}

    def page_route(path: str):
        body, media = files[path]

        async def serve() -> Response:
            return Response(body, media_type=media, headers={"Cache-Control": "no-cache"})

        return serve

    for path in PAGES:
        app.add_api_route(path, page_route(path), methods=["GET"], include_in_schema=False)

    @app.get(EVENTS_PATH, include_in_schema=False)
    async def events() -> StreamingResponse:
        page = relay.open()
        hello = json.dumps({"type": "hello", "model": model_name, "time": time.time()})
        return StreamingResponse(_sse(relay, page, hello), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    return relay


async def _sse(relay: RoundRelay, page: _Page, hello: str) -> AsyncIterator[str]:
    getter = None
    try:
        yield f"data: {hello}\n\n"
        while True:
            # asyncio.wait, not wait_for: a disconnect's cancellation must not be lost (dspark/bus/memory_bus.py _wait)
            getter = asyncio.ensure_future(page.queue.get())
            done, _ = await asyncio.wait({getter}, timeout=KEEPALIVE_S)
            if not done:
                getter.cancel()
                yield ": keep-alive\n\n"
                continue
            text = getter.result()
            if text is _DROPPED:
                yield 'data: {"type": "dropped"}\n\n'
                return
            yield f"data: {text}\n\n"
    finally:
        if getter is not None:
            getter.cancel()
        relay.close(page)
