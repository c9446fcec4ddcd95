"""An asyncio front for the speculative engine: one background thread runs the rounds, any
number of coroutines submit requests and read their tokens as the rounds finish.

    engine = AsyncEngine(SpeculativeEngine(runtime, NgramDrafter()))
    engine.start()
    async for delta in engine.generate(GenerationRequest("r1", prompt_ids, 64)):
        print(delta.new_token_ids, delta.finish_reason, delta.stats.mean_accepted_length)
    engine.shutdown()

Threading invariant: the SpeculativeEngine (and so the runtime, its KV cache and the drafter) is
touched by the engine thread only, and `start()` frees the OpenMP workers of the thread that
built and warmed it up: one thread computes per process, or every parallel region of the forward
pays a futex wake-up (1.5x slower decoding, dspark/model/compute_thread.py). Coroutines talk to
it through one thread-safe command queue (add, abort, stop); the thread answers each request on
that request's own asyncio.Queue through its event loop's `call_soon_threadsafe`. So several
event loops (a uvicorn thread and a test's loop) may share one AsyncEngine.

Invariant of the loop, once per iteration: drain the commands; admit waiting requests in FIFO
order while their KV fits (the head waits for KV to free, the rest wait behind it, so nobody
starves); run one `step()` if anything is running; publish every step output. A request never
fails for lack of KV unless it could not fit even into an empty cache (rejected up front). An
error in `add_request` fails that request only; an exception in `step()` fails the requests that
were running (their KV is released) and the loop goes on with the waiting ones.

Faults of a remote drafter or verifier (dspark/engine/faults.py) are recovered from in `step()`;
the loop only adds three things: it sleeps while every running request waits for the verifier
(`stalled_for_s`, woken early by a command), the head of the queue waits while the verifier is
down (up to `faults.verifier_timeout_s`, then it fails with EngineError), and RequestsFailed from
a step fails exactly the requests it names.

Observability: `submit` captures the caller's current span (the bus worker's request span), so
the request's admission calls and rounds join its trace; the loop publishes the queue depth and
running count, and each request's time to first token, inter-token latency and end, to the
metrics of dspark/observability/metrics.py (the round's own metrics: SpeculativeEngine.step).
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import AsyncIterator

from opentelemetry.trace import SpanContext

from dspark.engine.faults import PartFailure, RequestsFailed
from dspark.engine.speculative import GenerationRequest, RequestState, SpeculativeEngine
from dspark.model.compute_thread import release_openmp_workers
from dspark.model.kv_cache import KVBudgetExceeded
from dspark.observability import tracing
from dspark.observability.metrics import RequestTiming, engine_metrics
from dspark.sampling.logprobs import TokenLogprobs

__all__ = ["AsyncEngine", "EngineError", "GenerationDelta", "GenerationStats", "RequestStream"]

log = logging.getLogger(__name__)


class EngineError(RuntimeError):
    """The engine failed a request for a reason of its own (a failed step, shutdown), not the request's."""


@dataclass(frozen=True)
class GenerationStats:
    """Cumulative per-request statistics, as of the delta that carries them."""

    prompt_tokens: int
    completion_tokens: int
    rounds: int  # decode rounds (the prefill that samples the first token is not one)
    mean_accepted_length: float  # tokens emitted per decode round
    draft_tokens: int
    accepted_tokens: int

    @classmethod
    def of(cls, state: RequestState) -> "GenerationStats":
        return cls(
            prompt_tokens=len(state.request.prompt_ids),
            completion_tokens=len(state.output_ids),
            rounds=state.rounds,
            mean_accepted_length=state.mean_accepted_length,
            draft_tokens=state.draft_tokens,
            accepted_tokens=state.accepted_tokens,
        )


@dataclass(frozen=True)
class GenerationDelta:
    """The tokens one round added to a request (a StepOutput plus the statistics so far)."""

    request_id: str
    new_token_ids: list[int]
    finish_reason: str | None  # "stop" (a stop token) | "length" | None while running
    stats: GenerationStats
    logprobs: TokenLogprobs | None = None  # one entry per new token, iff the request asked for logprobs


_ACCEPTED = object()  # first event of a request that passed validation


@dataclass(eq=False)
class _Handle:
    request: GenerationRequest
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue  # GenerationDelta | BaseException | _ACCEPTED, filled by the engine thread
    state: RequestState | None = None  # set by the engine thread on admission
    span_context: SpanContext | None = None  # the submitter's span: the request's rounds join its trace
    timing: RequestTiming = field(default_factory=RequestTiming)  # arrival and emissions, for TTFT / ITL


