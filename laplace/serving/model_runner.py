"""The model runner: the compiled graphs over the slots' state, and running one batch through them.

As vLLM v1's model runner owns the model, its compiled or graph-captured forms and the
execution of a scheduled batch, this owns the two computations the engine runs, a decode step
and a prefill piece, at the static shapes (serving/shapes.py): one graph per decode width and
per prefill bucket, all compiled ahead by `warmup()`. It reads and writes the cache manager's
state rows in place (they are its module buffers) and knows nothing of requests.

Over slots: `prefill` (a prompt of any length, in bucket pieces), `prefill_cached` (through the
cache manager's prefix cache), `decode_rows` (one greedy step of given slots at a decode width)
and `prefill_logits` (a piece's logits at every position, for an echo's prompt log-probs). The
engine's step runs them for requests, a long prompt a chunk per step (`PrefillJob`); the probes,
the numerics check and the lm-eval harness run them by hand on slots leased from the cache manager.
"""

from __future__ import annotations

import dataclasses
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor, nn

from laplace.errors import ConfigError
from laplace.model.lm import LaplaceLM, State
from laplace.runtime import compile_cache_counts, compile_static, compiled_graph_count, synchronize
from laplace.serving import aot
from laplace.serving.cache_manager import CacheManager, state_tensors
from laplace.serving.sampling import apply_penalties, logprobs_of, sample_next
from laplace.serving.scheduler import TokenLogprobs
from laplace.serving.shapes import fit, prefill_pieces


@dataclass
class DecodeBatch:
    """The inputs of one decode step, packed so a step copies two small tensors, one row per column:
    ints [6, W] (tokens, slots, sampling keys, top_k, min_tokens still to go, 0) and floats [5, W]
    (temperature, top_p, repetition, frequency and presence penalties). Every batch has this shape,
    so warmup's greedy steps compile the very graphs that serve."""

    ints: Tensor
    floats: Tensor

    @property
    def width(self) -> int:
        return self.ints.shape[1]

    @classmethod
    def of_rows(
        cls,
        tokens: list[int],
        slots: list[int],
        keys: list[int],
        temperature: list[float],
        top_p: list[float],
        *,
        width: int,
        pad_id: int,
        dummy: int,
        device: torch.device,
        top_k: list[int] | None = None,
        min_to_go: list[int] | None = None,
        penalties: list[tuple[float, float, float]] | None = None,
    ) -> DecodeBatch:
        """Live rows padded to `width`: pad rows take the pad token, the dummy slot, greedy sampling.
        top_k, min_to_go (min_tokens still to generate), penalties (repetition, frequency, presence)
        per row; default neutral."""
        n, pad = len(tokens), width - len(tokens)
        top_k = top_k or [0] * n
        min_to_go = min_to_go or [0] * n
        rep, freq, pres = zip(*penalties) if penalties else ([1.0] * n, [0.0] * n, [0.0] * n)
        ints = torch.tensor(
            [
                tokens + [pad_id] * pad,
                slots + [dummy] * pad,
                keys + [0] * pad,
                list(top_k) + [0] * pad,
                list(min_to_go) + [0] * pad,
                [0] * width,
            ],
            dtype=torch.long,
        ).to(device)
        floats = torch.tensor(
            [
                temperature + [0.0] * pad,
                top_p + [1.0] * pad,
                list(rep) + [1.0] * pad,
                list(freq) + [0.0] * pad,
                list(pres) + [0.0] * pad,
            ]
        ).to(device)
        return cls(ints, floats)

    @classmethod
    def stack(cls, tokens: Tensor, slots: Tensor, keys: Tensor, temperature: Tensor, top_p: Tensor) -> DecodeBatch:
        """Rows given as device tensors, exactly these (no padding); vLLM's fields neutral."""
        zeros = torch.zeros_like(keys)
        ones = torch.ones_like(temperature)
        return cls(
            torch.stack([tokens, slots, keys, zeros, zeros, zeros]),
            torch.stack([temperature, top_p, ones, ones * 0, ones * 0]),
        )

    @classmethod
    def greedy(cls, tokens: Tensor, slots: Tensor) -> DecodeBatch:
        """Greedy rows (temperature 0, key 0) given as device tensors."""
        n, device = tokens.shape[0], tokens.device
        zeros = torch.zeros(n, dtype=torch.long, device=device)
        return cls.stack(tokens, slots, zeros, torch.zeros(n, device=device), torch.ones(n, device=device))


