"""`laplace serve`: an OpenAI-compatible HTTP server in front of one DecodeEngine.

The engine runs on its own thread (`EngineLoop`) with continuous batching: requests join
the batch between decode steps (admission prefills them into free slots) and leave it as
they finish, are cancelled (a client that disconnects, a stop string) or fail. The HTTP
side (FastAPI on uvicorn's event loop) validates a request, hands it to the loop and
streams the tokens the loop hands back; the engine is touched by its own thread only.

- Warmup runs first, on the engine thread, one log line per graph: `/health` answers 503
  until it is done. After it the loop serves under
  `torch.compiler.set_stance("fail_on_recompile")`: a shape warmup did not compile is an
  error in the log and a 500 for the requests of that step, never a silent compile.
- Overload is shed at once: a request arriving while `engine.max_queue` wait gets 429 with
  Retry-After.
- SIGTERM (or Ctrl-C) stops admitting (new connections are refused, requests on open ones
  get 503), lets in-flight requests finish for `server.shutdown_grace_s`, cancels what is
  left (a stream ends with an error event) and returns, so the process exits 0.

Endpoints: POST /v1/completions, GET /v1/models, GET /health, GET /metrics (Prometheus).
"""

from __future__ import annotations

import asyncio
import contextlib
import difflib
import itertools
import json
import logging
import math
import secrets
import signal
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import torch
from fastapi import Request as HttpRequest

from laplace.serving.engine import Completion, DecodeEngine, Rejected, Request, StepRecord

log = logging.getLogger("laplace.serving.server")


# --------------------------------------------------------------------------- metrics


class ServerMetrics:
    """The Prometheus metrics of one server, in a registry of its own (prometheus_client: the
    exposition format and thread-safe counters and histograms are its job)."""

    def __init__(self, max_slots: int):
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        r = self.registry = CollectorRegistry()
        self.ready = Gauge("laplace_ready", "1 once warmup is done and the server admits requests", registry=r)
        self.slots = Gauge("laplace_slots", "state slots (the most concurrent sequences)", registry=r)
        self.slots.set(max_slots)
        self.busy_slots = Gauge("laplace_busy_slots", "slots holding a live sequence", registry=r)
        self.queue_depth = Gauge("laplace_queue_depth", "requests waiting for a slot", registry=r)
        self.tokens_per_s = Gauge(
            "laplace_output_tokens_per_second", "output tokens per second over the last 10 s", registry=r
        )
        self.warmup_seconds = Gauge("laplace_warmup_seconds", "seconds warmup took", registry=r)
        self.warmup_graphs = Gauge("laplace_warmup_graphs", "decode widths and prefill buckets warmed up", registry=r)
        self.requests = Counter(
            "laplace_requests", "engine requests by outcome (done, cancelled, failed)", ["outcome"], registry=r
        )
        self.rejections = Counter("laplace_rejections", "HTTP requests refused, by reason", ["reason"], registry=r)
        self.output_tokens = Counter("laplace_output_tokens", "tokens generated", registry=r)
        self.prompt_tokens = Counter("laplace_prompt_tokens", "prompt tokens prefilled", registry=r)
        self.compile_events = Counter(
            "laplace_compile_events", "graphs compiled while serving (after warmup; should stay 0)", registry=r
        )
        self.engine_errors = Counter("laplace_engine_errors", "engine steps that raised", ["kind"], registry=r)
        self.decode_steps = Counter("laplace_decode_steps", "decode steps by width", ["width"], registry=r)
        latency = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5)
        longer = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
        self.ttft = Histogram(
            "laplace_time_to_first_token_seconds", "arrival to first token", buckets=longer, registry=r
        )
        self.itl = Histogram(
            "laplace_inter_token_latency_seconds", "time between consecutive tokens", buckets=latency, registry=r
        )
        self.tpot = Histogram(
            "laplace_time_per_output_token_seconds", "mean per-token time after the first", buckets=latency, registry=r
        )
        self.e2e = Histogram(
            "laplace_e2e_request_latency_seconds", "arrival to last token", buckets=longer + (120.0,), registry=r
        )
        self.step_seconds = Histogram(
            "laplace_decode_step_seconds", "duration of one decode step", buckets=latency, registry=r
        )
        self._window: deque[tuple[float, int]] = deque()

    def count_tokens(self, now: float, n: int) -> None:
        self.output_tokens.inc(n)
        self._window.append((now, n))
        while self._window[0][0] < now - 10.0:
            self._window.popleft()
        self.tokens_per_s.set(sum(k for _, k in self._window) / 10.0)

    def exposition(self) -> tuple[bytes, str]:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return generate_latest(self.registry), CONTENT_TYPE_LATEST


