"""Continuous-batching decode engine over a fixed pool of recurrent-state slots.

The state of every live sequence sits in one fixed-shape `State` of max_slots + 1
rows; the last row is a dummy that padding rows read and write, so a pad row never
touches a real sequence and is never indexed with -1. Requests are admitted into
free slots, prefilled one at a time through padded prefill-length buckets (a prompt
longer than the largest bucket goes in pieces; padding is an exact no-op for the
state), then decoded together. With the `padded` policy each decode step runs at the
smallest width of a fixed ladder that holds the live rows, so a static-shape compiler
(torch.compile(dynamic=False) with Inductor, or Neuron) sees only the ladder's widths,
all compiled ahead by `warmup()`. With the `exact` policy each step runs at exactly the
live count: every new width compiles on first sight, which is the stall the article
measured.

Time is a virtual clock advanced by the measured duration of each operation: a
replayed workload then gets the latencies a real server would, without sleeping
through the gaps between arrivals. The live server (serving/server.py) sets the clock to
wall time before each step.

The engine is the one place that knows about shapes: `admit` (a zeroed slot), `prefill`
(bucket pieces), `decode` (a ladder width, pad rows on the dummy slot) and `release` are
what the scheduler below, the probes, the numerics checks, generation and the server use.
"""

from __future__ import annotations

import contextlib
import math
import numbers
import reprlib
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor, nn

from laplace.config import EngineSection
from laplace.errors import ConfigError, InputError, one_line
from laplace.model.kernels import resolve_kernel
from laplace.model.lm import LaplaceLM, State
from laplace.runtime import compile_cache_counts, compile_static, compiled_graph_count, synchronize
from laplace.serving.prefix_cache import PrefixCache
from laplace.serving.sampling import apply_penalties, logprobs_of, sample_next, stream_key

POLICIES = ("padded", "exact", "eager")
# The `engine:` params that decide an engine's shapes (the MLflow model is logged with them).
SHAPE_KEYS = ("max_slots", "widths", "prefill_buckets", "max_prompt_tokens", "max_queue")


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


def width_ladder(max_slots: int, widths: list[int] | None = None) -> list[int]:
    """The decode widths: `widths` sorted, or powers of two up to max_slots (max_slots included)."""
    if widths:
        ladder = sorted(set(widths))
        if ladder[0] < 1:
            raise ConfigError(f"engine.widths: widths must be >= 1, got {ladder}")
        if ladder[-1] < max_slots:
            raise ConfigError(f"engine.widths: the largest width {ladder[-1]} cannot hold max_slots={max_slots}")
        return ladder
    ladder = [1 << i for i in range(max_slots.bit_length()) if (1 << i) < max_slots]
    return ladder + [max_slots]


def fit(n: int, ladder: list[int]) -> int:
    """Smallest ladder entry >= n."""
    for w in ladder:
        if w >= n:
            return w
    raise ValueError(f"{n} rows do not fit the largest width {ladder[-1]}")


def prefill_pieces(n: int, buckets: list[int]) -> list[tuple[int, int]]:
    """(real tokens, bucket) of each piece a prompt of n tokens is prefilled in: full pieces of
    the largest bucket, then the rest right-padded to the smallest bucket that holds it."""
    largest = buckets[-1]
    return [(min(largest, n - start), fit(min(largest, n - start), buckets)) for start in range(0, n, largest)]


