"""The decode engine: continuous batching over a fixed pool of state slots, built from the
`engine:` params. A thin facade that wires three parts, as vLLM v1 splits its engine core:

- the Scheduler (serving/scheduler.py) decides what runs: admission into free slots, the rows of
  each decode step and its width, the requests' lifecycle on a virtual clock;
- the ModelRunner (serving/model_runner.py) owns the compiled graphs at the decode widths and
  prefill buckets and runs a batch through them;
- the CacheManager (serving/cache_manager.py) owns the slots, the per-sequence state in them and
  the state prefix cache, within one byte budget.

One scheduler iteration (`step`): while a slot is free, admit the next waiting request and
prefill it (through the prefix cache; its first token is sampled there), then one decode step of
every running request at the smallest ladder width that holds them (`padded` policy; `exact`
decodes at the live count, compiling every new width on first sight, the stall the article
measured; `eager` runs no compiler). A step's outputs (tokens, finished requests, a StepRecord)
are handed to the scheduler, which the server drains each step (`take_finished`, `take_steps`).

`DecodeEngine(model, params, policy)` is the one way to build an engine (from an export:
`DecodeEngine.from_export`). The probes, numerics checks and the lm-eval harness drive slots by
hand through `leased`, `prefill` and `decode_step`.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from laplace.config import EngineSection, width_ladder  # the widths' one rule lives with the knob
from laplace.errors import ConfigError, one_line
from laplace.model.kernels import resolve_kernel
from laplace.model.lm import LaplaceLM, State
from laplace.runtime import compile_backend, compiled_graph_count, configure_compiler
from laplace.serving.cache_manager import CacheManager, SlotPool
from laplace.serving.model_runner import DecodeBatch, ModelRunner
from laplace.serving.sampling import logprobs_of, stream_key
from laplace.serving.scheduler import (
    Completion,
    DecodePlan,
    Rejected,
    Request,
    Running,
    Scheduler,
    StepRecord,
    TokenLogprobs,
)
from laplace.serving.shapes import fit, prefill_pieces

__all__ = [
    "ONE_SLOT",
    "POLICIES",
    "SHAPE_KEYS",
    "Completion",
    "DecodeEngine",
    "Rejected",
    "Request",
    "SlotPool",
    "StepRecord",
    "fit",
    "prefill_pieces",
    "width_ladder",
]

POLICIES = ("padded", "exact", "eager")
# The `engine:` params that decide an engine's shapes (the MLflow model is logged with them).
SHAPE_KEYS = ("max_slots", "widths", "prefill_buckets", "max_prompt_tokens", "max_queue")
# One eager slot for one-off generation: prompts of any length (prefilled in pieces of the
# default buckets), decoded at width 1, no prefix cache.
ONE_SLOT = dataclasses.replace(EngineSection(), max_slots=1, widths=[], max_prompt_tokens=2**62, prefix_cache_bytes=0)


class DecodeEngine:
    def __init__(
        self,
        model: LaplaceLM,
        params: EngineSection,
        policy: str = "padded",
        *,
        backend: str | None = None,
        compiled: bool = True,
        pad_id: int = 0,
    ):
        """The engine of a serving policy from the `engine:` params: `padded` (ladder widths,
        compiled with params.compile_scope), `exact` (live-count widths, compiled) or `eager`
        (live-count widths, no compiler). compiled=False keeps the policy's widths but runs
        eagerly. backend: the compiler's (default: the model device's, runtime.compile_backend).
        A compiled engine raises the compiler's recompile limit to its graph count."""
        if policy not in POLICIES:
            raise ConfigError(f"unknown serving policy {policy!r} (choose from {', '.join(POLICIES)})")
        if params.prefix_cache_bytes < 0:
            raise ConfigError(
                f"engine.prefix_cache_bytes: must be >= 0 (0 turns the cache off), got {params.prefix_cache_bytes}"
            )
        if not params.prefill_buckets or min(params.prefill_buckets) < 1:
            raise ConfigError(f"engine.prefill_buckets: need at least one length >= 1, got {params.prefill_buckets}")
        self.model = model.eval()
        first = next(model.parameters())
        self.device = first.device
        resolve_kernel(model.cfg.kernel, self.device, first.dtype)  # model.kernel: fla where it cannot run fails now
        self.params, self.policy = params, policy
        self.max_slots = params.max_slots
        self.ladder = width_ladder(params.max_slots, params.widths)
        self.exact_widths = policy != "padded"
        self.pad_id = pad_id
        self.on_logits = None  # optional callback(logits of a step's real rows), for inspection
        self.cache = CacheManager(
            model, self.max_slots, params.prefix_cache_bytes, params.prefix_cache_min_tokens, params.max_context
        )
        self.scheduler = Scheduler(
            ladder=self.ladder,
            exact_widths=self.exact_widths,
            max_queue=params.max_queue,
            max_prompt_tokens=params.max_prompt_tokens,
            vocab_size=model.cfg.vocab_size,
            release=self.cache.release,
            max_context=self.cache.max_context,
        )
        self.reset()
        compile_scope = params.compile_scope if compiled and policy != "eager" else None
        self.runner = ModelRunner(
            model,
            self.cache,
            widths=list(range(1, self.max_slots + 1)) if self.exact_widths else self.ladder,
            buckets=params.prefill_buckets,
            compile_scope=compile_scope,
            backend=backend or compile_backend(self.device),
            pad_id=pad_id,
        )
        self.compiled = self.runner.compiled
        if self.compiled:
            configure_compiler(self.graphs_needed())

    @classmethod
    def from_export(
        cls,
        export_dir: Path | str,
        params: EngineSection,
        policy: str = "padded",
        *,
        device: torch.device | None = None,
        dtype: torch.dtype | None = None,
        kernel: str | None = None,
        compiled: bool = True,
        backend: str | None = None,
    ):
        """The engine of an export directory (laplace.model.export.load_export): returns
        (engine, tokenizer, export config); the model is `engine.model`."""
        from laplace.model.export import load_export

        kwargs = {k: v for k, v in (("device", device), ("dtype", dtype), ("kernel", kernel)) if v is not None}
        model, tokenizer, config = load_export(Path(export_dir), **kwargs)
        return cls(model, params, policy, backend=backend, compiled=compiled), tokenizer, config

    # -- the parts' state, as the callers see it -------------------------------------------------

    @property
    def buckets(self) -> list[int]:
        return self.runner.buckets

    @property
    def max_queue(self) -> int:
        return self.scheduler.max_queue

    @property
    def max_prompt_tokens(self) -> int:
        return self.scheduler.max_prompt_tokens

    @property
    def cuda_graphs(self) -> bool:
        return self.runner.cuda_graphs

    @property
    def state(self) -> State:
        """Every slot's state rows (the dummy last): the runner's buffers, the same memory."""
        return self.cache.state

    @property
    def pool(self) -> SlotPool:
        return self.cache.pool

    @property
    def prefix_cache(self):
        return self.cache.prefix_cache

    @property
    def queue(self) -> deque[Request]:
        return self.scheduler.queue

    @property
    def live(self) -> list[Running]:
        return self.scheduler.live

    @property
    def finished(self) -> list[Completion]:
        return self.scheduler.finished

    @property
    def steps(self) -> list[StepRecord]:
        return self.scheduler.steps

    @property
    def now(self) -> float:
        return self.scheduler.now

    @now.setter
    def now(self, value: float) -> None:
        self.scheduler.now = value

    @property
    def on_token(self) -> Callable[[Completion, int], None] | None:
        return self.scheduler.on_token

    @on_token.setter
    def on_token(self, fn: Callable[[Completion, int], None] | None) -> None:
        self.scheduler.on_token = fn

    @property
    def warmup_report(self) -> dict[str, float]:
        return self.runner.warmup_report

    def graphs_needed(self) -> int:
        """Distinct shapes one compiled function may see: sets the recompile limit."""
        return self.runner.graphs_needed()

    def reset(self) -> None:
        """Forget requests, timings and cached prefixes (compiled graphs stay), for the next workload."""
        self.cache.reset()
        self.scheduler.reset()

    def warmup(
        self,
        widths: list[int] | None = None,
        buckets: list[int] | None = None,
        log: Callable[[str], None] | None = None,
        build_packages: bool = False,
    ) -> dict[str, dict[int, float]]:
        """Every decode width and prefill bucket (or the given ones) run once: see ModelRunner.warmup."""
        return self.runner.warmup(widths, buckets, log, build_packages)

    # -- slots by hand (probes, numerics, the lm-eval harness) -------------------------------------

    def admit(self, owner: int) -> int:
        """A free slot for `owner`, zeroed."""
        return self.cache.admit(owner)

    def release(self, slot: int) -> None:
        self.cache.release(slot)

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
        return self.scheduler.width_for(rows)

    def prefill(self, slot: int, prompt_ids) -> Tensor:
        """Run a prompt of any length into `slot`, continuing its state: its last logits [1, V]."""
        self.cache.check_room(slot, len(prompt_ids))
        return self.runner.prefill(slot, prompt_ids)

    @property
    def max_context(self) -> int | None:
        """The tokens a sequence may reach (engine.max_context) on a model with attention layers;
        None for a GLA model, whose state does not grow."""
        return self.cache.max_context

    def padded_tokens(self, n: int) -> int:
        return self.runner.padded_tokens(n)

    @torch.inference_mode()
    def decode_step(self, slots: Sequence[int], tokens, width: int | None = None) -> Tensor:
        """One greedy decode step of the sequences in `slots`, each fed its token, at `width` rows
        (default: width_for(len(slots))). The pad rows take pad tokens and the dummy slot, so they
        never touch a live sequence. Returns the real rows' logits [len(slots), V] (a copy)."""
        n = len(slots)
        width = self.width_for(n) if width is None else width
        if width < n or not (self.exact_widths or width in self.ladder):
            raise ValueError(f"cannot decode {n} rows at width {width} (ladder {self.ladder})")
        tokens = torch.as_tensor(tokens, dtype=torch.long).flatten().to(self.device)
        pad = width - n
        if pad:
            tokens = torch.cat([tokens, torch.full((pad,), self.pad_id, dtype=torch.long, device=self.device)])
        rows = torch.tensor(list(slots) + [self.cache.dummy] * pad, device=self.device)
        return self.runner.decode_step(DecodeBatch.greedy(tokens, rows))[1].clone()[:n]

    @torch.inference_mode()
    def prefill_cached(self, slot: int, prompt_ids) -> tuple[Tensor, int]:
        """`prefill` of a request's prompt into its freshly admitted (zeroed) slot through the prefix
        cache: the state of the longest cached prefix is copied into the slot and only the rest is
        prefilled; the state at the split point the cache asks for and after the whole prompt is
        stored (serving/prefix_cache.py says which). Returns (the last token's logits [1, V], the
        padded tokens computed)."""
        ids = np.asarray(prompt_ids, dtype=np.int64).ravel()
        prefix_cache = self.cache.prefix_cache
        if not prefix_cache.enabled:
            return self.prefill(slot, ids), self.padded_tokens(len(ids))
        plan = prefix_cache.plan(ids, self.padded_tokens)
        if plan.state is not None:
            self.cache.write_slot(slot, plan.state)
        if plan.logits is not None:  # an exact repeat: the state and the last logits are cached
            return plan.logits.clone(), 0
        start, computed = plan.start, 0
        if plan.split is not None:
            logits = self.prefill(slot, ids[start : plan.split])
            computed += self.padded_tokens(plan.split - start)
            prefix_cache.put(ids[: plan.split], self.cache.read_slot(slot), logits.clone())
            start = plan.split
        logits = self.prefill(slot, ids[start:])
        prefix_cache.put(ids, self.cache.read_slot(slot), logits.clone())
        return logits, computed + self.padded_tokens(len(ids) - start)

    def prefix_cache_stats(self) -> dict[str, int]:
        """The state prefix cache's counters (CacheManager.stats)."""
        return self.cache.stats()

    # -- requests -------------------------------------------------------------------------------

    def check(self, req: Request) -> None:
        """Raise Rejected (one line naming the problem) for a request the engine cannot serve."""
        self.scheduler.check(req)

    def submit(self, req: Request) -> Completion | None:
        """Queue a request; a bad one, or one arriving at a full queue, is rejected at once."""
        return self.scheduler.submit(req)

    def cancel(self, request_id: int, reason: str = "cancelled") -> Completion | None:
        """Drop a waiting or live request (its slot is free for the next admission)."""
        return self.scheduler.cancel(request_id, reason)

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def take_finished(self) -> list[Completion]:
        return self.scheduler.take_finished()

    def take_steps(self) -> list[StepRecord]:
        return self.scheduler.take_steps()

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
        s = self.scheduler
        mine = {c.request_id: c for c in s.finished if c.request_id in ids}
        s.finished = [c for c in s.finished if c.request_id not in ids]
        return [mine[r.id] for r in requests]

    # -- one scheduler iteration -----------------------------------------------------------------

    @torch.inference_mode()
    def step(self) -> None:
        """Admit queued requests into free slots (prefilling each), then one decode step.
        A request whose prefill or decode step raises is finished as "failed" (its slot freed)
        and the error propagates: a replay stops, a server answers those requests with an error."""
        while (req := self.scheduler.next_admission(self.cache.free_slots)) is not None:
            self._prefill_request(req)
        if (plan := self.scheduler.decode_plan()) is not None:
            self._run_decode_step(plan)

    def _compiled_since(self, graphs_before: int) -> bool:
        return self.compiled and compiled_graph_count() > graphs_before

    def _prefill_request(self, req: Request) -> None:
        row = self.scheduler.start(req, self.cache.admit(req.id))
        self.runner.graphs.set_history(row.slot, req.prompt_ids, req.stop_ids)
        before = compiled_graph_count()
        try:
            (token, padded_length), seconds = self.runner.timed(lambda: self._first_token(row))
        except BaseException as exc:
            self.scheduler.finish(row, "failed", f"prefill of {len(req.prompt_ids)} tokens: {one_line(exc)}")
            raise
        self.scheduler.record("prefill", seconds, padded_length, 1, self._compiled_since(before))
        self.scheduler.emit(row, token)

    def _first_token(self, row: Running) -> tuple[int, int]:
        """Prefill (through the prefix cache), then the first token by the same sampler the decode
        graph runs (here eagerly, once). Returns (the token, the padded tokens prefilled)."""
        logits, padded_length = self.prefill_cached(row.slot, row.request.prompt_ids)
        if self.on_logits is not None:
            self.on_logits(logits)
        r = row.request
        batch = self._batch([row], [[]], [stream_key(r.seed, 0)], width=1)
        token = int(self.runner.graphs.sample(logits, batch.ints, batch.floats)[0])  # the decode graph's sampler
        if r.logprobs is not None:
            row.completion.logprobs.extend(_logprobs(logits, [token], [r.logprobs]))
        return token, padded_length

    def _run_decode_step(self, plan: DecodePlan) -> None:
        rows, width = plan.rows, plan.width
        before = compiled_graph_count()
        try:
            next_tokens, seconds = self.runner.timed(lambda: self._decode_step_tokens(plan))
        except BaseException as exc:
            for row in rows:
                self.scheduler.finish(row, "failed", f"decode step at width {width}: {one_line(exc)}")
            raise
        self.scheduler.record("decode", seconds, width, len(rows), self._compiled_since(before))
        for row, token in zip(rows, next_tokens):
            self.scheduler.emit(row, token)

    def _decode_step_tokens(self, plan: DecodePlan) -> list[int]:
        """The plan's decode step with sampling on the device; the produced tokens are read back once."""
        rows, n = plan.rows, len(plan.rows)
        batch = self._batch(
            rows,
            [r.completion.output_ids for r in rows],
            # the draw's key: (request seed, index of the token drawn), whatever the batch
            [stream_key(r.request.seed, len(r.completion.output_ids)) for r in rows],
            width=plan.width,
        )
        tokens, logits = self.runner.decode_step(batch)
        if self.on_logits is not None:
            self.on_logits(logits[:n].clone())
        out = tokens[:n].tolist()  # the step's one read of device memory
        wanted = [i for i, r in enumerate(rows) if r.request.logprobs is not None]
        if wanted:  # log-probs only for the rows that asked, read back with them
            picked = logits[torch.tensor(wanted, device=logits.device)]
            top_n = [rows[i].request.logprobs for i in wanted]
            for i, lp in zip(wanted, _logprobs(picked, [out[i] for i in wanted], top_n)):
                rows[i].completion.logprobs.append(lp)
        return out

    def _batch(self, rows: list[Running], outputs: list[list[int]], keys: list[int], width: int) -> DecodeBatch:
        """The decode step's inputs for these rows, vLLM's sampling fields included."""
        reqs = [r.request for r in rows]
        return DecodeBatch.of_rows(
            [out[-1] if out else self.pad_id for out in outputs],
            [r.slot for r in rows],
            keys,
            [float(q.temperature) for q in reqs],
            [float(q.top_p) for q in reqs],
            width=width,
            pad_id=self.pad_id,
            dummy=self.cache.dummy,
            device=self.device,
            top_k=[max(0, q.top_k) for q in reqs],
            min_to_go=[max(0, q.min_tokens - len(out)) for q, out in zip(reqs, outputs)],
            penalties=[
                (float(q.repetition_penalty), float(q.frequency_penalty), float(q.presence_penalty)) for q in reqs
            ],
        )


def _logprobs(logits: Tensor, tokens: list[int], top_n: list[int]) -> list[TokenLogprobs]:
    """Each row's raw log-probs (serving/sampling.py logprobs_of): the chosen token's and the top N."""
    chosen, top, ids = logprobs_of(logits, torch.tensor(tokens, device=logits.device), max(top_n))
    chosen, top, ids = chosen.tolist(), top.tolist(), ids.tolist()
    return [(chosen[i], list(zip(ids[i][:n], top[i][:n]))) for i, n in enumerate(top_n)]