# --------------------------------------------------------------------------- the engine thread


class QueueFull(Exception):
    def __init__(self, waiting: int, retry_after_s: int):
        super().__init__(f"queue full ({waiting} waiting)")
        self.retry_after_s = retry_after_s


class Draining(Exception):
    pass


@dataclass
class Ticket:
    """One engine request seen from the HTTP side: its events arrive on `events` (shared by the
    choices of one HTTP request) as (index, "token", id) and (index, "end", Completion)."""

    request: Request
    index: int
    events: asyncio.Queue


@dataclass
class _Shared:
    inbox: deque = field(default_factory=deque)
    cancels: list = field(default_factory=list)
    queued: int = 0  # the engine queue's length after the last step


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
        with self._cv:
            return len(self._shared.inbox) + self._shared.queued

    def submit(self, tickets: list[Ticket]) -> None:
        """Queue the requests of one HTTP request, all or none: raises Draining or QueueFull."""
        with self._cv:
            if self.draining or self._stop:
                raise Draining()
            waiting = len(self._shared.inbox) + self._shared.queued
            if waiting + len(tickets) > self.engine.max_queue:
                raise QueueFull(waiting, self._retry_after(waiting))
            for t in tickets:
                t.request.arrival_s = self.clock()
                self._shared.inbox.append(t)
            self._cv.notify()

    def cancel(self, request_id: int, reason: str) -> None:
        with self._cv:
            self._shared.cancels.append((request_id, reason))
            self._cv.notify()

    def _retry_after(self, waiting: int) -> int:
        """Seconds until the queue has likely room: the wait at the recent completion rate."""
        if len(self._done_rate) >= 2 and self._done_rate[-1] > self._done_rate[0]:
            rate = (len(self._done_rate) - 1) / (self._done_rate[-1] - self._done_rate[0])
            return max(1, min(60, math.ceil(max(1, waiting - self.engine.max_queue + 1) / rate)))
        return 1

    # -- the engine thread --------------------------------------------------------------------

    def _run(self) -> None:
        from laplace.runtime import compiled_graph_count

        try:
            started = time.perf_counter()
            seconds = self.engine.warmup(widths=self.warmup_widths, log=log.info)
            self.metrics.warmup_seconds.set(time.perf_counter() - started)
            self.metrics.warmup_graphs.set(len(seconds["decode"]) + len(seconds["prefill"]))
        except Exception as exc:  # a broken model or compiler: the server cannot serve
            self.fatal = f"warmup failed: {type(exc).__name__}: {exc}"
            log.error(self.fatal)
            if self.on_fatal:
                self.on_fatal()
            return
        self._graphs_after_warmup = compiled_graph_count()
        self.engine.on_token = self._on_token
        self._emitted: list[tuple[Completion, int]] = []
        self.ready.set()
        self.metrics.ready.set(1)
        log.info(
            "ready: %d slots, decode widths %s, prefill buckets %s, %s",
            self.engine.max_slots,
            self.engine.ladder if not self.engine.exact_widths else "exact",
            self.engine.buckets,
            f"serving under the {self.stance} stance" if self.stance and self.engine.compiled else "eager",
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

    def _iterate(self) -> bool:
        from laplace.runtime import compiled_graph_count

        engine = self.engine
        with self._cv:
            while not (self._shared.inbox or self._shared.cancels or engine.has_work() or self._stop):
                self._cv.wait(timeout=0.25)
            if self._stop:
                self._cancel_everything("server stopped")
                return False
            inbox, self._shared.inbox = self._shared.inbox, deque()
            self._shared.queued += len(inbox)  # still waiting, now in the engine's queue
            cancels, self._shared.cancels = self._shared.cancels, []
        engine.now = self.clock()
        for t in inbox:
            self._tickets[t.request.id] = t
            engine.submit(t.request)  # checked on the HTTP side already; a rejection ends it below
        for rid, reason in cancels:
            engine.cancel(rid, reason)
        if self.drain_deadline is not None and time.perf_counter() >= self.drain_deadline and engine.has_work():
            self._cancel_everything("server shutting down: cancelled at the end of the grace period")
        if engine.has_work():
            try:
                engine.step()
            except Exception as exc:  # the requests of that step are finished as failed (500); serving goes on
                kind = "unwarmed_shape" if "recompile" in str(exc).lower() else type(exc).__name__
                self.metrics.engine_errors.labels(kind).inc()
                failed = [c.request_id for c in engine.finished if c.status == "failed"]
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
        compiled = compiled_graph_count() - self._graphs_after_warmup
        if compiled > 0:
            self.metrics.compile_events.inc(compiled)
            self._graphs_after_warmup += compiled
            log.error("%d graph(s) compiled while serving", compiled)
        self._publish(engine.take_steps(), engine.take_finished())
        with self._cv:
            self._shared.queued = len(engine.queue)
        self.metrics.queue_depth.set(self.waiting())
        self.metrics.busy_slots.set(engine.pool.busy)
        return True

    def _cancel_everything(self, reason: str) -> None:
        for req in list(self.engine.queue):
            self.engine.cancel(req.id, reason)
        for row in list(self.engine.live):
            self.engine.cancel(row.request.id, reason)
        self._publish([], self.engine.take_finished())

    def _on_token(self, completion: Completion, token: int) -> None:
        self._emitted.append((completion, token))

    def _publish(self, steps: list[StepRecord], finished: list[Completion]) -> None:
        m = self.metrics
        for s in steps:
            if s.kind == "decode":
                m.decode_steps.labels(str(s.width)).inc()
                m.step_seconds.observe(s.seconds)
        events = []
        emitted, self._emitted = self._emitted, []
        if emitted:
            m.count_tokens(self.clock(), len(emitted))
        for c, token in emitted:
            if (t := self._tickets.get(c.request_id)) is not None:
                events.append((t, (t.index, "token", token)))
        for c in finished:
            t = self._tickets.pop(c.request_id, None)
            m.requests.labels(c.status).inc()
            if c.status == "done":
                m.prompt_tokens.inc(c.prompt_tokens)
                self._done_rate.append(self.clock())
                if c.ttft_s is not None:
                    m.ttft.observe(c.ttft_s)
                for gap in c.itl_s:
                    m.itl.observe(gap)
                if c.tpot_s is not None:
                    m.tpot.observe(c.tpot_s)
                if c.e2e_s is not None:
                    m.e2e.observe(c.e2e_s)
            if t is not None:
                events.append((t, (t.index, "end", c)))
        if events and self._aio is not None:
            self._aio.call_soon_threadsafe(_deliver, events)


def _deliver(events) -> None:
    for ticket, event in events:
        ticket.events.put_nowait(event)


# --------------------------------------------------------------------------- the OpenAI API


class ApiError(Exception):
    """An error answer in OpenAI's shape; `reason` labels it in laplace_rejections_total."""

    TYPES = {400: "invalid_request_error", 404: "not_found_error", 429: "rate_limit_error", 500: "server_error"}
    REASONS = {400: "invalid_request", 404: "model_not_found", 429: "queue_full", 503: "unavailable"}

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        headers: dict | None = None,
        reason: str | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.headers = status, message, param, headers or {}
        self.reason = reason or self.REASONS.get(status, str(status))

    def body(self) -> dict:
        kind = self.TYPES.get(self.status, "service_unavailable_error" if self.status == 503 else "error")
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": None}}


@dataclass
class CompletionParams:
    """A validated POST /v1/completions body."""

    prompts: list[list[int]]
    prompt_texts: list[str]
    max_tokens: int
    temperature: float
    top_p: float
    stop: list[str]
    seed: int | None
    stream: bool
    include_usage: bool
    echo: bool
    ignore_eos: bool
    return_token_ids: bool


# Fields of the OpenAI completions API we accept only at their neutral value (the value, and
# the reason it is the only one).
_NEUTRAL = {
    "n": (1, "only n=1 is supported"),
    "best_of": (1, "only best_of=1 is supported"),
    "logprobs": (None, "logprobs are not supported"),
    "suffix": (None, "suffix is not supported"),
    "presence_penalty": (0, "presence_penalty is not supported (only 0)"),
    "frequency_penalty": (0, "frequency_penalty is not supported (only 0)"),
    "logit_bias": (None, "logit_bias is not supported"),
}
_KNOWN = {
    "model",
    "prompt",
    "max_tokens",
    "temperature",
    "top_p",
    "stop",
    "seed",
    "stream",
    "stream_options",
    "echo",
    "user",
    "ignore_eos",
    "return_token_ids",
    *_NEUTRAL,
}


def _bad(param: str, message: str) -> ApiError:
    return ApiError(400, f"{param}: {message}", param)


def _int_field(body: dict, key: str, default, low: int | None = None, high: int | None = None):
    v = body.get(key)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int):
        raise _bad(key, f"expected an integer, got {json.dumps(v)[:40]}")
    if (low is not None and v < low) or (high is not None and v > high):
        raise _bad(key, f"must be in [{low}, {high}], got {v}")
    return v


