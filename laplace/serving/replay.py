"""Replaying seeded workloads through the decode engine on a virtual clock, and their figures.

`replay` serves requests at their arrival times on the engine's clock (advanced by the
measured duration of each step), so latencies are those a live server would see without
sleeping through the gaps. `replay_policy` runs every workload under one policy:

- exact:  decode at exactly the live count, compiling each new width on first sight;
- padded: decode at the smallest ladder width that holds the live rows, under
          torch.compiler.set_stance("fail_on_recompile") after warmup;
- eager:  no compiler at all.

The padded policy also measures decode cost against context: the per-token decode time
after a 2,048- and an 8,192-token prompt, and the state bytes, which must not grow; and it
replays the shared_prefix workload (one system prompt, different user text) twice, with the
state prefix cache off and on, for TTFT side by side.
"""

from __future__ import annotations

import math
import statistics
import time
from collections import deque
from pathlib import Path
from typing import TYPE_CHECKING

from laplace.config import Config
from laplace.serving.scheduler import Completion, Request, StepRecord

if TYPE_CHECKING:  # torch: not imported by the load generator, which uses `percentile`
    from laplace.serving.engine import DecodeEngine


def replay(engine: DecodeEngine, requests: list[Request]) -> list[Completion]:
    """Serve requests arriving at their arrival_s on the scheduler's virtual clock."""
    s = engine.scheduler
    pending = deque(sorted(requests, key=lambda r: (r.arrival_s, r.id)))
    while pending or s.has_work():
        while pending and pending[0].arrival_s <= s.now:
            s.submit(pending.popleft())
        if not s.has_work():
            s.now = max(s.now, pending[0].arrival_s)  # idle until the next arrival
            continue
        engine.step()
    return sorted(s.finished, key=lambda c: c.request_id)


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    k = (len(s) - 1) * q / 100
    lo, hi = math.floor(k), math.ceil(k)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


# --------------------------------------------------------------------------- metrics


def _dist(values: list[float], prefix: str) -> dict:
    out = {}
    for q in (50, 90, 99):
        out[f"{prefix}_p{q}_s"] = percentile(values, q)
    out[f"{prefix}_max_s"] = max(values) if values else None
    return out


def summarize(steps: list[StepRecord], done: list[Completion], ttft_slo: float, tpot_slo: float) -> dict:
    """Latency, throughput, compile and padding figures of one replayed workload."""
    served = [c for c in done if c.status == "done"]
    decode = [s for s in steps if s.kind == "decode"]
    decode_s = sum(s.seconds for s in decode)
    compile_decode = [s for s in decode if s.compiled]
    plain = [s.seconds for s in decode if not s.compiled]
    compile_s = sum(s.seconds for s in steps if s.compiled)
    makespan = max((c.finished_s for c in served), default=0.0) - min((c.arrival_s for c in done), default=0.0)
    out_tokens = sum(len(c.output_ids) for c in served)
    ttft = [c.ttft_s for c in served]
    tpot = [c.tpot_s for c in served if c.tpot_s is not None]
    itl = [x for c in served for x in c.itl_s]
    e2e = [c.e2e_s for c in served]
    good = [c for c in served if c.ttft_s <= ttft_slo and (c.tpot_s is None or c.tpot_s <= tpot_slo)]
    computed_rows = sum(s.width for s in decode)
    widths: dict[str, int] = {}
    for s in decode:
        widths[str(s.width)] = widths.get(str(s.width), 0) + 1
    return {
        "requests": len(done),
        "served": len(served),
        "rejected": len(done) - len(served),
        "rejected_queue_full": sum(c.reason.startswith("queue full") for c in done),  # shed, not invalid
        "steps": len(decode),
        "prefill_steps": len(steps) - len(decode),
        "widths_visited": len(widths),
        "widths_histogram": widths,
        "compile_events": sum(s.compiled for s in steps),
        "compile_events_decode": len(compile_decode),
        "compile_seconds": compile_s,
        "compile_time_share": sum(s.seconds for s in compile_decode) / decode_s if decode_s else 0.0,
        "compile_step_share": len(compile_decode) / len(decode) if decode else 0.0,
        "compile_cost_step_equivalents": (compile_s / statistics.median(plain)) if plain and compile_s else 0.0,
        "decode_seconds": decode_s,
        "padding_waste": sum(s.width - s.live for s in decode) / computed_rows if computed_rows else 0.0,
        "output_tokens": out_tokens,
        "makespan_s": makespan,
        "output_tokens_per_s": out_tokens / makespan if makespan > 0 else 0.0,
        **_dist(ttft, "ttft"),
        **_dist(tpot, "tpot"),
        **_dist(itl, "itl"),
        **_dist(e2e, "e2e"),
        "goodput_fraction": len(good) / len(done) if done else 0.0,
        "goodput_rps": len(good) / makespan if makespan > 0 else 0.0,
    }


def trace(steps: list[StepRecord], done: list[Completion]) -> dict:
    """Raw timeline and latencies, for plots."""
    return {
        "steps": [[s.kind, round(s.start_s, 6), round(s.seconds, 6), s.width, s.live, s.compiled] for s in steps],
        "ttft": [c.ttft_s for c in done if c.status == "done"],
        "e2e": [c.e2e_s for c in done if c.status == "done"],
    }