class StepGraphs(nn.Module):
    """The state rows as module buffers, and the two computations over them.

    As gpt-fast keeps its KV cache: buffers have static addresses, so a compiled step (and a
    CUDA graph of it) reads and writes them in place, rows picked by `slots`, instead of taking
    them as inputs. Every tensor of the State is a buffer by its field name, so a field added to
    State is carried without a change here. `decode_step` is one whole decode step: the model's
    recurrent form, then the sampler on the device; nothing in it reads a value back to the host."""

    def __init__(self, model: LaplaceLM, state: State):
        super().__init__()
        self.model = model
        tensors = state_tensors(state)
        self._state_fields = {f.name: f.name in tensors for f in dataclasses.fields(state)}  # name: has a tensor
        for name, tensor in tensors.items():
            self.register_buffer(name, tensor, persistent=False)
        # per slot, for vLLM's sampling fields: the prompt's tokens (repetition_penalty), how often
        # each token was generated (the penalties), the request's stop tokens (min_tokens)
        rows, V, device = state.recurrent.shape[1], model.cfg.vocab_size, state.recurrent.device
        self.register_buffer("seen", torch.zeros(rows, V, dtype=torch.bool, device=device), persistent=False)
        self.register_buffer("counts", torch.zeros(rows, V, dtype=torch.int32, device=device), persistent=False)
        self.register_buffer("stops", torch.zeros(rows, V, dtype=torch.bool, device=device), persistent=False)

    def state(self) -> State:
        """The buffers as a State (views of the same memory)."""
        return State(**{name: getattr(self, name) if present else None for name, present in self._state_fields.items()})

    def set_history(self, slot: int, prompt_ids, stop_ids) -> None:
        """A newly admitted request's sampling history: its prompt's tokens, its stop tokens, no
        tokens generated yet."""
        device = self.seen.device
        self.seen[slot] = False
        self.counts[slot] = 0
        self.stops[slot] = False
        self.seen[slot, torch.as_tensor(list(prompt_ids), device=device)] = True
        if stop_ids:
            self.stops[slot, torch.as_tensor(list(stop_ids), device=device)] = True

    def sample(self, logits: Tensor, ints: Tensor, floats: Tensor) -> Tensor:
        """The next token of each row from its raw logits (DecodeBatch's rows): min_tokens and the
        penalties over the slot's history, then temperature / top-k / top-p (serving/sampling.py,
        vLLM's order). The drawn token is counted in its slot's history."""
        W = ints.shape[1]
        if ints.shape[0] < 6:  # the plain form (tokens, slots, keys) / (temperature, top_p): the rest neutral
            ints = torch.cat([ints, ints.new_zeros(6 - ints.shape[0], W)])
        if floats.shape[0] < 5:
            neutral = torch.tensor([[1.0], [0.0], [0.0]], device=floats.device).expand(3, W)
            floats = torch.cat([floats, neutral[floats.shape[0] - 2 :]])
        _, slots, keys, top_k, min_to_go, _ = ints.unbind(0)
        temperature, top_p, repetition, frequency, presence = floats.unbind(0)
        adjusted = apply_penalties(logits, self.seen[slots], self.counts[slots], repetition, frequency, presence)
        adjusted = adjusted.masked_fill(self.stops[slots] & (min_to_go > 0).unsqueeze(-1), float("-inf"))
        tokens = sample_next(adjusted, temperature, top_p, keys, top_k)
        self.counts.index_put_((slots, tokens), torch.ones_like(tokens, dtype=torch.int32), accumulate=True)
        return tokens

    def decode_step(self, ints: Tensor, floats: Tensor) -> tuple[Tensor, Tensor]:
        """Returns (next tokens [W], raw logits [W, V])."""
        tokens, slots = ints[0], ints[1]
        logits = self.model.decode_step(tokens, self.state(), slots)
        return self.sample(logits, ints, floats), logits

    def prefill(self, tokens: Tensor, slots: Tensor, lengths: Tensor) -> Tensor:
        return self.model.prefill(tokens, self.state(), slots, lengths)