def _float_field(body: dict, key: str, default: float, low: float, high: float, low_open: bool = False) -> float:
    v = body.get(key)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise _bad(key, f"expected a finite number, got {json.dumps(v)[:40]}")
    if v > high or v < low or (low_open and v <= low):
        raise _bad(key, f"must be in {'(' if low_open else '['}{low}, {high}], got {v}")
    return float(v)


def _bool_field(body: dict, key: str, default: bool) -> bool:
    v = body.get(key)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise _bad(key, f"expected true or false, got {json.dumps(v)[:40]}")
    return v


class CompletionsApi:
    """Validation and the response shapes of the OpenAI completions API over an EngineLoop."""

    def __init__(
        self, loop: EngineLoop, tokenizer, eos_id: int | None, model_name: str, max_tokens_limit: int, grace_s: float
    ):
        self.loop, self.tokenizer, self.eos_id = loop, tokenizer, eos_id
        self.model_name, self.max_tokens_limit, self.grace_s = model_name, max_tokens_limit, grace_s
        self.created = int(time.time())

    def parse(self, raw: bytes) -> CompletionParams:
        try:
            body = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ApiError(400, f"invalid JSON in the request body: {exc}") from None
        if not isinstance(body, dict):
            raise ApiError(400, f"the request body must be a JSON object, got {type(body).__name__}")
        unknown = sorted(set(body) - _KNOWN)
        if unknown:
            close = difflib.get_close_matches(unknown[0], sorted(_KNOWN), n=1)
            raise _bad(unknown[0], "unknown field" + (f" (did you mean '{close[0]}'?)" if close else ""))
        model = body.get("model")
        if not isinstance(model, str):
            raise _bad("model", f"required: the model to use ({self.model_name!r})")
        if model != self.model_name:
            raise ApiError(404, f"model {model!r} does not exist: this server serves {self.model_name!r}", "model")
        for key, (neutral, why) in _NEUTRAL.items():
            v = body.get(key)
            if v is not None and v != neutral and not (key == "logit_bias" and v == {}):
                raise _bad(key, why)
        engine = self.loop.engine
        prompts, texts = self._prompts(body.get("prompt"), engine)
        stop = body.get("stop")
        if stop is None:
            stop = []
        elif isinstance(stop, str):
            stop = [stop]
        if not (isinstance(stop, list) and len(stop) <= 4 and all(isinstance(s, str) and s for s in stop)):
            raise _bad("stop", "expected a non-empty string or a list of at most 4 of them")
        options = body.get("stream_options") or {}
        if not isinstance(options, dict) or set(options) - {"include_usage", "continuous_usage_stats"}:
            raise _bad("stream_options", "expected an object with include_usage")
        stream = _bool_field(body, "stream", False)
        return CompletionParams(
            prompts=prompts,
            prompt_texts=texts,
            max_tokens=_int_field(body, "max_tokens", min(16, self.max_tokens_limit), 1, self.max_tokens_limit),
            temperature=_float_field(body, "temperature", 1.0, 0.0, 2.0),
            top_p=_float_field(body, "top_p", 1.0, 0.0, 1.0, low_open=True),
            stop=stop,
            seed=_int_field(body, "seed", None, -(2**63), 2**64 - 1),
            stream=stream,
            include_usage=_bool_field(options, "include_usage", True),  # the final usage record, by default
            echo=_bool_field(body, "echo", False),
            ignore_eos=_bool_field(body, "ignore_eos", False),
            return_token_ids=_bool_field(body, "return_token_ids", False),
        )

    def _prompts(self, prompt, engine: DecodeEngine) -> tuple[list[list[int]], list[str]]:
        """Text, token ids, or a list of either: (ids per prompt, text per prompt)."""
        if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and isinstance(prompt[0], int)):
            prompt = [prompt]
        if not isinstance(prompt, list) or not prompt:
            raise _bad("prompt", "required: a string, a list of token ids, or a non-empty list of either")
        if len(prompt) > engine.max_queue:
            raise _bad("prompt", f"{len(prompt)} prompts in one request, at most {engine.max_queue}")
        ids, texts = [], []
        for i, p in enumerate(prompt):
            where = "prompt" if len(prompt) == 1 else f"prompt[{i}]"
            if isinstance(p, str):
                p_ids = self.tokenizer.encode(p).ids
                texts.append(p)
            elif isinstance(p, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
                p_ids = p
                texts.append(None)
            else:
                raise _bad(where, "expected a string or a list of integer token ids")
            try:
                engine.check(Request(0, p_ids, 1))
            except Rejected as exc:
                reason = "prompt_too_long" if "the limit is" in str(exc) else "invalid_request"
                raise ApiError(400, f"{where}: {exc}", "prompt", reason=reason) from None
            ids.append(list(p_ids))
        return ids, texts

    def tickets(self, params: CompletionParams) -> tuple[list[Ticket], asyncio.Queue]:
        events: asyncio.Queue = asyncio.Queue()
        seed = params.seed if params.seed is not None else secrets.randbits(63)
        stop_ids = () if params.ignore_eos or self.eos_id is None else (self.eos_id,)
        tickets = [
            Ticket(
                Request(self.loop.next_id(), ids, params.max_tokens, params.temperature, params.top_p, stop_ids, seed),
                i,
                events,
            )
            for i, ids in enumerate(params.prompts)
        ]
        return tickets, events

    def prompt_text(self, params: CompletionParams, i: int) -> str:
        text = params.prompt_texts[i]
        return text if text is not None else self.tokenizer.decode(params.prompts[i])


class IncrementalText:
    """The text of a growing list of token ids, handed out as it becomes final.

    Byte-level BPE can split a character over tokens: text is released only once it decodes
    without a replacement character (TGI and vLLM decode the same way, from a prefix offset,
    so each token costs a short decode). Text that could be the start of a stop string is held
    back until it is ruled out; at a stop string the text ends before it and `stopped` is set."""

    def __init__(self, tokenizer, stop: list[str] = ()):
        self.tokenizer = tokenizer
        self.stop = list(stop)
        self.ids: list[int] = []
        self.text = ""
        self.sent = 0
        self.stopped = False
        self.consumed = 0  # tokens up to (and with) the one that completed a stop string
        self._prefix = self._read = 0

    def add(self, token: int) -> str:
        self.ids.append(token)
        self.consumed = len(self.ids)
        done = self.tokenizer.decode(self.ids[self._prefix : self._read])
        now = self.tokenizer.decode(self.ids[self._prefix :])
        if len(now) > len(done) and not now.endswith("\ufffd"):
            self.text += now[len(done) :]
            self._prefix, self._read = self._read, len(self.ids)
        return self._release(final=False)

    def flush(self) -> str:
        """At the end: whatever is left, an incomplete character included."""
        if self._read < len(self.ids):
            done = self.tokenizer.decode(self.ids[self._prefix : self._read])
            self.text += self.tokenizer.decode(self.ids[self._prefix :])[len(done) :]
            self._prefix = self._read = len(self.ids)
        return self._release(final=True)

    def _release(self, final: bool) -> str:
        if self.stopped:
            return ""
        end = len(self.text)
        if self.stop:  # what was sent never ends in a stop string's start, so search from there
            hits = [i for s in self.stop if (i := self.text.find(s, self.sent)) >= 0]
            if hits:
                end = min(hits)
                self.text, self.stopped = self.text[:end], True
            elif not final:
                tail = self.text[self.sent :]
                keep = max((k for s in self.stop for k in range(1, len(s)) if tail.endswith(s[:k])), default=0)
                end -= keep
        out = self.text[self.sent : end]
        self.sent = end
        return out


class _Choice:
    """The text of one choice as tokens arrive: incremental detokenization, stop strings held back
    until they are ruled out, and the finish reason."""

    def __init__(self, api: CompletionsApi, params: CompletionParams, ticket: Ticket):
        self.ticket = ticket
        self.text = IncrementalText(api.tokenizer, params.stop)
        self.finish_reason: str | None = None
        self.error: str | None = None
        self.status = 200
        self.stop_ids = ticket.request.stop_ids

    def token(self, token: int) -> str:
        if self.finish_reason is not None:
            return ""  # tokens the engine made after a stop string matched
        delta = self.text.add(token)
        if self.text.stopped:
            self.finish_reason = "stop"
        return delta

    def end(self, c: Completion) -> str:
        if self.finish_reason is not None:  # stopped by a stop string; the engine cancel follows
            return ""
        if c.status == "done":
            last = c.output_ids[-1] if c.output_ids else None
            self.finish_reason = "stop" if last in self.stop_ids else "length"
            return self.text.flush()
        self.status = 500 if c.status == "failed" else 503
        self.error = c.reason or c.status
        self.finish_reason = "error"
        return self.text.flush()


def build_app(api: CompletionsApi, metrics: ServerMetrics):
    """The FastAPI application (the engine loop is started and stopped by its lifespan)."""
    from fastapi import FastAPI
    from fastapi.responses import JSONResponse, Response, StreamingResponse

    loop = api.loop

    @contextlib.asynccontextmanager
    async def lifespan(app):
        loop.start(asyncio.get_running_loop())
        try:
            yield
        finally:
            loop.stop()

    app = FastAPI(title="laplace", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)

    def error(exc: ApiError) -> JSONResponse:
        metrics.rejections.labels(exc.reason).inc()
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.get("/health")
    async def health():
        if loop.fatal:
            return JSONResponse({"status": "failed", "reason": loop.fatal}, status_code=503)
        if loop.draining:
            return JSONResponse({"status": "draining"}, status_code=503)
        if not loop.ready.is_set():
            return JSONResponse({"status": "warming up"}, status_code=503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def prometheus():
        body, content_type = metrics.exposition()
        return Response(body, media_type=content_type)

    @app.get("/v1/models")
    async def models():
        card = {"id": api.model_name, "object": "model", "created": api.created, "owned_by": "laplace"}
        card["max_prompt_tokens"] = loop.engine.max_prompt_tokens
        return {"object": "list", "data": [card]}

    @app.post("/v1/completions")
    async def completions(request: HttpRequest):
        try:
            params = api.parse(await request.body())
            if loop.fatal:
                raise ApiError(503, f"server unavailable: {loop.fatal}", reason="unavailable")
            if not loop.ready.is_set():
                raise ApiError(503, "warming up: retry once GET /health answers 200", reason="warming_up")
            tickets, events = api.tickets(params)
            try:
                loop.submit(tickets)
            except QueueFull as exc:
                raise ApiError(429, f"{exc}: retry later", None, {"Retry-After": str(exc.retry_after_s)}) from None
            except Draining:
                raise ApiError(503, "server shutting down: not admitting new requests", reason="draining") from None
        except ApiError as exc:
            return error(exc)
        rid = f"cmpl-{secrets.token_hex(12)}"
        choices = [_Choice(api, params, t) for t in tickets]
        if params.stream:
            return StreamingResponse(
                _sse(api, params, rid, tickets, choices, events),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            )
        return await _collect(api, params, rid, tickets, choices, events, request)

    return app


def _usage(params: CompletionParams, choices: list[_Choice]) -> dict:
    """Prompt tokens, and the generated tokens each choice used (up to its stop string)."""
    prompt = sum(len(p) for p in params.prompts)
    completion = sum(ch.text.consumed for ch in choices)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _cancel_unfinished(api: CompletionsApi, tickets, ended: set[int], reason: str) -> None:
    for t in tickets:
        if t.index not in ended:
            api.loop.cancel(t.request.id, reason)


async def _collect(api, params, rid, tickets, choices, events, request):
    from fastapi.responses import JSONResponse

    texts = [api.prompt_text(params, i) if params.echo else "" for i in range(len(tickets))]
    ended: set[int] = set()
    stop_cancelled: set[int] = set()
    try:
        while len(ended) < len(tickets):
            try:
                index, kind, value = await asyncio.wait_for(events.get(), timeout=1.0)
            except TimeoutError:
                if await request.is_disconnected():
                    _cancel_unfinished(api, tickets, ended, "client disconnected")
                    return JSONResponse({}, status_code=499)
                continue
            ch = choices[index]
            if kind == "token":
                texts[index] += ch.token(value)
                if ch.finish_reason == "stop" and index not in stop_cancelled:
                    stop_cancelled.add(index)
                    api.loop.cancel(tickets[index].request.id, "stop string")
            else:
                texts[index] += ch.end(value)
                ended.add(index)
    except asyncio.CancelledError:
        _cancel_unfinished(api, tickets, ended, "request cancelled")
        raise
    failed = [ch for ch in choices if ch.error]
    if failed:
        status = max(ch.status for ch in failed)
        message = f"generation failed: {failed[0].error}"
        return JSONResponse(ApiError(status, message).body(), status_code=status)
    out = []
    for i, ch in enumerate(choices):
        choice = {"index": i, "text": texts[i], "logprobs": None, "finish_reason": ch.finish_reason}
        if params.return_token_ids:
            choice["token_ids"] = ch.text.ids[: ch.text.consumed]
            choice["prompt_token_ids"] = params.prompts[i]
        out.append(choice)
    return {
        "id": rid,
        "object": "text_completion",
        "created": int(time.time()),
        "model": api.model_name,
        "choices": out,
        "usage": _usage(params, choices),
    }


async def _sse(api, params, rid, tickets, choices, events):
    created = int(time.time())

    def chunk(choices_: list[dict], **extra) -> str:
        body = {"id": rid, "object": "text_completion", "created": created, "model": api.model_name}
        body.update(choices=choices_, **extra)
        return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"

    def choice(i: int, text: str, finish: str | None = None, ids: list[int] | None = None) -> dict:
        out: dict[str, Any] = {"index": i, "text": text, "logprobs": None, "finish_reason": finish}
        if params.return_token_ids and ids is not None:
            out["token_ids"] = ids
        return out

    ended: set[int] = set()
    try:
        if params.echo:
            yield chunk([choice(i, api.prompt_text(params, i)) for i in range(len(tickets))])
        while len(ended) < len(tickets):
            index, kind, value = await events.get()
            ch = choices[index]
            if index in ended:
                continue
            if kind == "token":
                text = ch.token(value)
                if ch.finish_reason == "stop":  # a stop string: this choice is done here
                    ended.add(index)
                    api.loop.cancel(tickets[index].request.id, "stop string")
                    yield chunk([choice(index, text, "stop", [value])])
                else:
                    yield chunk([choice(index, text, None, [value])])
                continue
            text = ch.end(value)
            ended.add(index)
            if ch.error:
                if text:
                    yield chunk([choice(index, text)])
                err = ApiError(ch.status, f"generation failed: {ch.error}").body()
                yield f"data: {json.dumps(err)}\n\n"
            else:
                yield chunk([choice(index, text, ch.finish_reason, [])])
        if params.include_usage:
            yield chunk([], usage=_usage(params, choices))
        yield "data: [DONE]\n\n"
    finally:  # a client that went away (or any exit before the end): free the slots at the next step
        _cancel_unfinished(api, tickets, ended, "client disconnected")


# --------------------------------------------------------------------------- running it


def serve(
    engine: DecodeEngine,
    tokenizer,
    eos_id: int | None,
    *,
    host: str,
    port: int,
    model_name: str,
    max_tokens_limit: int,
    shutdown_grace_s: float,
    warmup_widths: list[int] | None = None,
    access_log: bool = False,
) -> int:
    """Serve until SIGTERM / SIGINT (a graceful drain) and return the exit status: 0, or 1 when
    warmup failed."""
    import uvicorn

    metrics = ServerMetrics(engine.max_slots)
    loop = EngineLoop(engine, metrics, warmup_widths=warmup_widths)
    api = CompletionsApi(loop, tokenizer, eos_id, model_name, max_tokens_limit, shutdown_grace_s)
    app = build_app(api, metrics)
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level="info",
        access_log=access_log,
        # a backstop only: the engine loop cancels what is left at shutdown_grace_s
        timeout_graceful_shutdown=shutdown_grace_s + 5.0,
        timeout_keep_alive=30,  # longer than clients keep idle connections (httpx: 5 s), so they close first
    )

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame):
            if not loop.draining:
                log.info(
                    "%s: draining (no new requests; in-flight ones get %.0fs to finish)",
                    signal.Signals(sig).name,
                    shutdown_grace_s,
                )
            loop.begin_drain(shutdown_grace_s)
            super().handle_exit(sig, frame)

    server = Server(config)
    loop.on_fatal = lambda: setattr(server, "should_exit", True)
    # The engine thread and the event loop share the GIL; Python hands it over every 5 ms by default,
    # which a decode step of a few ms then waits on. A shorter interval keeps both moving.
    sys.setswitchinterval(0.0005)
    # uvicorn re-raises the signal it caught once it has shut down, for the handler that was there
    # before it: with SIG_IGN there, a drained server returns and the process exits 0.
    previous = {sig: signal.signal(sig, signal.SIG_IGN) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        server.run()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 1 if loop.fatal else 0
