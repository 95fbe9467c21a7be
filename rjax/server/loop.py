"""The engine loop: one thread owns the ServingEngine and steps it; request handlers talk to it
only through a thread-safe inbox (submit, cancel) and per-request sinks (events out).

The loop never waits on a client: a sink only hands the event to the handler's own event loop
(an unbounded queue there), and a sink that fails (its event loop is gone) cancels its request.
A request that fails inside the engine (its own fault, or a device program of its step that
failed: `rjax.runtime.serving`) gets an EngineFailure naming what failed, and the rest go on. Any other
failure of a step fails every request in flight, and the loop goes on with a fresh engine (the
failed step may have consumed the donated cache). Both count as failed steps (`failed_steps`,
`last_failure`, the rjax_failed_steps counter).
"""
from __future__ import annotations

import ctypes
import dataclasses
import itertools
import logging
import queue
import threading
import time
import traceback
from typing import Callable, Hashable

from rjax.runtime.request import Limits, Request
from rjax.runtime.scoring import embed_ids
from rjax.runtime.serving import ServingEngine, StreamEvent

log = logging.getLogger("rjax.server")

# Finished requests between two returns of freed heap memory to the OS.
TRIM_EVERY = 64


def _libc_trim():
    """glibc's malloc_trim, or None elsewhere. Each request's host arrays, strings and events are
    freed when it ends, but glibc keeps freed pages in its arenas, so a long-running server's
    RSS wanders by hundreds of MiB with the request mix; trimming now and then keeps it flat."""
    try:
        return ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None


_MALLOC_TRIM = _libc_trim()


class QueueFullError(RuntimeError):
    pass


@dataclasses.dataclass(frozen=True)
class EngineFailure:
    """Sent to a request's sink instead of a StreamEvent when the engine failed it."""

    request_id: Hashable
    message: str


@dataclasses.dataclass(frozen=True)
class Setup:
    """What the loop thread builds before it serves: the tokenizer and a way to make an engine."""

    tokenizer: object
    make_engine: Callable[[], ServingEngine]
    model_id: str
    precompile: bool = True


@dataclasses.dataclass
class _Live:
    sink: Callable[[object], None]
    submitted_s: float
    last_s: float = 0.0
    started: bool = False


