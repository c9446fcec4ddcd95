"""The scheduler side of the bus: consume requests, run them on an AsyncEngine, publish their tokens.

    stop = asyncio.Event()
    await run_worker(bus, async_engine, consumer="scheduler-0", stop=stop)   # until stop is set

    worker = start_worker_thread(lambda: bus, async_engine, consumer="embedded")   # dspark serve
    ...
    worker.stop()

Invariant, per request: the output stream always holds a prefix of one generation, each token
once. A delivery carries the tokens already published (`Delivery.published`); the worker runs
the rest as a continuation: prompt + published tokens, max_new_tokens minus their count. By the
chain rule the continuation's tokens are distributed exactly as the rest of the original
generation would have been, so a re-claimed request loses nothing, repeats nothing and stays
exact; with greedy sampling it is the very same text. A seeded request's continuation uses a
seed derived from (seed, offset): deterministic, and not a replay of the random numbers the
first tokens consumed (which would correlate them). Publishing is fenced by the delivery's epoch
(dspark/bus/base.py), so a worker that was presumed dead cannot append after a take-over.

Per request: the first event (no tokens) says the request was accepted, or the only event
carries the error (`invalid_request` for what the engine refused, `server` otherwise); then one
event per engine round; the request is acknowledged after its final event. A cancel signal
aborts the engine request (its KV and drafter state are freed at the engine's next loop
iteration) and publishes a final `cancelled` event. When the worker stops, its requests are
aborted in the engine but neither finished nor acknowledged: another worker re-claims them.

The bus going away (BusUnavailable: Redis restarting) stops nothing: consuming is retried every
second, and a publish or ack retries by itself (RedisBus.reconnect_timeout_s) while the engine
goes on; a request whose publish still fails stays pending and is re-claimed later.

Round view: beside the requests, the worker relays its engine's round events to the bus while a
gateway watches them (dspark/bus/round_relay.py; nothing at all while none does).

Tracing: each request is served inside a `scheduler.request` span, the child of the span whose
W3C traceparent the message carries (the gateway's), so one trace follows a request from the
gateway through this worker into the engine's rounds (dspark/observability/tracing.py).
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from opentelemetry.trace import SpanKind

from dspark.bus.base import Bus, BusUnavailable, Delivery, LostOwnership
from dspark.bus.messages import EventError, OutputEvent, OutputStats
from dspark.bus.round_relay import relay_rounds
from dspark.engine.async_engine import AsyncEngine, EngineError, RequestStream
from dspark.engine.faults import continuation_params, continuation_seed
from dspark.engine.speculative import GenerationRequest
from dspark.observability import tracing

__all__ = ["WorkerThread", "continuation_request", "continuation_seed", "run_worker", "start_worker_thread"]

log = logging.getLogger(__name__)

def continuation_request(delivery: Delivery) -> GenerationRequest:
    """The engine request that produces what the delivery's output stream still lacks (a seeded
    request continues with `continuation_seed(seed, len(published))`, dspark/engine/faults.py)."""
    req, published = delivery.request, delivery.published.token_ids
    return GenerationRequest(
        request_id=req.request_id,
        prompt_ids=req.prompt_ids + published,
        max_new_tokens=req.max_new_tokens - len(published),
        params=continuation_params(req.params, len(published)),
        stop_token_ids=req.stop_token_ids,
        logprobs=req.logprobs,
    )


@dataclass(eq=False)
class _Job:
    delivery: Delivery
    task: asyncio.Task | None = None
    stream: RequestStream | None = None
    cancel_requested: bool = False  # a client cancel (publish "cancelled"), not the worker stopping
    published_end: int = 0  # completion tokens on the output stream
    last_stats: OutputStats | None = None  # of the last published event
    final_published: bool = False
    done: asyncio.Event = field(default_factory=asyncio.Event)


async def run_worker(
    bus: Bus,
    engine: AsyncEngine,
    *,
    consumer: str,
    stop: asyncio.Event,
    max_in_flight: int = 64,  # requests this worker holds at once; the rest stay on the bus for other workers
    block_s: float = 0.5,  # one blocking consume; also how quickly `stop` is noticed
    keep_alive_s: float | None = None,  # how often our requests' idle time is reset; None: claim_idle_s / 3
    round_view: bool = True,  # relay the engine's rounds to the bus while a gateway watches (dspark/bus/round_relay.py)
) -> None:
    """Serve requests from `bus` on `engine` until `stop` is set (see the module docstring)."""
    if max_in_flight < 1:
        raise ValueError(f"max_in_flight must be >= 1, got {max_in_flight}")
    jobs: dict[str, _Job] = {}
    cancels = await bus.subscribe_cancellations()  # before consuming: no signal can slip between
    background = [
        asyncio.create_task(_forward_cancellations(cancels, jobs), name=f"{consumer}-cancels"),
        asyncio.create_task(_keep_alive(bus, consumer, jobs, stop, keep_alive_s or bus.claim_idle_s / 3),
                            name=f"{consumer}-keepalive"),
    ]
    if round_view:
        background.append(asyncio.create_task(relay_rounds(bus, engine.engine.round_feed, source=consumer, stop=stop),
                                              name=f"{consumer}-rounds"))
    stopping = asyncio.create_task(stop.wait())
    try:
        while not stop.is_set():
            if asyncio.current_task().cancelling():  # a library swallowed our cancellation: honour it
                raise asyncio.CancelledError
            room = max_in_flight - len(jobs)
            if room <= 0:
                finished = [j.done.wait() for j in jobs.values()]
                waiters = [asyncio.ensure_future(w) for w in finished]
                await asyncio.wait([stopping, *waiters], return_when=asyncio.FIRST_COMPLETED)
                for w in waiters:
                    w.cancel()
                continue
            try:
                deliveries = await bus.consume(consumer, max_count=room, block_s=block_s)
            except BusUnavailable as e:
                log.warning("consuming from the bus failed (%s); retrying", e)
                await asyncio.wait([stopping], timeout=1.0)
                continue
            except Exception:
                log.exception("consuming from the bus failed; retrying")
                await asyncio.wait([stopping], timeout=1.0)
                continue
            for delivery in deliveries:
                rid = delivery.request.request_id
                if rid in jobs:  # our own request re-claimed (a missed keep-alive): carry on under the new epoch
                    jobs[rid].delivery = delivery
                    continue
                job = _Job(delivery)
                jobs[rid] = job
                job.task = asyncio.create_task(_serve_traced(bus, engine, job, jobs), name=f"{consumer}:{rid}")
    finally:
        stopping.cancel()
        for job in list(jobs.values()):
            if job.task is not None:
                job.task.cancel()  # aborts the engine request; the delivery stays pending for others
        await asyncio.gather(*(j.task for j in jobs.values() if j.task is not None), return_exceptions=True)
        for task in background:
            task.cancel()
        await asyncio.gather(*background, return_exceptions=True)
        try:
            await cancels.close()
        except Exception:
            log.debug("closing the cancel subscription failed", exc_info=True)


async def _forward_cancellations(cancels, jobs: dict[str, _Job]) -> None:
    while True:
        try:
            async for request_id in cancels:
                job = jobs.get(request_id)
                if job is not None and job.task is not None and not job.cancel_requested:
                    job.cancel_requested = True
                    job.task.cancel()
            return
        except BusUnavailable as e:  # the subscription connects and subscribes again on the next read
            log.warning("reading cancel signals failed (%s); retrying", e)
            await asyncio.sleep(1.0)
        except Exception:
            log.exception("reading cancel signals failed; retrying")
            await asyncio.sleep(1.0)


async def _keep_alive(bus: Bus, consumer: str, jobs: dict[str, _Job], stop: asyncio.Event, interval: float) -> None:
    # Every claim_idle_s / 3 by default: three chances before another worker may re-claim.
    while not stop.is_set():
        await asyncio.sleep(interval)
        try:
            await bus.keep_alive(consumer, [j.delivery.entry_id for j in list(jobs.values())])
        except BusUnavailable as e:
            log.warning("keep-alive on the bus failed (%s)", e)
        except Exception:
            log.exception("keep-alive on the bus failed")


async def _serve_traced(bus: Bus, engine: AsyncEngine, job: _Job, jobs: dict[str, _Job]) -> None:
    """`_serve` inside the request's span: the child of the gateway's (the message's traceparent),
    current while the engine takes the request (so its rounds join the trace), ended with its totals."""
    req = job.delivery.request
    parent = tracing.extract({"traceparent": req.traceparent} if req.traceparent else {})
    attributes = {"dspark.request_id": req.request_id, "dspark.prompt_tokens": len(req.prompt_ids),
                  "dspark.max_new_tokens": req.max_new_tokens, "dspark.resumed_at": len(job.delivery.published.token_ids)}
    with tracing.tracer().start_as_current_span("scheduler.request", context=parent, kind=SpanKind.CONSUMER,
                                                attributes=attributes) as span:
        try:
            await _serve(bus, engine, job, jobs)
        finally:
            stats = job.last_stats
            if stats is not None and span.is_recording():
                span.set_attributes({"dspark.completion_tokens": stats.completion_tokens, "dspark.rounds": stats.rounds,
                                     "dspark.draft_tokens": stats.draft_tokens, "dspark.accepted_tokens": stats.accepted_tokens,
                                     "dspark.mean_accepted_length": stats.mean_accepted_length})


async def _serve(bus: Bus, engine: AsyncEngine, job: _Job, jobs: dict[str, _Job]) -> None:
    rid = job.delivery.request.request_id
    try:
        await _run(bus, engine, job)
    except asyncio.CancelledError:
        if job.stream is not None:
            job.stream.abort()  # frees its KV and drafter state at the engine's next iteration
        if not job.cancel_requested:
            raise  # the worker is stopping: leave the request pending for another worker
        asyncio.current_task().uncancel()
        try:
            await _cancelled(bus, job)
        except LostOwnership:
            pass
        except Exception:
            log.exception("publishing the cancellation of %r failed", rid)
    except LostOwnership as e:
        log.warning("request %r was taken over by another worker: %s", rid, e)
        if job.stream is not None:
            job.stream.abort()
    except Exception:
        log.exception("serving request %r failed; it stays pending for a retry", rid)
        if job.stream is not None:
            job.stream.abort()
    finally:
        if jobs.get(rid) is job:
            del jobs[rid]
        job.done.set()


async def _run(bus: Bus, engine: AsyncEngine, job: _Job) -> None:
    delivery = job.delivery
    req, published = delivery.request, delivery.published
    job.published_end = len(published.token_ids)
    job.last_stats = published.stats
    if published.finished:  # the previous owner died between its last event and the ack
        await bus.ack(delivery)
        return
    if published.trimmed:
        await _finish(bus, job, _error_event(job, "server", "the output stream was trimmed (max length): cannot resume"))
        return
    if await bus.is_cancelled(req.request_id):
        await _cancelled(bus, job)
        return
    if job.published_end >= req.max_new_tokens:  # all tokens out, the final event was not
        await _finish(bus, job, OutputEvent(offset=job.published_end, token_ids=[], finish_reason="length", stats=job.last_stats))
        return
    try:
        job.stream = await engine.submit(continuation_request(delivery))
    except ValueError as e:
        await _finish(bus, job, _error_event(job, "invalid_request", str(e)))
        return
    except EngineError as e:
        await _finish(bus, job, _error_event(job, "server", str(e)))
        return
    base = published.stats
    base_offset = job.published_end

    def cumulative(stats) -> OutputStats:
        now = OutputStats.of(stats)
        if base is None:
            return now
        return base.continued_by(now, prompt_tokens=len(req.prompt_ids), completion_offset=base_offset)

    accepted_stats = job.last_stats or OutputStats(len(req.prompt_ids), 0, 0, 0.0, 0, 0)
    await _publish(bus, job, OutputEvent(offset=job.published_end, token_ids=[], stats=accepted_stats))
    try:
        async for delta in job.stream:
            event = OutputEvent(offset=job.published_end, token_ids=delta.new_token_ids,
                                finish_reason=delta.finish_reason, stats=cumulative(delta.stats), logprobs=delta.logprobs)
            if event.final:
                await _finish(bus, job, event)
                return
            await _publish(bus, job, event)
    except ValueError as e:  # the engine could not admit it after all
        await _finish(bus, job, _error_event(job, "invalid_request", str(e)))
    except EngineError as e:
        await _finish(bus, job, _error_event(job, "server", str(e)))


async def _publish(bus: Bus, job: _Job, event: OutputEvent) -> None:
    await bus.publish(job.delivery, event)
    job.published_end = event.end
    job.last_stats = event.stats or job.last_stats


async def _finish(bus: Bus, job: _Job, event: OutputEvent) -> None:
    await _publish(bus, job, event)
    job.final_published = True
    await bus.ack(job.delivery)


async def _cancelled(bus: Bus, job: _Job) -> None:
    """End a cancelled request (or only ack it, if its final event got out before the cancel)."""
    if job.final_published:
        await bus.ack(job.delivery)
        return
    await _finish(bus, job, OutputEvent(offset=job.published_end, token_ids=[], finish_reason="cancelled", stats=job.last_stats))


def _error_event(job: _Job, kind: str, message: str) -> OutputEvent:
    return OutputEvent(offset=job.published_end, token_ids=[], finish_reason="error", stats=job.last_stats,
                       error=EventError(kind, message))


# ---- a worker on its own thread and event loop (the embedded mode) -----------------------------


class WorkerThread:
    """`run_worker` on a daemon thread with its own event loop; `stop()` ends it."""

    def __init__(self, make_bus: Callable[[], Bus], engine: AsyncEngine, *, consumer: str, **worker_kwargs):
        self._make_bus, self._engine, self._consumer, self._kwargs = make_bus, engine, consumer, worker_kwargs
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._ready = threading.Event()
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._main, name=f"dspark-bus-worker-{consumer}", daemon=True)

    def start(self) -> WorkerThread:
        self._thread.start()
        self._ready.wait()
        return self

    @property
    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def _main(self) -> None:
        try:
            asyncio.run(self._run())
        except BaseException as e:
            self.error = e
            log.exception("bus worker %r died", self._consumer)
        finally:
            self._ready.set()

    async def _run(self) -> None:
        self._loop, self._stop = asyncio.get_running_loop(), asyncio.Event()
        bus = self._make_bus()
        self._ready.set()
        await run_worker(bus, self._engine, consumer=self._consumer, stop=self._stop, **self._kwargs)

    def stop(self, timeout: float | None = 10.0) -> None:
        if self._loop is not None and self._stop is not None and self._thread.is_alive():
            try:
                self._loop.call_soon_threadsafe(self._stop.set)
            except RuntimeError:  # its loop already closed
                pass
        self._thread.join(timeout)


def start_worker_thread(make_bus: Callable[[], Bus], engine: AsyncEngine, *, consumer: str, **worker_kwargs) -> WorkerThread:
    """Start `run_worker` on a new thread; `make_bus` is called on that thread's loop (a RedisBus
    must be created on the loop that uses it; a MemoryBus may be shared: return it)."""
    return WorkerThread(make_bus, engine, consumer=consumer, **worker_kwargs).start()