class ModelRunner:
    """The model's graphs at the decode widths and prefill buckets, over the cache manager's state."""

    def __init__(
        self,
        model: LaplaceLM,
        cache: CacheManager,
        *,
        widths: list[int],
        buckets: list[int],
        compile_scope: str | None,
        backend: str = "inductor",
        pad_id: int = 0,
    ):
        """widths: every decode width a step may run at (the ladder, or 1..max_slots for exact
        widths). compile_scope: None (eager), "model" (each decode width / prefill bucket is one
        graph) or "block" (one GLA block is compiled per shape and reused by every layer)."""
        self.model = model
        self.cache = cache
        self.device = cache.device
        self.widths = list(widths)
        self.buckets = sorted(set(buckets))
        self.pad_id = pad_id
        self.compiled = compile_scope is not None
        self.graphs = StepGraphs(model, cache.state)
        self.warmup_report: dict[str, float] = {}  # what the last warmup() compiled or loaded (see there)
        self._decode_graph, self._prefill_graph = self.graphs.decode_step, self.graphs.prefill
        # CUDA graphs for the whole decode step (gpt-fast's "reduce-overhead"): on a GPU an eager or
        # per-block step is bound by kernel launches. Prefill, longer and run once per request, is not graphed.
        self.cuda_graphs = compile_scope == "model" and self.device.type == "cuda" and backend == "inductor"
        # ahead-of-time packages (serving/aot.py): where warmup built them, each graph loads without tracing
        self.packages = aot.package_dir() if aot.applies(self.device, backend, compile_scope is not None) else None
        self._loaded: dict[tuple[str, int], Callable] = {}  # (kind, size): its loaded package
        self._looked_up: set[tuple[str, int]] = set()  # shapes whose package was looked for
        if compile_scope == "model":
            self._decode_graph = compile_static(
                self.graphs.decode_step, backend, mode="reduce-overhead" if self.cuda_graphs else None
            )
            self._prefill_graph = compile_static(self.graphs.prefill, backend)
        elif compile_scope == "block":
            for block in model.blocks:
                compile_static(block, backend)
        elif compile_scope is not None:
            raise ConfigError(f"engine.compile_scope: unknown scope {compile_scope!r} (block or model)")

    def graphs_needed(self) -> int:
        """Graphs one compiled function may hold: sets the recompile limit. One per decode width and
        prefill bucket; under compile_scope "block" every block shares one forward, compiled for each
        shape once per kind of block (GLA, Gated DeltaNet, and each distinct attention spec of a hybrid)."""
        cfg = self.model.cfg
        kinds = len({"gdn" if i in cfg.gdn_layers else repr(cfg.attention_spec(i)) for i in range(cfg.n_layers)})
        return (len(self.widths) + len(self.buckets)) * kinds

    # -- the two graphs (over the state buffers, mutated in place) -----------------------------

    def decode_step(self, batch: DecodeBatch) -> tuple[Tensor, Tensor]:
        """The decode graph on exactly these rows: next tokens [W] and logits [W, V], both still on
        the device. Under CUDA graphs both live in the graph's static memory until the next step:
        read or copy them before it."""
        if packaged := self._packaged("decode", batch.width):
            return packaged(batch.ints, batch.floats)
        if self.cuda_graphs:
            torch.compiler.cudagraph_mark_step_begin()  # a new step: the last step's outputs may be overwritten
        return self._decode_graph(batch.ints, batch.floats)

    def prefill_piece(self, tokens: Tensor, slots: Tensor, lengths: Tensor) -> Tensor:
        """The prefill graph on exactly these tokens [B, bucket] (no padding: `prefill` pads)."""
        if tokens.shape[0] == 1 and (packaged := self._packaged("prefill", tokens.shape[1])):
            return packaged(tokens, slots, lengths)
        return self._prefill_graph(tokens, slots, lengths)

    # -- slots' sequences (the engine's step; by hand: the probes, numerics, the lm-eval harness) ----

    @torch.inference_mode()
    def prefill(self, slot: int, prompt_ids) -> Tensor:
        """Run a prompt of any length into `slot`, continuing its state, through the bucket graphs
        only (see prefill_pieces; each piece continues the state and padding is an exact no-op, so
        the result equals one prefill of the whole prompt). Returns the last token's logits [1, V].
        Raises InputError where the slot's K/V cache has no room for it (CacheManager.check_room)."""
        ids = torch.as_tensor(np.asarray(prompt_ids, dtype=np.int64)).flatten()
        if ids.numel() == 0:
            raise ValueError("prompt is empty: at least one token is needed")
        self.cache.check_room(slot, ids.numel())
        logits, start = None, 0
        for n, bucket in prefill_pieces(ids.numel(), self.buckets):
            logits = self.prefill_tokens(slot, ids[start : start + n], bucket)
            start += n
        return logits

    def prefill_tokens(self, slot: int, ids: Tensor, bucket: int) -> Tensor:
        """One bucket graph on `ids` (at most `bucket` of them, right-padded) into `slot`."""
        tokens = torch.full((1, bucket), self.pad_id, dtype=torch.long)
        tokens[0, : ids.numel()] = ids
        lengths = torch.tensor([ids.numel()], device=self.device)
        return self.prefill_piece(tokens.to(self.device), torch.tensor([slot], device=self.device), lengths)

    def padded_tokens(self, n: int) -> int:
        """Tokens the bucket graphs compute for an n-token prefill (its pieces, padded)."""
        return sum(b for _, b in prefill_pieces(n, self.buckets))

    @torch.inference_mode()
    def prefill_cached(self, slot: int, prompt_ids) -> tuple[Tensor, int]:
        """`prefill` of a request's prompt into its freshly admitted (zeroed) slot through the prefix
        cache, at once (a PrefillJob run to its end). Returns (the last token's logits [1, V], the
        padded tokens computed)."""
        job = PrefillJob(self, slot, prompt_ids)
        job.advance(None)
        return job.logits, job.padded

    @torch.inference_mode()
    def decode_rows(self, slots: Sequence[int], tokens, width: int | None = None) -> Tensor:
        """One greedy decode step of the sequences in `slots`, each fed its token, at `width` rows
        (default: the smallest decode width that holds them). The pad rows take pad tokens and the
        dummy slot, so they never touch a live sequence. Returns the real rows' logits
        [len(slots), V] (a copy)."""
        n = len(slots)
        width = fit(n, self.widths) if width is None else width
        if width < n or width not in self.widths:
            raise ValueError(f"cannot decode {n} rows at width {width} (decode widths {self.widths})")
        tokens = torch.as_tensor(tokens, dtype=torch.long).flatten().to(self.device)
        pad = width - n
        if pad:
            tokens = torch.cat([tokens, torch.full((pad,), self.pad_id, dtype=torch.long, device=self.device)])
        rows = torch.tensor(list(slots) + [self.cache.dummy] * pad, device=self.device)
        return self.decode_step(DecodeBatch.greedy(tokens, rows))[1].clone()[:n]

    def prefill_logits(self, slot: int, ids: Tensor) -> Tensor:
        """Run `ids` [n] into `slot`, continuing its state (and K/V), by the model's chunked form,
        eagerly (`force_eager`: no graph is compiled for this, whatever the serving stance; the
        bucket graphs return only the last logits). Returns the logits at every position [n, V]:
        an echo's prompt log-probs, a chunk at a time (PrefillJob)."""
        with torch.compiler.set_stance("force_eager"), torch.inference_mode():
            tokens = ids.view(1, -1).to(self.device)
            slots = torch.tensor([slot], device=self.device)
            return self.model.prefill(tokens, self.graphs.state(), slots, all_logits=True)[0]

    def timed(self, fn):
        """(fn(), its seconds), the device synchronised before the clock stops."""
        start = time.perf_counter()
        result = fn()
        synchronize(self.device)
        return result, time.perf_counter() - start

    # -- warmup ---------------------------------------------------------------------------------

    @torch.inference_mode()
    def warmup(
        self,
        widths: list[int] | None = None,
        buckets: list[int] | None = None,
        log: Callable[[str], None] | None = None,
        build_packages: bool = False,
    ) -> dict[str, dict[int, float]]:
        """Run every decode width and prefill bucket (or the given ones) once on the dummy slot,
        compiling them when compiled. `log` gets a line as each graph starts and one with its
        seconds, so a cold compile of minutes is not silent, then a summary: how many graphs were
        loaded from the compile cache (a server started after `laplace warmup` must load all of
        them). Returns seconds per graph (a package's build or load included); `warmup_report`
        keeps the counts.

        Where packages apply (serving/aot.py: a compiled engine with Inductor on CPU), a graph is
        loaded from its ahead-of-time package when the compile cache holds one built for exactly
        this graph; `build_packages` (laplace warmup) builds the missing ones. Otherwise a graph is
        loaded (Inductor's FX graph cache hit, no miss), compiled (a miss: the cache did not have
        it, e.g. it was built under another thread count, which Inductor's cache key includes) or
        already compiled in this process."""
        counts = {"loaded_from_cache": 0, "compiled": 0, "already_compiled": 0, "eager": 0}
        started = time.perf_counter()
        out: dict[str, dict[int, float]] = {"decode": {}, "prefill": {}}
        shapes = [("decode", w) for w in (self.widths if widths is None else widths)]
        shapes += [("prefill", b) for b in (self.buckets if buckets is None else buckets)]
        for i, (kind, size) in enumerate(shapes, 1):
            what = f"{kind} {'width' if kind == 'decode' else 'bucket'} {size}"
            if log:
                log(f"warmup {i}/{len(shapes)}: {what} ...")
            before, cache_before = compiled_graph_count(), compile_cache_counts()
            args = self._example_inputs(kind, size)
            packaged, seconds = self.timed(lambda k=kind, n=size, a=args: self._package(k, n, a, build_packages))
            if kind == "decode":
                seconds += self.timed(lambda a=args: self.decode_step(DecodeBatch(*a))[1].clone())[1]
            else:
                seconds += self.timed(lambda a=args: self.prefill_piece(*a))[1]
            out[kind][size] = seconds
            hits, misses = (now - then for now, then in zip(compile_cache_counts(), cache_before))
            if packaged:
                how, count = packaged
            elif not self.compiled:
                how, count = "ran eagerly", "eager"
            elif compiled_graph_count() == before:
                how, count = "was already compiled", "already_compiled"
            elif misses or not hits:  # Neuron has no FX graph cache counters: counted as compiled
                how = "compiled" + (" (no ahead-of-time package was built for it)" if self.packages else "")
                count = "compiled"
            else:
                how, count = "loaded from the compile cache", "loaded_from_cache"
            counts[count] += 1
            if log:
                log(f"warmup {i}/{len(shapes)}: {what} {how} in {seconds:.2f}s")
        self.cache.state.zero_()
        self.warmup_report = {"graphs": len(shapes), **counts, "seconds": time.perf_counter() - started}
        if log and self.compiled:
            r = self.warmup_report
            log(
                f"warmup: {r['graphs']} graphs in {r['seconds']:.1f}s, loaded from cache "
                f"{r['loaded_from_cache']}/{r['graphs']}, compiled {r['compiled']}, "
                f"already compiled {r['already_compiled']}"
            )
        return out

    def _example_inputs(self, kind: str, size: int) -> tuple[Tensor, ...]:
        """The inputs warmup runs a graph on (the dummy slot, pad tokens): shaped as serving's."""
        dummy, device = self.cache.dummy, self.device
        if kind == "decode":
            tokens = torch.full((size,), self.pad_id, dtype=torch.long, device=device)
            batch = DecodeBatch.greedy(tokens, torch.full((size,), dummy, dtype=torch.long, device=device))
            return batch.ints, batch.floats
        tokens = torch.full((1, size), self.pad_id, dtype=torch.long, device=device)
        return tokens, torch.tensor([dummy], device=device), torch.tensor([size], device=device)

    def _packaged(self, kind: str, size: int) -> Callable | None:
        """This shape's loaded package, looked for at its first use where warmup did not run (the
        numerics worker's engine, say); None where there is none."""
        if self.packages is not None and (kind, size) not in self._looked_up:
            self._package(kind, size, self._example_inputs(kind, size), build=False)
        return self._loaded.get((kind, size))

    def _package(self, kind: str, size: int, args: tuple[Tensor, ...], build: bool) -> tuple[str, str] | None:
        """Load this graph's ahead-of-time package (building it first when `build`): (how, its
        warmup_report count), or None where packages do not apply or none was built for exactly
        this graph (it is compiled just in time then)."""
        if self.packages is None or (kind, size) in self._loaded:
            return None
        self._looked_up.add((kind, size))
        path = aot.package_path(self.packages, kind, size, aot.fingerprint(self.graphs, kind, size, args))
        outcome = ("loaded its ahead-of-time package", "loaded_from_cache")
        if not path.is_file():
            if not build:
                return None
            aot.build(self.graphs, "decode_step" if kind == "decode" else "prefill", args, path)
            outcome = ("compiled ahead of time", "compiled")
        self._loaded[(kind, size)] = aot.load(self.graphs, path)
        return outcome


