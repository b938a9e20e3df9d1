"""The scheduler: which requests wait, which are admitted into a slot, which rows decode together
and at what width; the requests' lifecycle (queued, running, finished) on a virtual clock.

As vLLM v1's scheduler decides what runs each step and updates the requests from the step's
outputs, this knows requests and widths but no tensors: the engine (serving/engine.py) asks it
for the next admission while a slot is free (`next_admission`), for the rows of the decode step
(`decode_plan`), and hands it each produced token (`emit`); a finished request's slot goes back
through the `release` callback at once, so the next admission reuses it. The request level is
here: a replay or the server's engine loop submits, cancels and drains finished requests and step
records (`take_finished`, `take_steps`) on `engine.scheduler` between the engine's steps.

Time is a virtual clock advanced by the measured duration of each step (`record`): a replayed
workload then gets the latencies a real server would, without sleeping through the gaps between
arrivals. The live server sets the clock to wall time before each step.
"""

from __future__ import annotations

import math
import numbers
import reprlib
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from laplace.errors import ConfigError, InputError
from laplace.serving.shapes import fit


class Rejected(InputError):
    """A request the engine will not serve (the message says why)."""


def _is_int(v) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def _is_real(v) -> bool:
    return isinstance(v, numbers.Real) and not isinstance(v, bool)


@dataclass
class Request:
    id: int
    prompt_ids: list[int]
    max_new_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    stop_ids: tuple[int, ...] = ()
    seed: int = 0
    arrival_s: float = 0.0
    logprobs: int | None = None  # top-N log-probs of each generated token (None: none)
    # vLLM's sampling fields (serving/sampling.py), at their neutral values by default
    top_k: int = 0  # 0 or -1: every token
    min_tokens: int = 0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # echo with logprobs: each prompt token's log-prob and the top N there, computed by its prefill
    prompt_logprobs: int | None = None


# one generated token's log-probs: (its own, [(token id, log-prob) of the top N])
TokenLogprobs = tuple[float, list[tuple[int, float]]]


@dataclass
class Completion:
    request_id: int
    status: str  # "done" | "rejected" | "cancelled" | "failed"
    reason: str = ""
    prompt_tokens: int = 0
    output_ids: list[int] = field(default_factory=list)
    arrival_s: float = 0.0
    admitted_s: float | None = None
    token_times: list[float] = field(default_factory=list)
    finished_s: float | None = None
    logprobs: list[TokenLogprobs] = field(default_factory=list)  # per output token, when asked for
    # the prompt's (None for its first token), when asked for: set as its prefill ends, before its first token
    prompt_logprobs: list[TokenLogprobs | None] | None = None

    @property
    def ttft_s(self) -> float | None:
        return self.token_times[0] - self.arrival_s if self.token_times else None

    @property
    def e2e_s(self) -> float | None:
        return None if self.finished_s is None else self.finished_s - self.arrival_s

    @property
    def itl_s(self) -> list[float]:
        return [b - a for a, b in zip(self.token_times, self.token_times[1:])]

    @property
    def tpot_s(self) -> float | None:
        """Mean time per output token after the first."""
        n = len(self.token_times)
        return (self.token_times[-1] - self.token_times[0]) / (n - 1) if n > 1 else None


@dataclass
class StepRecord:
    kind: str  # "prefill" | "decode"
    start_s: float
    seconds: float
    width: int  # rows computed (decode) or padded prompt length (prefill)
    live: int  # real rows
    compiled: bool  # a graph was compiled during this step


@dataclass
class Running:
    """A request holding a slot: its output so far is on its Completion."""

    request: Request
    completion: Completion
    slot: int
    prefilling: bool = False  # its prompt is still being prefilled, a chunk per step: no decode yet


@dataclass
class DecodePlan:
    """The decode step the scheduler asks for: these rows, in this order, at this width."""

    rows: list[Running]
    width: int