class RequestStream:
    """One submitted request: iterate it for GenerationDelta; `abort()` stops it and frees its KV.

    The iteration ends after the delta whose finish_reason is set, or raises the error the engine
    delivered (EngineError, or ValueError for a request it could not admit)."""

    def __init__(self, engine: "AsyncEngine", handle: _Handle):
        self._engine = engine
        self._handle = handle
        self.finished = False

    @property
    def request_id(self) -> str:
        return self._handle.request.request_id

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> GenerationDelta:
        if self.finished:
            raise StopAsyncIteration
        event = await self._handle.events.get()
        if isinstance(event, BaseException):
            self.finished = True
            raise event
        if event.finish_reason is not None:
            self.finished = True
        return event

    def abort(self) -> None:
        """Stop generating (no-op once finished): the engine thread drops it and frees its KV."""
        if not self.finished:
            self.finished = True
            try:
                self._engine._send(("abort", self._handle))
            except EngineError:
                pass  # the loop is gone and has already released every request


class AsyncEngine:
    def __init__(self, engine: SpeculativeEngine, *, idle_poll_s: float = 0.05):
        self.engine = engine
        self.idle_poll_s = idle_poll_s  # how often a blocked head of queue retries when nothing runs
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()  # orders submissions against the loop's death
        self._thread: threading.Thread | None = None
        self._closed: BaseException | None = None  # why no more requests are taken
        # engine-thread state
        self._waiting: deque[_Handle] = deque()
        self._running: dict[str, _Handle] = {}
        self._live: dict[str, _Handle] = {}  # waiting + running, by request id
        # snapshots the engine thread publishes for health checks and metrics
        self.num_waiting = 0
        self.num_running = 0
        self.metrics = engine_metrics()  # dspark/observability/metrics.py

    @property
    def runtime(self):
        return self.engine.runtime  # None when the verifier is remote

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len  # fixed at load: safe to read from any thread

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self._closed is None

    # ---- lifecycle (any thread) ----------------------------------------------------------

    def start(self) -> "AsyncEngine":
        if self._thread is not None:
            raise RuntimeError("AsyncEngine.start() called twice")
        release_openmp_workers()  # the caller built and warmed up the engine; the engine thread computes now
        self._thread = threading.Thread(target=self._run, name="dspark-engine", daemon=True)
        self._thread.start()
        return self

    def shutdown(self, timeout: float | None = 30.0) -> None:
        """Stop the loop after its current step; unfinished requests fail with EngineError."""
        if self._thread is None:
            return
        with self._lock:
            if self._closed is None:
                self._commands.put(("stop", None))
        self._thread.join(timeout)

    # ---- requests (coroutines, any event loop) -------------------------------------------

    async def submit(self, request: GenerationRequest) -> RequestStream:
        """Queue a request; returns once the engine thread has validated it (raises ValueError if
        it cannot be served at all). Generation starts when its KV fits."""
        handle = _Handle(request=request, loop=asyncio.get_running_loop(), events=asyncio.Queue(),
                         span_context=tracing.current_span_context())
        self._send(("add", handle))
        try:
            first = await handle.events.get()
        except BaseException:  # cancelled while waiting for validation
            self._send(("abort", handle))
            raise
        if isinstance(first, BaseException):
            raise first
        return RequestStream(self, handle)

    async def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationDelta]:
        """Deltas of one request as its rounds finish; the last has finish_reason and final stats.
        Leaving the iteration early (break, cancellation, a disconnected client) aborts it."""
        stream = await self.submit(request)
        try:
            async for delta in stream:
                yield delta
        finally:
            stream.abort()

    def _send(self, command: tuple) -> None:
        with self._lock:
            if self._closed is not None:
                raise EngineError(f"the engine is not running: {self._closed}")
            if self._thread is None:
                raise EngineError("the engine is not running: call start() first")
            self._commands.put(command)

    # ---- the engine thread ---------------------------------------------------------------

    def _run(self) -> None:
        reason: BaseException = EngineError("the engine was shut down")
        try:
            self._loop()
        except BaseException as e:  # a bug in the loop itself: never leave consumers hanging
            log.exception("engine loop died")
            reason = EngineError(f"the engine loop died: {e!r}")
        finally:
            with self._lock:
                self._closed = reason
            self._fail_all(reason)
            while True:  # commands that raced with the shutdown
                try:
                    kind, handle = self._commands.get_nowait()
                except queue.Empty:
                    break
                if kind == "add":
                    self._emit(handle, reason)
            self._publish_counts()

    def _loop(self) -> None:
        while True:
            stalled_s = self.engine.stalled_for_s()  # > 0: every running request waits for the verifier
            idle = not self.engine.has_unfinished or stalled_s > 0
            # Block when there is nothing to step; poll if a request waits for KV held elsewhere.
            timeout = None if not self._waiting else self.idle_poll_s
            if stalled_s > 0:
                timeout = min(stalled_s, timeout or stalled_s)
            if not self._drain_commands(block=idle, timeout=timeout):
                return
            self._admit_waiting()
            if self.engine.has_unfinished:
                self._step()
            self._publish_counts()

    def _drain_commands(self, *, block: bool, timeout: float | None) -> bool:
        """Apply pending commands; False once a stop command arrived."""
        while True:
            try:
                kind, handle = self._commands.get(timeout=timeout) if block else self._commands.get_nowait()
            except queue.Empty:
                return True
            block = False
            if kind == "stop":
                return False
            if kind == "add":
                self._accept(handle)
            elif kind == "abort":
                if self._live.get(handle.request.request_id) is handle:
                    self.metrics.record_end("abort")
                self._abort(handle)

    def _accept(self, handle: _Handle) -> None:
        req = handle.request
        try:
            if req.request_id in self._live:
                raise ValueError(f"request id {req.request_id!r} is already in use")
            self.engine.validate(req)  # also rejects a request larger than the whole KV budget
        except ValueError as e:
            self._emit(handle, e)
            return
        if self._emit(handle, _ACCEPTED):
            self._live[req.request_id] = handle
            self._waiting.append(handle)

    def _admit_waiting(self) -> None:
        while self._waiting:
            handle = self._waiting[0]
            rid = handle.request.request_id
            outage = self.engine.verifier_outage
            if outage is not None and time.monotonic() < outage.retry_at and not self._verifier_given_up(handle):
                return  # the head waits for the verifier's next try
            try:
                with tracing.use_span_context(handle.span_context):  # the request's trace (module docstring)
                    self.engine.add_request(handle.request)
            except KVBudgetExceeded:
                return  # FIFO: the head waits until running requests free their KV
            except PartFailure as e:
                if not self._verifier_given_up(handle, e):
                    return  # FIFO: the head waits for the verifier to come back
                continue
            except Exception as e:  # ValueError or worse: that request's problem only
                self._waiting.popleft()
                self._live.pop(rid, None)
                self._emit(handle, e)
                continue
            self._waiting.popleft()
            handle.state = self.engine.running[rid]
            self._running[rid] = handle

    def _verifier_given_up(self, head: _Handle, error: PartFailure | None = None) -> bool:
        """True (and the head failed) once the verifier has been down longer than the engine waits."""
        outage, limit = self.engine.verifier_outage, self.engine.faults.verifier_timeout_s
        if outage is None or outage.seconds <= limit:
            return False
        self._waiting.popleft()
        self._live.pop(head.request.request_id, None)
        self._emit(head, EngineError(f"the verifier has not answered for {outage.seconds:.0f} s: {error or outage.error}"))
        self.metrics.record_end("error")
        return True

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except RequestsFailed as e:  # the engine gave up on these (and released them); the others go on
            for rid in e.request_ids:
                handle = self._running.get(rid)
                if handle is not None:
                    self._forget(handle)
                    self._emit(handle, EngineError(f"generation failed: {e}"))
                    self.metrics.record_end("error")
            return
        except Exception as e:
            log.exception("engine step failed; failing its %d running requests", len(self._running))
            error = EngineError(f"generation failed in the engine: {e!r}")
            for rid in list(self.engine.running):
                self._safe_abort(rid)
            for rid, handle in list(self._running.items()):
                self._forget(handle)
                self._emit(handle, error)
                self.metrics.record_end("error")
            return
        now = time.perf_counter()
        for out in outputs:
            handle = self._running.get(out.request_id)
            if handle is None:
                continue
            delta = GenerationDelta(
                request_id=out.request_id,
                new_token_ids=out.new_token_ids,
                finish_reason=out.finish_reason,
                stats=GenerationStats.of(handle.state),
                logprobs=out.logprobs,
            )
            self.metrics.record_output(handle.timing, len(out.new_token_ids), out.finish_reason, now)
            if out.finish_reason is not None:
                self._forget(handle)  # the engine already released it
            if not self._emit(handle, delta) and out.finish_reason is None:
                self._abort(handle)  # its event loop is gone: nobody will read the rest

    def _abort(self, handle: _Handle) -> None:
        rid = handle.request.request_id
        if self._live.get(rid) is not handle:
            return  # finished, failed or never admitted
        if handle in self._waiting:
            self._waiting.remove(handle)
        else:
            self._safe_abort(rid)
        self._forget(handle)

    def _safe_abort(self, rid: str) -> None:
        try:
            self.engine.abort(rid)
        except Exception:
            log.exception("aborting request %r failed", rid)
            self.engine.running.pop(rid, None)
            try:  # the verifier may be remote and unreachable: its KV is then its own to reclaim
                self.engine.verifier.remove_request([rid])
            except Exception:
                log.exception("freeing request %r on the verifier failed", rid)

    def _forget(self, handle: _Handle) -> None:
        rid = handle.request.request_id
        if self._live.get(rid) is handle:
            del self._live[rid]
        if self._running.get(rid) is handle:
            del self._running[rid]

    def _fail_all(self, error: BaseException) -> None:
        for handle in list(self._live.values()):
            self._abort(handle)
            self._emit(handle, error)
            self.metrics.record_end("error")

    def _emit(self, handle: _Handle, event) -> bool:
        try:
            handle.loop.call_soon_threadsafe(handle.events.put_nowait, event)
            return True
        except RuntimeError:  # the consumer's event loop is closed
            return False

    def _publish_counts(self) -> None:
        self.num_waiting = len(self._waiting)
        self.num_running = len(self._running)
        self.metrics.set_counts(waiting=self.num_waiting, running=self.num_running)
