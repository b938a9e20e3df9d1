"""The decode engine: continuous batching over a fixed pool of state slots, built from the
`engine:` params. It holds three parts, as vLLM v1's EngineCore holds its scheduler, model
executor and KV cache manager, and callers reach each part where it lives:

- `engine.scheduler` (serving/scheduler.py) decides what runs: admission into free slots, the
  rows of each decode step and its width, the requests' lifecycle on a virtual clock. Requests
  are submitted, cancelled and drained there (`submit`, `cancel`, `take_finished`, `take_steps`);
- `engine.runner` (serving/model_runner.py) owns the compiled graphs at the decode widths and
  prefill buckets, their warmup, and runs sequences through them (`prefill`, `decode_rows`);
- `engine.cache` (serving/cache_manager.py) owns the slots, the per-sequence state in them and
  the state prefix cache, within one byte budget (`leased` lends slots by hand).

What only the engine does is the step that ties them together (vLLM's schedule, execute,
update): while a slot is free, admit the next waiting request and prefill it (through the prefix
cache; its first token is sampled there), then one decode step of every running request at the
smallest ladder width that holds them (`padded` policy; `exact` decodes at the live count,
compiling every new width on first sight, the stall the article measured; `eager` runs no
compiler). A step's outputs (tokens, finished requests, a StepRecord) are handed to the
scheduler. A prompt longer than the largest prefill bucket is prefilled a chunk (one largest
bucket of tokens) per step, between the decode steps of the others, as vLLM's chunked prefill
does: a long prompt does not stall the streams already running, and no new shape is compiled. A
request with `prompt_logprobs` (echo with logprobs) is chunked the same way, its prompt's
log-probs computed chunk by chunk (PrefillJob) and put on its Completion before its first token.
`complete` serves a batch to the end; `reset` forgets a workload.

`DecodeEngine(model, params, policy)` is the one way to build an engine (from an export:
`DecodeEngine.from_export`).
"""

from __future__ import annotations

import dataclasses
from collections import deque
from pathlib import Path

import torch

from laplace.config import EngineSection, width_ladder  # the widths' one rule lives with the knob
from laplace.errors import ConfigError, one_line
from laplace.model.kernels import resolve_kernel
from laplace.model.lm import LaplaceLM
from laplace.runtime import compile_backend, compiled_graph_count, configure_compiler
from laplace.serving.cache_manager import CacheManager
from laplace.serving.model_runner import DecodeBatch, ModelRunner, PrefillJob, token_logprobs
from laplace.serving.sampling import stream_key
from laplace.serving.scheduler import Completion, DecodePlan, Request, Running, Scheduler