class SlotPool:
    """max_slots state rows for live sequences plus one dummy row (index max_slots) for padding."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.dummy = capacity
        self._free: deque[int] = deque(range(capacity))
        self._owner: dict[int, int] = {}

    def acquire(self, request_id: int) -> int:
        if not self._free:
            raise RuntimeError(f"no free slot: all {self.capacity} are owned")
        slot = self._free.popleft()
        self._owner[slot] = request_id
        return slot

    def release(self, slot: int) -> None:
        if slot not in self._owner:
            raise RuntimeError(f"slot {slot} released twice")
        del self._owner[slot]
        self._free.append(slot)

    @property
    def free(self) -> int:
        return len(self._free)

    @property
    def busy(self) -> int:
        return len(self._owner)

    @property
    def owners(self) -> dict[int, int]:
        return dict(self._owner)


@dataclass
class _Live:
    request: Request
    completion: Completion
    slot: int


class SlotStates(nn.Module):
    """The state pool as module buffers, and the two computations over it.

    As gpt-fast keeps its KV cache: buffers have static addresses, so a compiled step (and a
    CUDA graph of it) reads and writes them in place, rows picked by `slots`, instead of taking
    them as inputs. `decode` is one whole decode step: the model's recurrent form, then the
    sampler on the device, returning the next tokens and the logits; nothing in it reads a value
    back to the host."""

    def __init__(self, model: LaplaceLM, rows: int):
        super().__init__()
        self.model = model
        state = model.allocate_state(rows)
        self.register_buffer("recurrent", state.recurrent, persistent=False)
        self.register_buffer("conv", state.conv, persistent=False)
        # per slot, for vLLM's sampling fields: the prompt's tokens (repetition_penalty), how often
        # each token was generated (the penalties), the request's stop tokens (min_tokens)
        V, device = model.cfg.vocab_size, state.recurrent.device
        self.register_buffer("seen", torch.zeros(rows, V, dtype=torch.bool, device=device), persistent=False)
        self.register_buffer("counts", torch.zeros(rows, V, dtype=torch.int32, device=device), persistent=False)
        self.register_buffer("stops", torch.zeros(rows, V, dtype=torch.bool, device=device), persistent=False)

    def state(self) -> State:
        return State(self.recurrent, self.conv)

    def sample(self, logits: Tensor, ints: Tensor, floats: Tensor) -> Tensor:
        """The next token of each row from its raw logits: min_tokens and the penalties over the
        slot's history, then temperature / top-k / top-p (serving/sampling.py, vLLM's order). The
        drawn token is counted in its slot's history. ints [6, W] (tokens, slots, keys, top_k,
        min_tokens still to go > 0, unused), floats [5, W] (temperature, top_p, repetition,
        frequency, presence)."""
        W = ints.shape[1]
        if ints.shape[0] < 6:  # callers of the plain form (tokens, slots, keys): vLLM's fields neutral
            ints = torch.cat([ints, ints.new_zeros(6 - ints.shape[0], W)])
        if floats.shape[0] < 5:
            neutral = torch.tensor([[1.0], [0.0], [0.0]], device=floats.device).expand(3, W)
            floats = torch.cat([floats, neutral[floats.shape[0] - 2 :]])
        _, slots, keys, top_k, before_min, _ = ints.unbind(0)
        temperature, top_p, repetition, frequency, presence = floats.unbind(0)
        adjusted = apply_penalties(logits, self.seen[slots], self.counts[slots], repetition, frequency, presence)
        adjusted = adjusted.masked_fill(self.stops[slots] & (before_min > 0).unsqueeze(-1), float("-inf"))
        tokens = sample_next(adjusted, temperature, top_p, keys, top_k)
        self.counts.index_put_((slots, tokens), torch.ones_like(tokens, dtype=torch.int32), accumulate=True)
        return tokens

    def decode(self, ints: Tensor, floats: Tensor) -> tuple[Tensor, Tensor]:
        """ints [6, W] (tokens, slots, sampling keys, top_k, min_tokens to go, unused), floats [5, W]
        (temperature, top_p, repetition, frequency and presence penalties): one token per row, packed
        so a step copies two small inputs. Returns (next tokens [W], raw logits [W, V])."""
        tokens, slots = ints[0], ints[1]
        logits = self.model.decode_step(tokens, State(self.recurrent, self.conv), slots)
        return self.sample(logits, ints, floats), logits

    def prefill(self, tokens: Tensor, slots: Tensor, lengths: Tensor) -> Tensor:
        return self.model.prefill(tokens, State(self.recurrent, self.conv), slots, lengths)


class DecodeEngine:
    def __init__(
        self,
        model: LaplaceLM,
        *,
        max_slots: int,
        ladder: list[int],
        prefill_buckets: list[int],
        max_prompt_tokens: int,
        compile_scope: str | None,
        exact_widths: bool = False,
        backend: str = "inductor",
        pad_id: int = 0,
        max_queue: int = EngineSection.max_queue,  # the params.yaml default
        prefix_cache_bytes: int = 0,
        prefix_cache_min_tokens: int = EngineSection.prefix_cache_min_tokens,
    ):
        """compile_scope: None (eager), "model" (each decode width / prefill bucket is one graph)
        or "block" (one GLA block is compiled per shape and reused by every layer).
        max_prompt_tokens: longer prompts are rejected (prompts longer than the largest bucket
        are prefilled in pieces). max_queue: requests that may wait for a slot; one arriving at
        a full queue is rejected. prefix_cache_bytes: the budget of the state prefix cache of
        requests' prompts (0: off; serving/prefix_cache.py)."""
        if max_queue < 1:
            raise ConfigError(f"engine.max_queue: must be >= 1, got {max_queue}")
        if prefix_cache_bytes < 0:
            raise ConfigError(
                f"engine.prefix_cache_bytes: must be >= 0 (0 turns the cache off), got {prefix_cache_bytes}"
            )
        if not prefill_buckets or min(prefill_buckets) < 1:
            raise ConfigError(f"engine.prefill_buckets: need at least one length >= 1, got {prefill_buckets}")
        self.model = model.eval()
        first = next(model.parameters())
        self.device = first.device
        resolve_kernel(model.cfg.kernel, self.device, first.dtype)  # model.kernel: fla where it cannot run fails now
        self.max_slots = max_slots
        self.slot_states = SlotStates(model, max_slots + 1)
        self.state: State = self.slot_states.state()  # views of the buffers: the same memory
        self.ladder = ladder
        self.buckets = sorted(set(prefill_buckets))
        self.max_prompt_tokens = max_prompt_tokens
        self.exact_widths = exact_widths
        self.max_queue = max_queue
        self.compiled = compile_scope is not None
        self.pad_id = pad_id
        self.on_logits = None  # optional callback(logits of a step's real rows), for inspection
        self.on_token: Callable[[Completion, int], None] | None = None  # called for every emitted token
        self.prefix_cache = PrefixCache(prefix_cache_bytes, prefix_cache_min_tokens)
        self.warmup_report: dict[str, float] = {}  # what the last warmup() compiled or loaded (see there)
        self.reset()
        self._decode, self._prefill = self.slot_states.decode, self.slot_states.prefill
        # CUDA graphs for the whole decode step (gpt-fast's "reduce-overhead"): on a GPU an eager or
        # per-block step is bound by kernel launches. Prefill, longer and run once per request, is not graphed.
        self.cuda_graphs = compile_scope == "model" and self.device.type == "cuda" and backend == "inductor"
        if compile_scope == "model":
            self._decode = compile_static(
                self.slot_states.decode, backend, mode="reduce-overhead" if self.cuda_graphs else None
            )
            self._prefill = compile_static(self.slot_states.prefill, backend)
        elif compile_scope == "block":
            for block in model.blocks:
                compile_static(block, backend)
        elif compile_scope is not None:
            raise ConfigError(f"engine.compile_scope: unknown scope {compile_scope!r} (block or model)")

    @classmethod
    def for_policy(
        cls, model: LaplaceLM, engine: EngineSection, policy: str, backend: str = "inductor"
    ) -> DecodeEngine:
        """The engine of a serving policy from the `engine:` params: `padded` (ladder widths,
        compiled), `exact` (live-count widths, compiled) or `eager` (live-count widths, no compiler)."""
        if policy not in POLICIES:
            raise ConfigError(f"unknown serving policy {policy!r} (choose from {', '.join(POLICIES)})")
        return cls(
            model,
            max_slots=engine.max_slots,
            ladder=width_ladder(engine.max_slots, engine.widths),
            prefill_buckets=engine.prefill_buckets,
            max_prompt_tokens=engine.max_prompt_tokens,
            compile_scope=None if policy == "eager" else engine.compile_scope,
            exact_widths=policy != "padded",
            backend=backend,
            max_queue=engine.max_queue,
            prefix_cache_bytes=engine.prefix_cache_bytes,
            prefix_cache_min_tokens=engine.prefix_cache_min_tokens,
        )

    @classmethod
    def single(cls, model: LaplaceLM) -> DecodeEngine:
        """One eager slot for one-off generation: prompts of any length (prefilled in pieces of
        the default buckets), decoded at width 1."""
        engine = EngineSection()
        return cls(
            model,
            max_slots=1,
            ladder=[1],
            prefill_buckets=engine.prefill_buckets,
            max_prompt_tokens=2**62,
            compile_scope=None,
            exact_widths=True,
        )

    def graphs_needed(self) -> int:
        """Distinct shapes one compiled function may see: sets the recompile limit."""
        return (self.max_slots if self.exact_widths else len(self.ladder)) + len(self.buckets)

    def reset(self) -> None:
        """Forget requests, timings and cached prefixes (compiled graphs stay), for the next workload."""
        self.prefix_cache.clear()
        self.pool = SlotPool(self.max_slots)
        self.now = 0.0
        self.queue: deque[Request] = deque()
        self.live: list[_Live] = []
        self.finished: list[Completion] = []
        self.steps: list[StepRecord] = []
        self.state.zero_()

    # -- the two graphs (over the state buffers, mutated in place) -----------------------------

    def step_rows(
        self, tokens: Tensor, slots: Tensor, temperature: Tensor, top_p: Tensor, keys: Tensor
    ) -> tuple[Tensor, Tensor]:
        """The decode graph on exactly these rows (no padding: `decode` pads): next tokens [W] and
        logits [W, V], both still on the device. Under CUDA graphs both live in the graph's static
        memory until the next step: read or copy them before it."""
        return self._run_step(torch.stack([tokens, slots, keys]), torch.stack([temperature, top_p]))

    def _run_step(self, ints: Tensor, floats: Tensor) -> tuple[Tensor, Tensor]:
        if self.cuda_graphs:
            torch.compiler.cudagraph_mark_step_begin()  # a new step: the last step's outputs may be overwritten
        return self._decode(ints, floats)

    def decode_rows(self, tokens: Tensor, slots: Tensor) -> Tensor:
        """The decode graph, greedy, on exactly these rows: their logits [W, V] (a copy)."""
        n = tokens.shape[0]
        zeros = torch.zeros(n, dtype=torch.long, device=self.device)
        greedy = torch.zeros(n, device=self.device), torch.ones(n, device=self.device)
        return self.step_rows(tokens, slots, *greedy, zeros)[1].clone()

    def prefill_rows(self, tokens: Tensor, slots: Tensor, lengths: Tensor) -> Tensor:
        """The prefill graph on exactly these tokens (no padding: `prefill` pads)."""
        return self._prefill(tokens, slots, lengths)

    # -- the shapes: every caller goes through these four --------------------------------------

    def admit(self, owner: int) -> int:
        """A free slot for `owner`, zeroed: a reused slot must not carry its last sequence's state
        (nor its sampling history)."""
        slot = self.pool.acquire(owner)
        self.state.zero_(torch.tensor([slot], device=self.device))
        ss = self.slot_states
        ss.seen[slot] = False
        ss.counts[slot] = 0
        ss.stops[slot] = False
        return slot

    def set_history(self, slot: int, req: Request) -> None:
        """The slot's sampling history for vLLM's fields: the prompt's tokens (repetition_penalty)
        and the request's stop tokens (min_tokens)."""
        ss = self.slot_states
        ss.seen[slot, torch.as_tensor(req.prompt_ids, device=self.device)] = True
        if req.stop_ids:
            ss.stops[slot, torch.as_tensor(list(req.stop_ids), device=self.device)] = True

    def release(self, slot: int) -> None:
        self.pool.release(slot)

    @contextlib.contextmanager
    def leased(self, owners: Iterable[int]) -> Iterator[list[int]]:
        """Admit one slot per owner for the block; release them all after it, whatever happens."""
        slots: list[int] = []
        try:
            for owner in owners:
                slots.append(self.admit(owner))
            yield slots
        finally:
            for slot in slots:
                self.release(slot)

    def width_for(self, rows: int) -> int:
        """The decode width for `rows` live rows: the smallest ladder width that holds them
        (padded policy) or exactly their count."""
        return rows if self.exact_widths else fit(rows, self.ladder)

    @torch.inference_mode()
    def prefill(self, slot: int, prompt_ids) -> Tensor:
        """Run a prompt of any length into `slot`, continuing its state, through the bucket graphs
        only (see prefill_pieces; each piece continues the state and padding is an exact no-op, so
        the result equals one prefill of the whole prompt). Returns the last token's logits [1, V]."""
        ids = torch.as_tensor(np.asarray(prompt_ids, dtype=np.int64)).flatten()
        if ids.numel() == 0:
            raise ValueError("prompt is empty: at least one token is needed")
        slots = torch.tensor([slot], device=self.device)
        logits, start = None, 0
        for n, bucket in prefill_pieces(ids.numel(), self.buckets):
            tokens = torch.full((1, bucket), self.pad_id, dtype=torch.long)
            tokens[0, :n] = ids[start : start + n]
            logits = self.prefill_rows(tokens.to(self.device), slots, torch.tensor([n], device=self.device))
            start += n
        return logits

    @torch.inference_mode()
    def prefill_cached(self, slot: int, prompt_ids) -> tuple[Tensor, int]:
        """`prefill` of a request's prompt into its freshly admitted (zeroed) slot through the prefix
        cache: the state of the longest cached prefix is copied into the slot and only the rest is
        prefilled; the state at the split point the cache asks for and after the whole prompt is
        stored (serving/prefix_cache.py says which). Returns (the last token's logits [1, V], the
        padded tokens computed)."""
        ids = np.asarray(prompt_ids, dtype=np.int64).ravel()
        if not self.prefix_cache.enabled:
            return self.prefill(slot, ids), self.padded_tokens(len(ids))
        plan = self.prefix_cache.plan(ids, self.padded_tokens)
        rows = torch.tensor([slot], device=self.device)
        if plan.state is not None:
            self._write_rows(rows, plan.state)
        if plan.logits is not None:  # an exact repeat: the state and the last logits are cached
            return plan.logits.clone(), 0
        start, computed = plan.start, 0
        if plan.split is not None:
            logits = self.prefill(slot, ids[start : plan.split])
            computed += self.padded_tokens(plan.split - start)
            self.prefix_cache.put(ids[: plan.split], self.state.select(rows), logits.clone())
            start = plan.split
        logits = self.prefill(slot, ids[start:])
        self.prefix_cache.put(ids, self.state.select(rows), logits.clone())
        return logits, computed + self.padded_tokens(len(ids) - start)

    def _write_rows(self, rows: Tensor, state: State) -> None:
        self.state.recurrent.index_copy_(1, rows, state.recurrent)
        if self.state.conv is not None:
            self.state.conv.index_copy_(1, rows, state.conv)

    def padded_tokens(self, n: int) -> int:
        """Tokens the bucket graphs compute for an n-token prefill (its pieces, padded)."""
        return sum(b for _, b in prefill_pieces(n, self.buckets))

    def prefix_cache_stats(self) -> dict[str, int]:
        """The state prefix cache's counters: hits and misses (requests that did or did not start
        from a cached prefix), bytes held, evictions; also entries and hit_tokens (prefill saved)."""
        return self.prefix_cache.stats()

    @torch.inference_mode()
    def decode(self, slots: Sequence[int], tokens, width: int | None = None) -> Tensor:
        """One decode step of the sequences in `slots`, each fed its token, at `width` rows
        (default: width_for(len(slots))). The pad rows take pad tokens and the dummy slot, so they
        never touch a live sequence. Returns the real rows' logits [len(slots), V]."""
        n = len(slots)
        width = self.width_for(n) if width is None else width
        if width < n or not (self.exact_widths or width in self.ladder):
            raise ValueError(f"cannot decode {n} rows at width {width} (ladder {self.ladder})")
        tokens = torch.as_tensor(tokens, dtype=torch.long).flatten().to(self.device)
        pad = width - n
        if pad:
            tokens = torch.cat([tokens, torch.full((pad,), self.pad_id, dtype=torch.long, device=self.device)])
        rows = torch.tensor(list(slots) + [self.pool.dummy] * pad, device=self.device)
        return self.decode_rows(tokens, rows)[:n]

    # -- warmup ---------------------------------------------------------------------------------

    @torch.inference_mode()
    def warmup(
        self,
        widths: list[int] | None = None,
        buckets: list[int] | None = None,
        log: Callable[[str], None] | None = None,
    ) -> dict[str, dict[int, float]]:
        """Run every decode width (the ladder, or every live count with exact widths) and prefill
        bucket, or the given ones, once on the dummy slot, compiling them when compiled. `log`
        gets a line as each graph starts and one with its seconds, so a cold compile of minutes
        is not silent, then a summary: how many graphs were loaded from the compile cache (a
        server started after `laplace warmup` must load all of them). Returns seconds per graph;
        `warmup_report` keeps the counts.

        A graph is loaded (Inductor's FX graph cache hit, no miss), compiled (a miss: the cache
        did not have it, e.g. it was built under another thread count, which Inductor's cache
        key includes) or already compiled in this process."""
        dummy = self.pool.dummy
        counts = {"loaded_from_cache": 0, "compiled": 0, "already_compiled": 0, "eager": 0}
        started = time.perf_counter()
        out: dict[str, dict[int, float]] = {"decode": {}, "prefill": {}}
        if widths is None:
            widths = list(range(1, self.max_slots + 1)) if self.exact_widths else self.ladder
        shapes = [("decode", w) for w in widths]
        shapes += [("prefill", b) for b in (self.buckets if buckets is None else buckets)]
        for i, (kind, size) in enumerate(shapes, 1):
            what = f"{kind} {'width' if kind == 'decode' else 'bucket'} {size}"
            if log:
                log(f"warmup {i}/{len(shapes)}: {what} ...")
            before, cache_before = compiled_graph_count(), compile_cache_counts()
            if kind == "decode":
                tokens = torch.full((size,), self.pad_id, dtype=torch.long, device=self.device)
                slots = torch.full((size,), dummy, dtype=torch.long, device=self.device)
                seconds = self._timed(lambda t=tokens, s=slots: self.decode_rows(t, s))[1]
            else:
                tokens = torch.full((1, size), self.pad_id, dtype=torch.long, device=self.device)
                slots = torch.tensor([dummy], device=self.device)
                lengths = torch.tensor([size], device=self.device)
                seconds = self._timed(lambda t=tokens, s=slots, n=lengths: self.prefill_rows(t, s, n))[1]
            out[kind][size] = seconds
            hits, misses = (now - then for now, then in zip(compile_cache_counts(), cache_before))
            if not self.compiled:
                how, count = "ran eagerly", "eager"
            elif compiled_graph_count() == before:
                how, count = "was already compiled", "already_compiled"
            elif misses or not hits:  # Neuron has no FX graph cache counters: counted as compiled
                how, count = "compiled", "compiled"
            else:
                how, count = "loaded from the compile cache", "loaded_from_cache"
            counts[count] += 1
            if log:
                log(f"warmup {i}/{len(shapes)}: {what} {how} in {seconds:.2f}s")
        self.state.zero_()
        self.warmup_report = {"graphs": len(shapes), **counts, "seconds": time.perf_counter() - started}
        if log and self.compiled:
            r = self.warmup_report
            log(
                f"warmup: {r['graphs']} graphs in {r['seconds']:.1f}s, loaded from cache "
                f"{r['loaded_from_cache']}/{r['graphs']}, compiled {r['compiled']}, "
                f"already compiled {r['already_compiled']}"
            )
        return out

    def _timed(self, fn):
        start = time.perf_counter()
        result = fn()
        synchronize(self.device)
        return result, time.perf_counter() - start

    # -- requests -------------------------------------------------------------------------------

    def check(self, req: Request) -> None:
        """Raise Rejected (one line naming the problem) for a request the engine cannot serve.
        Types are checked too: a malformed request must not crash the loop serving the others."""
        prompt = req.prompt_ids
        if not isinstance(prompt, (list, tuple)):
            raise Rejected(f"prompt_ids must be a list of token ids, got {type(prompt).__name__}")
        if not prompt:
            raise Rejected("empty prompt")
        if len(prompt) > self.max_prompt_tokens:
            raise Rejected(f"prompt has {len(prompt)} tokens, the limit is {self.max_prompt_tokens}")
        if not _is_int(req.max_new_tokens):
            raise Rejected(f"max_new_tokens must be an integer, got {reprlib.repr(req.max_new_tokens)}")
        if req.max_new_tokens <= 0:
            raise Rejected(f"max_new_tokens must be > 0, got {req.max_new_tokens}")
        vocab = self.model.cfg.vocab_size
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
        """Drop a waiting or live request (its slot is free for the next admission). Returns its
        Completion (status "cancelled", the tokens so far), or None if it is not here."""
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
                self._finish(row, "cancelled", reason)
                return row.completion
        return None

    def has_work(self) -> bool:
        return bool(self.queue or self.live)

    def take_finished(self) -> list[Completion]:
        """The completions finished since the last call (a live server drains them every step)."""
        done, self.finished = self.finished, []
        return done

    def take_steps(self) -> list[StepRecord]:
        steps, self.steps = self.steps, []
        return steps

    def complete(self, requests: list[Request]) -> list[Completion]:
        """Serve a batch to the end, all arriving now (as many wait as the queue takes), decoding
        the live ones together at the ladder widths. Completions in the order of `requests`."""
        ids = {r.id for r in requests}
        pending = deque(requests)
        while pending or self.has_work():
            while pending and len(self.queue) < self.max_queue:
                self.submit(pending.popleft())
            if self.has_work():
                self.step()
        mine = {c.request_id: c for c in self.finished if c.request_id in ids}
        self.finished = [c for c in self.finished if c.request_id not in ids]
        return [mine[r.id] for r in requests]

    # -- one scheduler iteration -----------------------------------------------------------------

    @torch.inference_mode()
    def step(self) -> None:
        """Admit queued requests into free slots (prefilling each), then one decode step.
        A request whose prefill or decode step raises is finished as "failed" (its slot freed)
        and the error propagates: a replay stops, a server answers those requests with an error."""
        while self.queue and self.pool.free:
            self._admit(self.queue.popleft())
        if self.live:
            self._decode_step()

    def _record(self, kind: str, seconds: float, width: int, live: int, graphs_before: int) -> None:
        compiled = self.compiled and compiled_graph_count() > graphs_before
        self.steps.append(StepRecord(kind, self.now, seconds, width, live, compiled))
        self.now += seconds

    def _admit(self, req: Request) -> None:
        done = Completion(
            req.id, "done", prompt_tokens=len(req.prompt_ids), arrival_s=req.arrival_s, admitted_s=self.now
        )
        live = _Live(req, done, self.admit(req.id))
        self.set_history(live.slot, req)
        before = compiled_graph_count()
        try:
            (token, padded_length), seconds = self._timed(lambda: self._first_token(live))
        except BaseException as exc:
            self.live.append(live)
            self._finish(live, "failed", f"prefill of {len(req.prompt_ids)} tokens: {one_line(exc)}")
            raise
        self._record("prefill", seconds, padded_length, 1, before)
        self.live.append(live)
        self._emit(live, token)

    def _first_token(self, live: _Live) -> tuple[int, int]:
        """Prefill (through the prefix cache), then the first token by the same sampler the decode
        graph runs (here eagerly, once). Returns (the token, the padded tokens prefilled)."""
        logits, padded_length = self.prefill_cached(live.slot, live.request.prompt_ids)
        if self.on_logits is not None:
            self.on_logits(logits)
        r = live.request
        ints, floats = _sampling_rows([r], [live.slot], [[]], [stream_key(r.seed, 0)], self.device)
        token = int(self.slot_states.sample(logits, ints, floats)[0])  # eagerly, the decode graph's sampler
        if r.logprobs is not None:
            live.completion.logprobs.extend(_logprobs(logits, [token], [r.logprobs]))
        return token, padded_length

    def _decode_step(self) -> None:
        rows = list(self.live)
        width = self.width_for(len(rows))
        before = compiled_graph_count()
        try:
            next_tokens, seconds = self._timed(lambda: self._sample_step(rows, width))
        except BaseException as exc:
            for row in rows:
                self._finish(row, "failed", f"decode step at width {width}: {one_line(exc)}")
            raise
        self._record("decode", seconds, width, len(rows), before)
        for row, token in zip(rows, next_tokens):
            self._emit(row, token)

    def _sample_step(self, rows: list[_Live], width: int) -> list[int]:
        """One decode step with sampling on the device; the produced tokens are read back once."""
        n, pad = len(rows), width - len(rows)
        reqs = [r.request for r in rows]
        ints, floats = _sampling_rows(
            reqs + [None] * pad,
            [r.slot for r in rows] + [self.pool.dummy] * pad,
            [r.completion.output_ids for r in rows] + [[self.pad_id]] * pad,
            # the draw's key: (request seed, index of the token drawn), whatever the batch
            [stream_key(r.request.seed, len(r.completion.output_ids)) for r in rows] + [0] * pad,
            self.device,
        )
        tokens, logits = self._run_step(ints, floats)
        if self.on_logits is not None:
            self.on_logits(logits[:n].clone())
        out = tokens[:n].tolist()  # the step's one read of device memory
        wanted = [i for i, q in enumerate(reqs) if q.logprobs is not None]
        if wanted:  # log-probs only for the rows that asked, read back with them
            picked = logits[torch.tensor(wanted, device=logits.device)]
            for i, lp in zip(wanted, _logprobs(picked, [out[i] for i in wanted], [reqs[i].logprobs for i in wanted])):
                rows[i].completion.logprobs.append(lp)
        return out

    def _finish(self, row: _Live, status: str = "done", reason: str = "") -> None:
        c = row.completion
        c.status, c.reason, c.finished_s = status, reason, self.now
        self.live.remove(row)
        self.release(row.slot)  # free at once: the next admission reuses it
        self.finished.append(c)

    def _emit(self, row: _Live, token: int) -> None:
        c = row.completion
        c.output_ids.append(token)
        c.token_times.append(self.now)
        if token in row.request.stop_ids or len(c.output_ids) >= row.request.max_new_tokens:
            self._finish(row)
        if self.on_token is not None:
            self.on_token(c, token)