# --------------------------------------------------------------------------- the prefix cache, off and on


def prefix_cache_comparison(engine: DecodeEngine, requests: list[Request], ttft_slo: float, tpot_slo: float) -> dict:
    """`requests` replayed on the same (warm) engine with its state prefix cache off and on at its
    budget, interleaved off, on, on, off (an ABBA order: load on the machine that rises or falls
    during the comparison weighs on both sides alike, where one pass after the other let it decide
    the verdict). Each side's figures are the mean of its two passes; the cache's counters are
    those of one pass; whether the outputs are identical across all four."""
    prefix_cache = engine.cache.prefix_cache
    budget = prefix_cache.budget_bytes
    out: dict = {"budget_bytes": budget, "order": ["off", "on", "on", "off"] if budget else ["off"]}
    passes: dict[str, list[dict]] = {"off": [], "on": []}
    outputs: dict[str, list] = {"off": [], "on": []}
    try:
        for name in out["order"]:
            prefix_cache.budget_bytes = budget if name == "on" else 0
            engine.reset()
            done = replay(engine, requests)
            steps = engine.scheduler.steps
            figures = summarize(steps, done, ttft_slo, tpot_slo)
            figures["prefill_tokens_computed"] = sum(s.width for s in steps if s.kind == "prefill")
            figures["prefix_cache"] = engine.cache.stats()
            passes[name].append(figures)
            outputs[name].append([c.output_ids for c in done])
    finally:
        prefix_cache.budget_bytes = budget
        engine.reset()
    for name, runs in passes.items():
        if runs:
            out[name] = _mean_figures(runs)
    if "on" in out:
        off, on = out["off"], out["on"]
        first = outputs["off"][0]
        out["identical_outputs_share"] = sum(
            all(run[i] == first[i] for runs in outputs.values() for run in runs) for i in range(len(requests))
        ) / max(1, len(requests))
        out["on_vs_off"] = {
            k: on[k] / off[k]
            for k in ("ttft_p50_s", "ttft_p99_s", "output_tokens_per_s", "prefill_tokens_computed")
            if on.get(k) is not None and off.get(k)
        }
    return out


def _mean_figures(runs: list[dict]) -> dict:
    """The mean of each numeric figure over passes of one side (counters: the first pass's)."""
    out = dict(runs[0])
    for key, value in runs[0].items():
        values = [r.get(key) for r in runs]
        if isinstance(value, (int, float)) and not isinstance(value, bool) and all(v is not None for v in values):
            out[key] = sum(values) / len(values)
    return out


# --------------------------------------------------------------------------- one policy


def decode_cost(engine: DecodeEngine, contexts: list[int], steps: int, text) -> dict:
    """Per-token decode time at the engine's width for one row after a prompt of each context length.

    Each context is prefilled (in bucket pieces: only warmed graphs) into its own slot; the timed
    decode steps then alternate between the slots (generation.decode_step_times), so both contexts
    are measured under the same machine conditions. An engine with fewer slots than contexts times
    them in turn, as many side by side as it has slots."""
    import numpy as np
    import psutil

    from laplace.serving.generation import decode_step_times

    engine.reset()
    # a model with attention layers is timed at the contexts its slots hold (engine.max_context)
    limit, asked = engine.cache.max_context, list(contexts)
    contexts = [c for c in asked if limit is None or c + steps + 8 <= limit]
    prompts = {ctx: np.resize(np.asarray(text, dtype=np.int64), ctx) for ctx in contexts}
    times: dict[int, list[float]] = {}
    per_turn = engine.cache.max_slots
    for turn in [contexts[i : i + per_turn] for i in range(0, len(contexts), per_turn)]:
        with engine.cache.leased(-ctx for ctx in turn) as slots:
            times |= decode_step_times({c: (engine.runner, slot, prompts[c]) for c, slot in zip(turn, slots)}, steps)
    out = {
        "decode_s_per_token": {str(c): statistics.median(t) for c, t in times.items()},
        "state_bytes_per_sequence": {str(c): engine.cache.state.bytes_per_sequence for c in contexts},
        "rss_bytes": psutil.Process().memory_info().rss,
    }
    out["contexts_over_max_context"] = sorted(set(asked) - set(contexts))
    lo, hi = (str(min(contexts)), str(max(contexts))) if contexts else ("", "")
    out["ratio"] = out["decode_s_per_token"][hi] / out["decode_s_per_token"][lo] if len(contexts) > 1 else None
    engine.reset()
    return out