__all__ = ["ONE_SLOT", "POLICIES", "SHAPE_KEYS", "DecodeEngine"]

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
        self.on_logits = None  # optional callback(logits of a step's real rows), for inspection
        ladder = width_ladder(params.max_slots, params.widths)
        exact_widths = policy != "padded"
        self.cache = CacheManager(
            model, params.max_slots, params.prefix_cache_bytes, params.prefix_cache_min_tokens, params.max_context
        )
        self.scheduler = Scheduler(
            ladder=ladder,
            exact_widths=exact_widths,
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
            widths=list(range(1, params.max_slots + 1)) if exact_widths else ladder,
            buckets=params.prefill_buckets,
            compile_scope=compile_scope,
            backend=backend or compile_backend(self.device),
            pad_id=pad_id,
        )
        if self.runner.compiled:
            configure_compiler(self.runner.graphs_needed())

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

    def reset(self) -> None:
        """Forget requests, timings and cached prefixes (compiled graphs stay), for the next workload."""
        self.cache.reset()
        self.scheduler.reset()
        self.prefilling: list[tuple[Running, PrefillJob]] = []  # admitted, prompt not yet all prefilled

    def complete(self, requests: list[Request]) -> list[Completion]:
        """Serve a batch to the end, all arriving now (as many wait as the queue takes), decoding
        the live ones together at the ladder widths. Completions in the order of `requests`."""
        s = self.scheduler
        pending = deque(requests)
        while pending or s.has_work():
            while pending and s.counts()[0] < s.max_queue:
                s.submit(pending.popleft())
            if s.has_work():
                self.step()
        mine = {c.request_id: c for c in s.take_finished({r.id for r in requests})}
        return [mine[r.id] for r in requests]

    # -- one scheduler iteration -----------------------------------------------------------------

    @torch.inference_mode()
    def step(self) -> None:
        """Prefill the next chunk of the prompts still being prefilled, admit queued requests into
        free slots (prefilling each: a prompt within one chunk whole), then one decode step of the
        requests past their prefill. A request whose prefill or decode step raises is finished as
        "failed" (its slot freed) and the error propagates: a replay stops, a server answers those
        requests with an error."""
        # a request cancelled mid-prefill has left its slot (maybe to another request already)
        self.prefilling = [(row, job) for row, job in self.prefilling if row.completion.finished_s is None]
        # the prompts admitted earlier share one chunk of tokens per step, first come first served (vLLM's
        # token budget): the running requests' decode gap stays about one chunk however many prompts wait
        budget = self.runner.buckets[-1]
        for row, job in list(self.prefilling):
            if budget <= 0:
                break
            budget -= self._prefill_chunk(row, job, budget)
        while (req := self.scheduler.next_admission(self.cache.free_slots)) is not None:
            self._prefill_request(req)
        if (plan := self.scheduler.decode_plan()) is not None:
            self._run_decode_step(plan)

    def _compiled_since(self, graphs_before: int) -> bool:
        return self.runner.compiled and compiled_graph_count() > graphs_before

    def _prefill_request(self, req: Request) -> None:
        row = self.scheduler.start(req, self.cache.admit(req.id))
        self.runner.graphs.set_history(row.slot, req.prompt_ids, req.stop_ids)
        try:
            # the prefix cache's lookup (none for an echo: its every position's logits are computed)
            job = PrefillJob(self.runner, row.slot, req.prompt_ids, echo=req.prompt_logprobs)
        except BaseException as exc:
            self.scheduler.finish(row, "failed", f"prefill of {len(req.prompt_ids)} tokens: {one_line(exc)}")
            raise
        self.prefilling.append((row, job))
        self._prefill_chunk(row, job, self.runner.buckets[-1])

    def _prefill_chunk(self, row: Running, job: PrefillJob, budget: int) -> int:
        """The prompt's next `budget` tokens or more (whole bucket pieces); after the last, the first
        token. The row sits out decode steps until then. Returns the prompt tokens prefilled."""
        before, padded_before = compiled_graph_count(), job.padded
        try:
            ran, seconds = self.runner.timed(lambda: job.advance(budget))
            token = self._first_token(row, job.logits) if job.done else None
        except BaseException as exc:
            self.prefilling.remove((row, job))
            self.scheduler.finish(row, "failed", f"prefill of {len(row.request.prompt_ids)} tokens: {one_line(exc)}")
            raise
        row.prefilling = not job.done
        self.scheduler.record("prefill", seconds, job.padded - padded_before, 1, self._compiled_since(before))
        if token is not None:
            self.prefilling.remove((row, job))
            row.completion.prompt_logprobs = job.prompt_logprobs  # an echo's, set before its first token
            self.scheduler.emit(row, token)
        return ran

    def _first_token(self, row: Running, logits: torch.Tensor) -> int:
        """The first token from the prompt's last logits, by the same sampler the decode graph runs
        (here eagerly, once)."""
        if self.on_logits is not None:
            self.on_logits(logits)
        r = row.request
        batch = self._batch([row], [[]], [stream_key(r.seed, 0)], width=1)
        token = int(self.runner.graphs.sample(logits, batch.ints, batch.floats)[0])  # the decode graph's sampler
        if r.logprobs is not None:
            row.completion.logprobs.extend(token_logprobs(logits, [token], [r.logprobs]))
        return token

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
            for i, lp in zip(wanted, token_logprobs(picked, [out[i] for i in wanted], top_n)):
                rows[i].completion.logprobs.append(lp)
        return out

    def _batch(self, rows: list[Running], outputs: list[list[int]], keys: list[int], width: int) -> DecodeBatch:
        """The decode step's inputs for these rows, vLLM's sampling fields included."""
        reqs = [r.request for r in rows]
        return DecodeBatch.of_rows(
            [out[-1] if out else self.runner.pad_id for out in outputs],
            [r.slot for r in rows],
            keys,
            [float(q.temperature) for q in reqs],
            [float(q.top_p) for q in reqs],
            width=width,
            pad_id=self.runner.pad_id,
            dummy=self.cache.dummy,
            device=self.device,
            top_k=[max(0, q.top_k) for q in reqs],
            min_to_go=[max(0, q.min_tokens - len(out)) for q, out in zip(reqs, outputs)],
            penalties=[
                (float(q.repetition_penalty), float(q.frequency_penalty), float(q.presence_penalty)) for q in reqs
            ],
        )