class EngineLoop:
    """`setup()` (loading the model, say) runs on the loop's thread, so a server answers /health
    with 503 while it runs. `max_queued` bounds the sequences accepted but not yet in a slot: those
    in the inbox and those in the engine's queue (not those prefilling or decoding)."""

    def __init__(self, setup: Callable[[], Setup], *, max_queued: int = 256, metrics=None, idle_wait_s: float = 0.5):
        if max_queued < 1:
            raise ValueError(f"max_queued must be >= 1, got {max_queued}")
        self._setup_fn, self.max_queued, self.metrics, self._idle_wait_s = setup, max_queued, metrics, idle_wait_s
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self.ready = threading.Event()
        self.setup: Setup | None = None
        self.engine: ServingEngine | None = None
        self.error: str | None = None        # why setup failed
        self._ids = itertools.count()
        self._lock = threading.Lock()         # guards _inbox_pending and _engine_queued
        self._inbox_pending = 0               # submitted, not yet handed to the engine
        self._engine_queued = 0               # in the engine's queue, waiting for a slot
        self._live: dict[Hashable, _Live] = {}  # the loop thread's own
        self._finished = 0                    # requests finished (the loop thread's own)
        self._thread: threading.Thread | None = None
        if metrics is not None:
            metrics.programs_compiling.set_function(lambda: len(self.compiling))
        self.n_cancel_requests = 0            # sequences handlers asked to cancel (a count for probes)
        self.failed_steps = 0                 # engine steps that failed (a device program, or the whole step)
        self.last_failure: str | None = None

    # -- any thread -----------------------------------------------------------------------------

    def start(self) -> None:
        self._thread = threading.Thread(target=self._main, name="rjax-engine-loop", daemon=True)
        self._thread.start()

    def stop(self, timeout: float | None = 30.0) -> None:
        self._stopping.set()
        self._wake.set()
        if self.engine is not None:
            self.engine.stop_compiling()
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def compiling(self) -> list[str]:
        """Programs the engine is still building in the background."""
        engine = self.engine
        return [] if engine is None else engine.compiling

    @property
    def limits(self) -> Limits | None:
        """What the engine accepts (None while there is none: loading, or rebuilt after a failure)."""
        engine = self.engine
        return None if engine is None else engine.limits

    def embed(self, prompts: list[list[int]]):
        """Each prompt's embedding by the engine's model (`rjax.runtime.scoring.embed_ids`), on the
        caller's thread: it reads the parameters only."""
        engine = self.engine
        if engine is None:
            raise RuntimeError("the engine is restarting")
        return embed_ids(engine.cfg, engine.params, prompts, max_tokens=engine.limits.max_len)

    @property
    def n_waiting(self) -> int:
        """Sequences accepted and waiting for a slot."""
        return self._inbox_pending + self._engine_queued


    def submit(self, requests: list[Request], sink: Callable[[object], None]) -> list[int]:
        """Queue requests (built by `limits.request`, so checked already) whose events go to
        `sink`. -> their ids. Raises QueueFullError when they would take the queue
        past `max_queued` (all or none are taken)."""
        with self._lock:
            waiting = self.n_waiting
            if waiting + len(requests) > self.max_queued:
                raise QueueFullError(f"{waiting} sequences are waiting for a slot; the server takes at most "
                                     f"{self.max_queued} (--max-queued)")
            self._inbox_pending += len(requests)
        ids = [next(self._ids) for _ in requests]
        now = time.perf_counter()
        for rid, request in zip(ids, requests):
            self._inbox.put(("submit", rid, request, sink, now))
        self._wake.set()
        return ids

    def cancel(self, ids) -> None:
        for rid in ids:
            self._inbox.put(("cancel", rid))
            self.n_cancel_requests += 1
        self._wake.set()

    # -- the loop's thread ----------------------------------------------------------------------

    def _main(self) -> None:
        try:
            self.setup = self._setup_fn()
            self.engine = self.setup.make_engine()
            if self.setup.precompile:
                # What a first request needs now; the rest while serving (/health lists them).
                report = self.engine.precompile_first(logprobs=True)
                log.info("compiled %d programs in %.1f s; %d more compile in the background", len(report.compile_s),
                         report.total_s, len(self.engine.compiling))
        except Exception as e:  # the server stays up to say why on /health
            self.error = f"{type(e).__name__}: {e}"
            log.error("engine setup failed: %s", traceback.format_exc())
            return
        self._update_gauges()
        self.ready.set()
        try:
            self._serve()
        finally:
            self.ready.clear()
            self._refuse_inbox()

    def _serve(self) -> None:
        finished_at_trim = 0
        while not self._stopping.is_set():
            self._wake.clear()
            self._drain_inbox()
            if self._finished - finished_at_trim >= TRIM_EVERY or (
                    not self.engine.has_work and self._finished != finished_at_trim):
                finished_at_trim = self._finished
                if _MALLOC_TRIM is not None:
                    _MALLOC_TRIM(0)
            if not self.engine.has_work:
                self._wake.wait(self._idle_wait_s)
                continue
            failed = self.engine.failed_steps
            try:
                events = self.engine.step()
            except Exception as e:
                log.error("engine step failed: %s", traceback.format_exc())
                message = f"the engine failed while running this request: {type(e).__name__}: {e}"
                self._count_failed(1, message)
                self._fail_all(message)
                continue
            if self.engine.failed_steps != failed:
                self._count_failed(self.engine.failed_steps - failed, self.engine.last_failure)
            self._count_queued()  # before the events go out: a client that hears one sees the count
            now = time.perf_counter()
            for event in events:
                self._deliver(event, now)
            self._update_gauges()

    def _count_failed(self, n: int, message: str) -> None:
        self.failed_steps += n
        self.last_failure = message
        if self.metrics is not None:
            self.metrics.failed_steps.inc(n)

    def _refuse_inbox(self) -> None:
        """Fail what arrived after the loop stopped, so that no handler waits forever."""
        while True:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return
            if item[0] == "submit":
                self._handed_on()
                self._send(item[3], EngineFailure(item[1], "the server is shutting down"))

    def _drain_inbox(self) -> None:
        while True:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return
            if item[0] == "cancel":
                if item[1] in self._live:
                    self.engine.cancel(item[1])
                continue
            _, rid, request, sink, submitted = item
            try:
                self.engine.submit(request, request_id=rid)
            except Exception as e:  # checked by the handler already; this request fails alone
                self._handed_on()
                log.error("request %s failed on submission: %s", rid, traceback.format_exc())
                self._send(sink, EngineFailure(rid, f"the engine refused this request: {type(e).__name__}: {e}"))
                continue
            self._handed_on()
            self._live[rid] = _Live(sink, submitted)
            if self.metrics is not None:
                self.metrics.prompt_tokens.inc(len(request.prompt))

    def _deliver(self, event: StreamEvent, now: float) -> None:
        live = self._live.get(event.request_id)
        if live is None:
            return
        m = self.metrics
        if event.tokens:
            if not live.started:
                live.started = True
                if m is not None:
                    m.ttft.observe(now - live.submitted_s)
                    if len(event.tokens) > 1:
                        m.itl.observe(0.0)
            elif m is not None:
                gap = (now - live.last_s) / len(event.tokens)
                for _ in event.tokens:
                    m.itl.observe(gap)
            live.last_s = now
            if m is not None:
                m.generation_tokens.inc(len(event.tokens))
        if event.finished:
            self._finished += 1
            del self._live[event.request_id]
            if m is not None:
                m.requests_finished.labels(event.completion.finish_reason).inc()
                m.speculative_drafted.inc(event.completion.drafted)
                m.speculative_accepted.inc(event.completion.accepted)
            if event.completion.finish_reason == "error":
                self._send(live.sink, EngineFailure(event.request_id, event.completion.error))
                return
        if not self._send(live.sink, event) and not event.finished:
            self.engine.cancel(event.request_id)  # nobody listens any more

    def _send(self, sink, item) -> bool:
        try:
            sink(item)
            return True
        except Exception:  # the handler's event loop is closed: its client is gone
            return False

    def _handed_on(self) -> None:
        """One submission left the inbox (into the engine, or refused)."""
        with self._lock:
            self._inbox_pending -= 1
            self._engine_queued = self.engine.n_queued if self.engine is not None else 0

    def _count_queued(self) -> None:
        with self._lock:
            self._engine_queued = self.engine.n_queued if self.engine is not None else 0

    def _fail_all(self, message: str) -> None:
        live, self._live = self._live, {}
        for rid, x in live.items():
            self._send(x.sink, EngineFailure(rid, message))
        self.engine.stop_compiling()
        self.engine = None  # the old cache goes before the new one is allocated
        try:
            self.engine = self.setup.make_engine()
        except Exception:
            log.error("could not make a fresh engine: %s", traceback.format_exc())
            self.error = f"the engine failed and could not be rebuilt: {message}"
            self.ready.clear()
            self._stopping.set()
        self._count_queued()
        self._update_gauges()

    def _update_gauges(self) -> None:
        m, e = self.metrics, self.engine
        if m is None or e is None:
            return
        m.running.set(e.n_running)
        m.queued.set(self.n_waiting)
        m.free_slots.set(e.n_free_slots)
        if e.pages is not None:
            m.kv_pages_in_use.set(e.pages_in_use)
            m.kv_pages_total.set(e.pages.n_pages)
            m.kv_pages_cached.set(e.pages.n_cached)
        if e.prefix_stats is not None:
            m.count_prefix(e.prefix_stats)