def _logprobs(logits: Tensor, tokens: list[int], top_n: list[int]) -> list[TokenLogprobs]:
    """Each row's raw log-probs (serving/sampling.py logprobs_of): the chosen token's and the top N."""
    chosen, top, ids = logprobs_of(logits, torch.tensor(tokens, device=logits.device), max(top_n))
    chosen, top, ids = chosen.tolist(), top.tolist(), ids.tolist()
    return [(chosen[i], list(zip(ids[i][:n], top[i][:n]))) for i, n in enumerate(top_n)]


def _sampling_rows(reqs, slots, outputs, keys, device) -> tuple[Tensor, Tensor]:
    """The sampler's per-row inputs, ints [6, W] (last token, slot, key, top_k, min_tokens still to
    go, 0) and floats [5, W] (temperature, top_p, repetition, frequency, presence penalties); a None
    request is a pad row (greedy, neutral)."""
    ints, floats = [], []
    for req, slot, out, key in zip(reqs, slots, outputs, keys):
        last = out[-1] if out else 0
        if req is None:
            ints.append([last, slot, key, 0, 0, 0])
            floats.append([0.0, 1.0, 1.0, 0.0, 0.0])
            continue
        ints.append([last, slot, key, max(0, req.top_k), max(0, req.min_tokens - len(out)), 0])
        floats.append(
            [
                float(req.temperature),
                float(req.top_p),
                float(req.repetition_penalty),
                float(req.frequency_penalty),
                float(req.presence_penalty),
            ]
        )
    return (
        torch.tensor(ints, dtype=torch.long).T.contiguous().to(device),
        torch.tensor(floats, dtype=torch.float32).T.contiguous().to(device),
    )