class Scheduler:
    def __init__(
        self,
        *,
        ladder: list[int],
        exact_widths: bool,
        max_queue: int,
        max_prompt_tokens: int,
        vocab_size: int,
        release: Callable[[int], None],
        max_context: int | None = None,
    ):
        """ladder: the decode widths (padded policy); exact_widths: decode at the live count
        instead. max_queue: requests that may wait for a slot; one arriving at a full queue is
        rejected. release(slot): called when a running request finishes. max_context: the tokens
        (prompt + generated) a slot's K/V cache holds, for a model with attention layers (None: no limit)."""
        if max_queue < 1:
            raise ConfigError(f"engine.max_queue: must be >= 1, got {max_queue}")
        self.ladder = ladder
        self.exact_widths = exact_widths
        self.max_queue = max_queue
        self.max_prompt_tokens = max_prompt_tokens
        self.vocab_size = vocab_size
        self.release = release
        self.max_context = max_context
        self.on_token: Callable[[Completion, int], None] | None = None  # called for every emitted token
        self.reset()

    def reset(self) -> None:
        self.now = 0.0
        self.queue: deque[Request] = deque()
        self.live: list[Running] = []
        self.finished: list[Completion] = []
        self.steps: list[StepRecord] = []

    def width_for(self, rows: int) -> int:
        """The decode width for `rows` live rows: the smallest ladder width that holds them
        (padded policy) or exactly their count."""
        return rows if self.exact_widths else fit(rows, self.ladder)

    # -- arrivals -------------------------------------------------------------------------------

    def check(self, req: Request) -> None:
        """Raise Rejected (one line naming the problem) for a request the engine cannot serve.
        Types are checked too: a malformed request must not crash the loop serving the others."""
        prompt = req.prompt_ids
        if not isinstance(prompt, (list, tuple)):
            raise Rejected(f"prompt_ids must be a list of token ids, got {type(prompt).__name__}")
        if not prompt:
            raise Rejected("empty prompt")
        if len(prompt) > self.max_prompt_tokens:
            raise Rejected(
                f"prompt has {len(prompt)} tokens, the limit is {self.max_prompt_tokens} (engine.max_prompt_tokens)"
            )
        if not _is_int(req.max_new_tokens):
            raise Rejected(f"max_new_tokens must be an integer, got {reprlib.repr(req.max_new_tokens)}")
        if req.max_new_tokens <= 0:
            raise Rejected(f"max_new_tokens must be > 0, got {req.max_new_tokens}")
        if self.max_context is not None and len(prompt) + req.max_new_tokens > self.max_context:
            raise Rejected(
                f"prompt of {len(prompt)} tokens + max_new_tokens {req.max_new_tokens} = "
                f"{len(prompt) + req.max_new_tokens} tokens is longer than the model's context, "
                f"engine.max_context={self.max_context} (its attention layers' K/V cache)"
            )
        vocab = self.vocab_size
        for i, t in enumerate(prompt):
            if not _is_int(t):
                raise Rejected(f"prompt token at position {i} is not an integer id: {reprlib.repr(t)}")
            if not 0 <= t < vocab:
                raise Rejected(f"prompt token id {t} at position {i} is outside the vocabulary [0, {vocab})")
        if not (
            _is_real(req.temperature)
            and _is_real(req.top_p)
            and math.isfinite(req.temperature)
            and req.temperature >= 0
            and 0 < req.top_p <= 1
        ):
            raise Rejected(
                f"temperature must be >= 0 (finite) and top_p in (0, 1], got "
                f"{reprlib.repr(req.temperature)}, {reprlib.repr(req.top_p)}"
            )
        if not (_is_int(req.seed) and -(2**63) <= req.seed < 2**64):  # stream_key hashes the low 64 bits
            raise Rejected(f"seed must be an integer in [-2**63, 2**64), got {reprlib.repr(req.seed)}")
        # vLLM's sampling fields, at vLLM's ranges
        if not (_is_int(req.top_k) and req.top_k >= -1):
            raise Rejected(f"top_k must be an integer >= -1 (-1 or 0: all tokens), got {reprlib.repr(req.top_k)}")
        if not (_is_int(req.min_tokens) and 0 <= req.min_tokens <= req.max_new_tokens):
            raise Rejected(f"min_tokens must be in [0, max_new_tokens={req.max_new_tokens}], got {req.min_tokens!r}")
        penalties = (req.repetition_penalty, req.presence_penalty, req.frequency_penalty)
        if not (
            all(_is_real(v) and math.isfinite(v) for v in penalties)
            and req.repetition_penalty > 0
            and -2 <= req.presence_penalty <= 2
            and -2 <= req.frequency_penalty <= 2
        ):
            raise Rejected(
                "repetition_penalty must be > 0 and presence_penalty, frequency_penalty in [-2, 2], got "
                f"{reprlib.repr(penalties)}"
            )

    def _reject(self, req: Request, reason: str) -> Completion:
        prompt_tokens = len(req.prompt_ids) if isinstance(req.prompt_ids, (list, tuple)) else 0
        done = Completion(req.id, "rejected", reason, prompt_tokens, arrival_s=req.arrival_s, finished_s=self.now)
        self.finished.append(done)
        return done

    def submit(self, req: Request) -> Completion | None:
        """Queue a request. A bad one, or one arriving while max_queue requests already wait, is
        rejected at once (the Completion is returned) and the engine carries on."""
        try:
            self.check(req)
        except Rejected as exc:
            return self._reject(req, str(exc))
        if len(self.queue) >= self.max_queue:  # shed load now rather than grow latency and memory without bound
            return self._reject(req, f"queue full ({len(self.queue)} waiting)")
        self.queue.append(req)
        return None

    def cancel(self, request_id: int, reason: str = "cancelled") -> Completion | None:
        """Drop a waiting or running request (its slot is released). Returns its Completion
        (status "cancelled", the tokens so far), or None if it is not here."""
        for req in self.queue:
            if req.id == request_id:
                self.queue.remove(req)
                done = Completion(
                    req.id, "cancelled", reason, len(req.prompt_ids), arrival_s=req.arrival_s, finished_s=self.now
                )
                self.finished.append(done)
                return done
        for row in self.live:
            if row.request.id == request_id:
                self.finish(row, "cancelled", reason)
                return row.completion
        return None

    def cancel_all(self, reason: str, waiting_only: bool = False) -> None:
        """Cancel every waiting request and, unless `waiting_only`, every running one (a server
        stopping, or draining: a request still waiting will not get a slot before the end)."""
        ids = [req.id for req in self.queue] + ([] if waiting_only else [row.request.id for row in self.live])
        for request_id in ids:
            self.cancel(request_id, reason)

    def has_work(self) -> bool:
        return bool(self.queue or self.live)

    def counts(self) -> tuple[int, int]:
        """(waiting, running) requests: vLLM's get_request_counts."""
        return len(self.queue), len(self.live)

    def take_finished(self, ids: set[int] | None = None) -> list[Completion]:
        """The completions finished since the last call (a live server drains them every step);
        with `ids`, only those requests' (the others stay for their own caller)."""
        if ids is None:
            done, self.finished = self.finished, []
            return done
        done = [c for c in self.finished if c.request_id in ids]
        self.finished = [c for c in self.finished if c.request_id not in ids]
        return done

    def take_steps(self) -> list[StepRecord]:
        steps, self.steps = self.steps, []
        return steps

    # -- the step plan ----------------------------------------------------------------------------

    def next_admission(self, free_slots: int) -> Request | None:
        """The next waiting request to prefill, first come first served, while a slot is free.
        Asked again after each admission: a request that ends at its first token frees its slot
        for the next one within the same step."""
        return self.queue.popleft() if self.queue and free_slots else None

    def start(self, req: Request, slot: int) -> Running:
        """`req` runs in `slot` from now (its prefill follows)."""
        done = Completion(
            req.id, "done", prompt_tokens=len(req.prompt_ids), arrival_s=req.arrival_s, admitted_s=self.now
        )
        row = Running(req, done, slot)
        self.live.append(row)
        return row

    def decode_plan(self) -> DecodePlan | None:
        """Every running request past its prefill, one token each, at the width for their count
        (None: nothing runs)."""
        rows = [row for row in self.live if not row.prefilling]
        if not rows:
            return None
        return DecodePlan(rows, self.width_for(len(rows)))

    # -- the step's outputs -------------------------------------------------------------------------

    def record(self, kind: str, seconds: float, width: int, live: int, compiled: bool) -> None:
        """A step ran: record it and advance the clock by its duration."""
        self.steps.append(StepRecord(kind, self.now, seconds, width, live, compiled))
        self.now += seconds

    def emit(self, row: Running, token: int) -> None:
        """A token produced for `row`: appended, and the request finished at a stop id or its limit."""
        c = row.completion
        c.output_ids.append(token)
        c.token_times.append(self.now)
        if token in row.request.stop_ids or len(c.output_ids) >= row.request.max_new_tokens:
            self.finish(row)
        if self.on_token is not None:
            self.on_token(c, token)

    def finish(self, row: Running, status: str = "done", reason: str = "") -> None:
        c = row.completion
        c.status, c.reason, c.finished_s = status, reason, self.now
        self.live.remove(row)
        self.release(row.slot)  # free at once: the next admission reuses it
        self.finished.append(c)
