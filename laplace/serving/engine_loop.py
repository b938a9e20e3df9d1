"""The engine thread of `laplace serve`: warmup, then admit / cancel / step until stopped.

The engine is touched by this thread only: the model runner warms up, the scheduler takes the
requests and cancellations, the engine steps, and the scheduler's finished requests and step
records are drained after each step. The HTTP side hands this loop requests (`submit`) and
cancellations (`cancel`, at the next step: a client that went away frees its slot there) under
one condition variable, reads the request counts the loop publishes after each step (`waiting`,
`pending`), and gets back, on the event loop, the tokens and completions of each step on the
requests' own asyncio queues (`call_soon_threadsafe`)."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import math
import threading
import time
from collections import deque
from dataclasses import dataclass, field

import torch

from laplace.errors import one_line
from laplace.serving.engine import DecodeEngine
from laplace.serving.metrics import ServerMetrics
from laplace.serving.scheduler import Completion, Request, StepRecord, TokenLogprobs

log = logging.getLogger("laplace.serving.server")


class QueueFull(Exception):
    def __init__(self, waiting: int, retry_after_s: int):
        super().__init__(f"queue full ({waiting} waiting)")
        self.retry_after_s = retry_after_s


class Draining(Exception):
    pass


@dataclass
class Ticket:
    """One engine request seen from the HTTP side: its events arrive on `events` (shared by the
    choices of one HTTP request) as (index, "token", id) and (index, "end", Completion); with
    log-probs asked for, (index, "logprobs", TokenLogprobs) before each token, and with prompt
    log-probs (`request.prompt_logprobs`: echo) (index, "prompt", [None, TokenLogprobs...]) before
    anything else, once its prompt is prefilled (none for a request that ends before that)."""

    request: Request
    index: int
    events: asyncio.Queue


@dataclass
class _Shared:
    inbox: deque = field(default_factory=deque)
    cancels: list = field(default_factory=list)
    queued: int = 0  # requests waiting in the scheduler's queue after the last step
    running: int = 0  # requests holding a slot after the last step


class EngineLoop:
    """The engine on a thread of its own: warmup, then admit / cancel / step until stopped."""

    def __init__(
        self,
        engine: DecodeEngine,
        metrics: ServerMetrics,
        *,
        warmup_widths: list[int] | None = None,
        stance: str | None = "fail_on_recompile",
    ):
        self.engine = engine
        self.max_queue = engine.scheduler.max_queue  # read once here: the HTTP side never touches the engine
        self.metrics = metrics
        self.warmup_widths = warmup_widths
        self.stance = stance
        self.ready = threading.Event()
        self.fatal: str | None = None  # why the loop stopped for good (warmup failed)
        self.on_fatal = None  # callback, e.g. to stop the HTTP server
        self.drain_deadline: float | None = None  # set (without the lock: a signal handler sets it) to drain
        self._cv = threading.Condition()
        self._shared = _Shared()
        self._stop = False
        self._tickets: dict[int, Ticket] = {}
        self._ids = itertools.count(1)
        self._aio: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._t0 = time.perf_counter()
        self._graphs_after_warmup = 0
        self._done_rate: deque[float] = deque(maxlen=64)  # finish times, for Retry-After
        self._refused = 0  # requests refused for a full queue since it last had room (for Retry-After)
        self.warmup_s: float | None = None
        self.warmup_summary = ""

    # -- called from the event loop -----------------------------------------------------------

    def clock(self) -> float:
        return time.perf_counter() - self._t0

    def next_id(self) -> int:
        return next(self._ids)

    def start(self, aio: asyncio.AbstractEventLoop) -> None:
        self._aio = aio
        self._thread = threading.Thread(target=self._run, name="laplace-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify()
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def draining(self) -> bool:
        return self.drain_deadline is not None

    def begin_drain(self, grace_s: float) -> None:
        """Stop admitting; requests still running after grace_s are cancelled. Safe in a signal handler."""
        if self.drain_deadline is None:
            self.drain_deadline = time.perf_counter() + grace_s

    def waiting(self) -> int:
        """Requests not yet in a slot: in this loop's inbox or the scheduler's queue."""
        with self._cv:
            return len(self._shared.inbox) + self._shared.queued

    def pending(self) -> int:
        """Requests not finished: waiting, or running in a slot (the drain waits for 0)."""
        with self._cv:
            return len(self._shared.inbox) + self._shared.queued + self._shared.running

    def submit(self, tickets: list[Ticket]) -> None:
        """Queue the requests of one HTTP request, all or none: raises Draining or QueueFull."""
        with self._cv:
            if self.draining or self._stop:
                raise Draining()
            waiting = len(self._shared.inbox) + self._shared.queued
            if waiting + len(tickets) > self.max_queue:
                self._refused += len(tickets)
                raise QueueFull(waiting, self._retry_after(waiting + self._refused))
            self._refused = 0
            for t in tickets:
                t.request.arrival_s = self.clock()
                self._shared.inbox.append(t)
            self._cv.notify()

    def cancel(self, request_id: int, reason: str) -> None:
        with self._cv:
            self._shared.cancels.append((request_id, reason))
            self._cv.notify()

    def _retry_after(self, ahead: int) -> int:
        """Seconds until the queue likely has room for a client refused now: the time to drain the
        `ahead` requests before it (those waiting beyond the queue's room, and those refused since
        the queue last had room, who retry too) at the recent completion rate (1 request/s before
        two have finished). So a burst of refused clients is told to come back spread over the
        drain time, not all after 1 s. Clamped to [1, 60]."""
        rate = 1.0
        if len(self._done_rate) >= 2 and self._done_rate[-1] > self._done_rate[0]:
            rate = (len(self._done_rate) - 1) / (self._done_rate[-1] - self._done_rate[0])
        return max(1, min(60, math.ceil(max(1, ahead - self.max_queue + 1) / rate)))

    # -- the engine thread --------------------------------------------------------------------

    def _run(self) -> None:
        from laplace.runtime import compiled_graph_count

        if not self._warm_up():
            return
        self._graphs_after_warmup = compiled_graph_count()
        engine = self.engine
        engine.scheduler.on_token = self._on_token
        self._emitted: list[tuple[Completion, int, TokenLogprobs | None, list | None]] = []
        self.ready.set()
        self.metrics.ready.set(1)
        compiled = engine.runner.compiled
        log.info(
            "ready: %d slots, decode widths %s, prefill buckets %s, %s; %s",
            engine.cache.max_slots,
            engine.scheduler.ladder if not engine.scheduler.exact_widths else "exact",
            engine.runner.buckets,
            f"serving under the {self.stance} stance" if self.stance and compiled else "eager",
            self.warmup_summary,
        )
        stance = torch.compiler.set_stance(self.stance) if self.stance else contextlib.nullcontext()
        try:
            with stance, torch.inference_mode():
                while self._iterate():
                    pass
        except Exception as exc:  # a bug, not a bad request: fail what is in flight, stop the server
            log.exception("the engine loop stopped")
            self.fatal = f"engine loop stopped: {type(exc).__name__}: {exc}"
            with contextlib.suppress(Exception):
                self._cancel_everything("server error: the engine loop stopped")
            if self.on_fatal:
                self.on_fatal()
        self.metrics.ready.set(0)

    def _warm_up(self) -> bool:
        """Every graph of the model runner, compiled or loaded; False when the loop cannot serve
        (warmup failed: `fatal` says why, or a signal stopped it)."""
        runner = self.engine.runner
        try:
            started = time.perf_counter()
            seconds = runner.warmup(widths=self.warmup_widths, log=log.info)
            self.warmup_s = time.perf_counter() - started
            graphs = len(seconds["decode"]) + len(seconds["prefill"])
            # how the runner got each graph: its own package or cache, or a compile (ModelRunner.warmup)
            loaded, compiled = (runner.warmup_report[k] for k in ("loaded_from_cache", "compiled"))
            self.metrics.warmup_seconds.set(self.warmup_s)
            self.metrics.warmup_graphs.set(graphs)
            self.metrics.warmup_from_cache.set(loaded)
            self.metrics.warmup_compiled.set(compiled)
            self.warmup_summary = (
                f"warmup {self.warmup_s:.1f}s, {loaded}/{graphs} graphs loaded from the compile cache, "
                f"{compiled} compiled"
                if runner.compiled
                else f"warmup {self.warmup_s:.1f}s (eager)"
            )
            return True
        except Exception as exc:  # a broken model or compiler: the server cannot serve
            if self.draining:  # stopped by a signal during warmup: its compilers were killed, not a failure
                log.info("warmup stopped: shutting down")
                return False
            self.fatal = f"warmup failed: {one_line(exc)}"
            log.error(self.fatal)
            if self.on_fatal:
                self.on_fatal()
            return False

    def _iterate(self) -> bool:
        """One turn of the loop: take the inbox and cancellations, step, publish. False once stopped."""
        from laplace.runtime import compiled_graph_count

        scheduler = self.engine.scheduler
        with self._cv:
            while not (self._shared.inbox or self._shared.cancels or scheduler.has_work() or self._stop):
                self._cv.wait(timeout=0.25)
            if self._stop:
                self._cancel_everything("server stopped")
                return False
            inbox, self._shared.inbox = self._shared.inbox, deque()
            self._shared.queued += len(inbox)  # still waiting, now in the scheduler's queue
            cancels, self._shared.cancels = self._shared.cancels, []
        scheduler.now = self.clock()
        self._admit(inbox, cancels)
        if self.drain_deadline is not None and time.perf_counter() >= self.drain_deadline and scheduler.has_work():
            self._cancel_everything("server shutting down: cancelled at the end of the grace period")
        if scheduler.has_work():
            self._step()
        if self.drain_deadline is not None:
            # SIGTERM: a request still waiting for a slot will not get one before the end; 503 now, not
            # a cancellation with 0 tokens at the end of the grace period
            scheduler.cancel_all("server shutting down: the request was still waiting for a slot", waiting_only=True)
        compiled = compiled_graph_count() - self._graphs_after_warmup
        if compiled > 0:
            self.metrics.compile_events.inc(compiled)
            self._graphs_after_warmup += compiled
            log.error("%d graph(s) compiled while serving", compiled)
        self._publish(scheduler.take_steps(), scheduler.take_finished())
        with self._cv:
            self._shared.queued, self._shared.running = scheduler.counts()
        self.metrics.occupancy(self.engine.cache.pool.busy, self.waiting())
        self.metrics.prefix_cache.snapshot = dict(self.engine.cache.stats())
        return True

    def _admit(self, inbox: deque[Ticket], cancels: list[tuple[int, str]]) -> None:
        """Hand the new requests and the cancellations to the scheduler (an echo's prompt log-probs
        are computed by its prefill, a chunk per step, and sent before its first token)."""
        scheduler = self.engine.scheduler
        for t in inbox:
            self._tickets[t.request.id] = t
            scheduler.submit(t.request)  # checked on the HTTP side already; a rejection ends it below
        for rid, reason in cancels:
            scheduler.cancel(rid, reason)

    def _step(self) -> None:
        """One engine step; one that raises fails its requests (500) and serving goes on."""
        try:
            self.engine.step()
        except Exception as exc:
            kind = "unwarmed_shape" if "recompile" in str(exc).lower() else type(exc).__name__
            self.metrics.engine_errors.labels(kind).inc()
            failed = [c.request_id for c in self.engine.scheduler.finished if c.status == "failed"]
            hint = (
                " (a shape warmup did not compile: the server never compiles while serving)"
                if kind == "unwarmed_shape"
                else ""
            )
            log.error(
                "engine step failed%s; %d request(s) answered with 500: %s",
                hint,
                len(failed),
                str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__,
            )

    def _cancel_everything(self, reason: str) -> None:
        scheduler = self.engine.scheduler
        scheduler.cancel_all(reason)
        self._publish([], scheduler.take_finished())

    def _on_token(self, completion: Completion, token: int) -> None:
        # the token's log-probs, when asked for, were appended just before it was emitted
        asked = completion.logprobs and len(completion.logprobs) == len(completion.output_ids)
        # an echo's prompt log-probs, set as its prefill ended, go out just before its first token
        prompt = completion.prompt_logprobs if len(completion.output_ids) == 1 else None
        self._emitted.append((completion, token, completion.logprobs[-1] if asked else None, prompt))

    def _publish(self, steps: list[StepRecord], finished: list[Completion]) -> None:
        m = self.metrics
        for s in steps:
            if s.kind == "decode":
                m.decode_steps.labels(str(s.width)).inc()
                m.step_seconds.observe(s.seconds)
        events = []
        emitted, self._emitted = self._emitted, []
        if emitted:
            m.count_tokens(len(emitted))
        for c, token, logprobs, prompt in emitted:
            if (t := self._tickets.get(c.request_id)) is not None:
                if prompt is not None:
                    events.append((t, (t.index, "prompt", prompt)))
                if logprobs is not None:
                    events.append((t, (t.index, "logprobs", logprobs)))
                events.append((t, (t.index, "token", token)))
        for c in finished:
            t = self._tickets.pop(c.request_id, None)
            stop_ids = t.request.stop_ids if t is not None else ()
            m.finished(c, "stop" if c.output_ids and c.output_ids[-1] in stop_ids else "length")
            if c.status == "done":
                self._done_rate.append(self.clock())
            if t is not None:
                events.append((t, (t.index, "end", c)))
        if events and self._aio is not None:
            self._aio.call_soon_threadsafe(_deliver, events)


def _deliver(events) -> None:
    for ticket, event in events:
        ticket.events.put_nowait(event)