def long_prompt(engine: DecodeEngine, longest: int, text) -> dict:
    """A long prompt (`longest` tokens, within the engine's limits) arriving while others stream:
    its time to first token, and the streams' largest decode gap with it (chunked prefill: at most
    about one chunk) and without it (the same streams alone)."""
    import numpy as np

    limit = engine.scheduler.max_prompt_tokens
    if engine.cache.max_context is not None:  # attention layers: within the K/V cache, with room to decode
        limit = min(limit, engine.cache.max_context - 8)
    n, tokens = min(longest, limit), np.asarray(text, dtype=np.int64)
    streams = max(1, min(3, engine.cache.max_slots - 1))
    out: dict = {"prompt_tokens": n, "chunk_tokens": engine.runner.buckets[-1], "streams": streams}
    for case in ("without", "with"):
        requests = [Request(i, tokens[16 * i : 16 * i + 16].tolist(), 64) for i in range(streams)]
        if case == "with":  # arrives once the streams have started
            requests.append(Request(streams, np.resize(tokens, n).tolist(), 4, arrival_s=1e-9))
        engine.reset()
        done = replay(engine, requests)
        gaps = [gap for c in done[:streams] for gap in c.itl_s]
        out[f"streams_itl_max_s_{case}"] = max(gaps) if gaps else None
        out[f"streams_itl_p50_s_{case}"] = percentile(gaps, 50)
        if case == "with":
            out["ttft_s"] = done[streams].ttft_s
            out["compile_events"] = sum(s.compiled for s in engine.scheduler.steps)
    engine.reset()
    return out


def replay_policy(cfg: Config, policy: str, export_dir: Path, data_dir: Path) -> dict:
    """Replay every workload of `cfg.serve_check` under one policy in this process (the serve-check
    worker): figures, traces and, for `padded`, the decode cost against context."""
    import contextlib

    import torch

    from laplace.data.shards import open_split
    from laplace.runtime import compile_backend, resolve_device
    from laplace.serving.engine import DecodeEngine
    from laplace.serving.warmup import apply_compile_settings
    from laplace.serving.workload import SHARED_PREFIX, build_requests

    # as warmup compiled and laplace serve runs: the graphs load from the cache, and the live
    # phase compares like with like
    apply_compile_settings(cfg.server.threads)
    device = resolve_device(cfg.engine.device)
    engine, _, _ = DecodeEngine.from_export(export_dir, cfg.engine, policy, device=device, kernel=cfg.model.kernel)
    text = open_split(data_dir, "val")
    backend = compile_backend(device)
    result: dict = {"policy": policy, "backend": backend, "workloads": {}, "traces": {}, "outputs": {}}
    stance = contextlib.nullcontext()
    if policy == "padded":
        start = time.perf_counter()
        warm = engine.runner.warmup(log=lambda line: print(line, flush=True))
        result["warm_start"] = {k: {str(w): s for w, s in v.items()} for k, v in warm.items()}
        result["warm_start_s"] = time.perf_counter() - start
        result["warm_start_report"] = dict(engine.runner.warmup_report)
        stance = torch.compiler.set_stance("fail_on_recompile")  # any compile from here on is an error
    kinds = cfg.serve_check.exact_workloads if policy == "exact" else cfg.serve_check.workloads
    for kind in kinds:
        engine.reset()
        requests = build_requests(kind, cfg.serve_check, text, cfg.serve_check.seed)
        with stance:
            done = replay(engine, requests)
        leaked = engine.cache.pool.owners
        if leaked:
            raise RuntimeError(f"slots still owned after {kind}: {leaked}")
        steps = engine.scheduler.steps
        result["workloads"][kind] = summarize(steps, done, cfg.serve_check.slo_ttft_s, cfg.serve_check.slo_tpot_s)
        result["traces"][kind] = trace(steps, done)
        result["workloads"][kind]["outputs_digest"] = hash(tuple(tuple(c.output_ids) for c in done)) & 0xFFFFFFFF
        result["outputs"][kind] = [c.output_ids for c in done]  # by request id
        print(
            f"{policy}/{kind}: {result['workloads'][kind]['output_tokens_per_s']:.0f} tokens/s, "
            f"{result['workloads'][kind]['compile_events']} compile events",
            flush=True,
        )
    if policy == "padded":
        sc = cfg.serve_check
        requests = build_requests(SHARED_PREFIX, sc, text, sc.seed, cfg.engine.max_prompt_tokens)
        with stance:
            result["prefix_cache"] = prefix_cache_comparison(engine, requests, sc.slo_ttft_s, sc.slo_tpot_s)
        pc = result["prefix_cache"]
        if "on" in pc:
            print(
                f"padded/{SHARED_PREFIX}: TTFT p50 {pc['off']['ttft_p50_s']:.4f}s without the prefix cache, "
                f"{pc['on']['ttft_p50_s']:.4f}s with it ({pc['on']['prefix_cache']['hits']} hits)",
                flush=True,
            )
        with stance:
            result["long_prompt"] = lp = long_prompt(engine, max(sc.decode_contexts), text)
        print(
            f"padded/long_prompt: {lp['prompt_tokens']} tokens, TTFT {lp['ttft_s']:.3f}s; the other streams' "
            f"largest decode gap {lp['streams_itl_max_s_with']:.4f}s (alone {lp['streams_itl_max_s_without']:.4f}s)",
            flush=True,
        )
        with stance:
            result["decode_cost"] = decode_cost(
                engine,
                cfg.serve_check.decode_contexts,
                cfg.serve_check.decode_timing_steps,
                text[: max(cfg.serve_check.decode_contexts)],
            )
    return result