class PrefillJob:
    """A request's prompt prefilled into its freshly admitted (zeroed) slot through the prefix cache,
    a chunk at a time, so the engine can run decode steps of the other requests between chunks
    (vLLM's chunked prefill). Each chunk is whole bucket pieces (serving/shapes.py prefill_pieces)
    through the graphs already compiled; the state (and, for attention layers, the K/V cache and its
    positions) stays in the slot from one chunk to the next, so the chunks equal one prefill.

    At creation the state of the longest cached prefix is copied into the slot; only the rest is
    prefilled, and the state at the split point the cache asks for and after the whole prompt is
    stored (serving/prefix_cache.py says which).

    With `echo` (top N: a request with echo and logprobs), the prompt's log-probs are computed as
    it goes, into `prompt_logprobs` ([None, TokenLogprobs...]: each token's given all before it):
    the same pieces, unpadded, run eagerly for every position's logits (`prefill_logits`), a
    piece's first token predicted by the previous piece's last logits. Every position is needed,
    so no cached prefix is used; the whole prompt is stored after it as for any prompt."""

    def __init__(self, runner: ModelRunner, slot: int, prompt_ids, echo: int | None = None):
        self.runner, self.slot, self.echo = runner, slot, echo
        self.ids = torch.as_tensor(np.asarray(prompt_ids, dtype=np.int64)).flatten()
        if self.ids.numel() == 0:
            raise ValueError("prompt is empty: at least one token is needed")
        self.logits: Tensor | None = None
        self.prompt_logprobs: list[TokenLogprobs | None] | None = None if echo is None else [None]
        self.padded = 0  # padded tokens computed so far
        # (first token, real tokens, bucket, store the state in the prefix cache after it)
        self.pieces: deque[tuple[int, int, int, bool]] = deque()
        prefix_cache = runner.cache.prefix_cache
        ends, start = [self.ids.numel()], 0
        if prefix_cache.enabled and echo is None:
            plan = prefix_cache.plan(self.ids.numpy(), runner.padded_tokens)
            if plan.state is not None:
                runner.cache.write_slot(slot, plan.state)
            if plan.logits is not None:  # an exact repeat: the state and the last logits are cached
                self.logits = plan.logits.clone()
                return
            start = plan.start
            ends = [plan.split, self.ids.numel()] if plan.split is not None else ends
        runner.cache.check_room(slot, self.ids.numel() - start)
        for end in ends:
            pieces = prefill_pieces(end - start, runner.buckets)
            for i, (n, bucket) in enumerate(pieces):
                self.pieces.append((start, n, bucket, prefix_cache.enabled and i == len(pieces) - 1))
                start += n

    @property
    def done(self) -> bool:
        return not self.pieces

    @torch.inference_mode()
    def advance(self, budget: int | None) -> int:
        """Prefill pieces until at least `budget` prompt tokens ran this call (None: to the end).
        Returns the prompt tokens that ran (`padded` counts the padded tokens computed)."""
        ran = 0
        while self.pieces and (budget is None or ran < budget):
            start, n, bucket, store = self.pieces.popleft()
            piece = self.ids[start : start + n]
            if self.echo is None:
                self.logits = self.runner.prefill_tokens(self.slot, piece, bucket)
            else:
                self.logits, bucket = self._echo_piece(piece), n  # eager: no padding
            if store:
                cache = self.runner.cache
                cache.prefix_cache.put(self.ids[: start + n].numpy(), cache.read_slot(self.slot), self.logits.clone())
            ran, self.padded = ran + n, self.padded + bucket
        return ran

    def _echo_piece(self, piece: Tensor) -> Tensor:
        """Prefill one piece for its every position's logits, its tokens' log-probs appended to
        `prompt_logprobs`; returns its last logits [1, V]."""
        logits = self.runner.prefill_logits(self.slot, piece)
        if self.logits is not None:  # the previous piece's last position predicts this piece's first token
            predicting, targets = torch.cat([self.logits, logits[:-1]]), piece
        else:  # the prompt's first token: nothing predicts it
            predicting, targets = logits[:-1], piece[1:]
        if targets.numel():
            self.prompt_logprobs += token_logprobs(predicting, targets.tolist(), [self.echo] * targets.numel())
        return logits[-1:]


def token_logprobs(logits: Tensor, tokens: list[int], top_n: list[int]) -> list[TokenLogprobs]:
    """Each row's raw log-probs (serving/sampling.py logprobs_of): the chosen token's and the top N,
    read back to the host."""
    chosen, top, ids = logprobs_of(logits, torch.tensor(tokens, device=logits.device), max(top_n))
    chosen, top, ids = chosen.tolist(), top.tolist(), ids.tolist()
    return [(chosen[i], list(zip(ids[i][:n], top[i][:n]))) for i, n in enumerate(top_n)]
