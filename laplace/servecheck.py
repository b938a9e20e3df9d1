"""The serve-check stage: replay seeded workloads through the decode engine, policy by policy.

Each policy runs in its own fresh process, so compile caches cannot leak between them:

- exact:  decode at exactly the live count, compiling each new width on first sight,
          with an empty compile cache (a fresh deployment with no warmup);
- padded: decode at the smallest ladder width that holds the live rows, started from
          the warmup stage's compile cache; serving runs under
          torch.compiler.set_stance("fail_on_recompile"), so any compilation after warmup
          is an error that fails the stage;
- eager:  no compiler at all.

The padded process also measures decode cost against context: the per-token decode
time after a 2,048- and an 8,192-token prompt, and the state bytes, which must not grow.
"""

from __future__ import annotations

import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from laplace.config import Config
from laplace.serve import POLICIES, Completion, StepRecord, percentile
from laplace.worker import compile_env, run_worker, worker_main


class GateFailed(RuntimeError):
    """A serving gate was missed (the metrics are still written)."""


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


def _trace(steps: list[StepRecord], done: list[Completion]) -> dict:
    """Raw timeline and latencies, for plots."""
    return {
        "steps": [[s.kind, round(s.start_s, 6), round(s.seconds, 6), s.width, s.live, s.compiled] for s in steps],
        "ttft": [c.ttft_s for c in done if c.status == "done"],
        "e2e": [c.e2e_s for c in done if c.status == "done"],
    }


# --------------------------------------------------------------------------- worker process


def _decode_cost(engine, contexts: list[int], steps: int, text) -> dict:
    """Per-token decode time at width 1 after a prompt of each context length.

    Each context is prefilled into its own slot; the timed decode steps then alternate
    between the slots, so both contexts are measured under the same machine conditions."""
    import numpy as np
    import psutil
    import torch

    engine.reset()
    slots, tokens = {}, {}
    for ctx in contexts:
        slot = engine.pool.acquire(-ctx)
        reps = int(np.ceil(ctx / len(text)))
        prompt = torch.as_tensor(np.tile(np.asarray(text, dtype=np.int64), reps)[:ctx]).view(1, -1)
        slots[ctx] = torch.tensor([slot], device=engine.device)
        with torch.inference_mode(), torch.compiler.set_stance("force_eager"):  # a one-off shape
            tokens[ctx] = engine.model.prefill(prompt.to(engine.device), engine.state, slots[ctx]).argmax(-1)
    times: dict[int, list[float]] = {ctx: [] for ctx in contexts}
    with torch.inference_mode():
        for i in range(steps + 4):
            for ctx in contexts:
                start = time.perf_counter()
                tokens[ctx] = engine.decode_rows(tokens[ctx], slots[ctx]).argmax(-1)
                if i >= 4:  # the first rounds warm caches
                    times[ctx].append(time.perf_counter() - start)
    out = {
        "decode_s_per_token": {str(c): statistics.median(t) for c, t in times.items()},
        "state_bytes_per_sequence": {str(c): engine.state.bytes_per_sequence for c in contexts},
        "rss_bytes": psutil.Process().memory_info().rss,
    }
    lo, hi = str(min(contexts)), str(max(contexts))
    out["ratio"] = out["decode_s_per_token"][hi] / out["decode_s_per_token"][lo]
    engine.reset()
    return out


def _worker(cfg: Config, policy: str, export_dir: Path, data_dir: Path) -> dict:
    import contextlib

    import torch

    from laplace.data import open_split
    from laplace.export import load_export
    from laplace.runtime import compile_backend, configure_compiler, resolve_device
    from laplace.serve import DecodeEngine, replay
    from laplace.workload import build_requests

    device = resolve_device(cfg.serve.device)
    model, _, _ = load_export(export_dir, device=device)
    text = open_split(data_dir, "val")
    engine = DecodeEngine.for_policy(model, cfg.serve, policy, compile_backend(device))
    configure_compiler(engine.graphs_needed())
    result: dict = {"policy": policy, "workloads": {}, "traces": {}}
    stance = contextlib.nullcontext()
    if policy == "padded":
        start = time.perf_counter()
        result["warm_start"] = {k: {str(w): s for w, s in v.items()} for k, v in engine.warmup().items()}
        result["warm_start_s"] = time.perf_counter() - start
        stance = torch.compiler.set_stance("fail_on_recompile")  # any compile from here on is an error
    kinds = cfg.serve.exact_workloads if policy == "exact" else cfg.serve.workloads
    for kind in kinds:
        engine.reset()
        requests = build_requests(kind, cfg.serve, text, cfg.serve.seed)
        with stance:
            done = replay(engine, requests)
        leaked = engine.pool.owners
        if leaked:
            raise RuntimeError(f"slots still owned after {kind}: {leaked}")
        result["workloads"][kind] = summarize(engine.steps, done, cfg.serve.slo_ttft_s, cfg.serve.slo_tpot_s)
        result["traces"][kind] = _trace(engine.steps, done)
        result["workloads"][kind]["outputs_digest"] = hash(tuple(tuple(c.output_ids) for c in done)) & 0xFFFFFFFF
        print(f"{policy}/{kind}: {result['workloads'][kind]['output_tokens_per_s']:.0f} tokens/s, "
              f"{result['workloads'][kind]['compile_events']} compile events", flush=True)
    if policy == "padded":
        with stance:
            result["decode_cost"] = _decode_cost(engine, cfg.serve.decode_contexts, cfg.serve.decode_timing_steps,
                                                 text[: max(cfg.serve.decode_contexts)])
    return result


def main(argv: list[str] | None = None) -> int:
    return worker_main(
        "serve-check worker: replay the workloads under one policy",
        lambda cfg, args: _worker(cfg, args.policy, args.export_dir, args.data_dir), argv,
        paths=("export-dir", "data-dir"), options={"policy": {"choices": POLICIES}},
    )


# --------------------------------------------------------------------------- the stage


def serve_check_stage(cfg: Config, export_dir: Path, data_dir: Path, warmup_cache: Path, scratch: Path,
                      plots_dir: Path) -> tuple[dict, dict]:
    """Run the three policies; returns (metrics, traces). Raises GateFailed after writing nothing
    itself: the caller writes metrics and plots first."""
    scratch.mkdir(parents=True, exist_ok=True)
    results = {}
    args = ["--export-dir", str(export_dir), "--data-dir", str(data_dir)]
    for policy in ("exact", "padded", "eager"):
        with tempfile.TemporaryDirectory(prefix=f"laplace-{policy}-cache-") as tmp:
            cache = None
            if policy == "exact":
                cache = Path(tmp)  # empty: a fresh deployment
            elif policy == "padded":
                cache = Path(tmp) / "cache"
                shutil.copytree(warmup_cache, cache)  # the warmup artifact stays untouched
            results[policy] = run_worker("laplace.servecheck", cfg, args + ["--policy", policy],
                                         compile_env(cache), Path.cwd(), scratch / f"serve-{policy}.json")
    return combine(cfg, results)


def combine(cfg: Config, results: dict) -> tuple[dict, dict]:
    headline = "poisson" if "poisson" in cfg.serve.exact_workloads else cfg.serve.exact_workloads[0]
    metrics: dict = {"headline_workload": headline}
    for policy in POLICIES:
        wl = results[policy]["workloads"]
        metrics[policy] = dict(wl.get(headline) or next(iter(wl.values())))
    metrics["by_workload"] = {
        kind: {p: results[p]["workloads"][kind] for p in POLICIES if kind in results[p]["workloads"]}
        for kind in cfg.serve.workloads
    }
    cost = results["padded"]["decode_cost"]
    metrics["decode_s_per_token"] = cost["decode_s_per_token"]
    metrics["state_bytes_per_sequence"] = cost["state_bytes_per_sequence"]
    metrics["decode_rss_bytes"] = cost["rss_bytes"]
    lo, hi = min(cfg.serve.decode_contexts), max(cfg.serve.decode_contexts)
    metrics[f"decode_cost_ratio_{hi}_vs_{lo}"] = cost["ratio"]
    metrics["warm_start_s"] = results["padded"]["warm_start_s"]
    exact_tps = metrics["exact"]["output_tokens_per_s"]
    metrics["padded_speedup_vs_exact"] = metrics["padded"]["output_tokens_per_s"] / exact_tps if exact_tps else None
    padded_compiles = sum(w["compile_events"] for w in results["padded"]["workloads"].values())
    same_outputs = all(
        results["padded"]["workloads"][k]["outputs_digest"] == results[p]["workloads"][k]["outputs_digest"]
        for p in ("exact", "eager") for k in results[p]["workloads"] if k in results["padded"]["workloads"]
    )
    states = set(cost["state_bytes_per_sequence"].values())
    gates = {
        "padded_zero_compiles": padded_compiles == 0,
        "decode_cost_ratio": cost["ratio"] <= cfg.serve.max_decode_cost_ratio,
        "state_bytes_constant": len(states) == 1,
        "every_request_served": all(w["served"] == w["requests"] for r in results.values()
                                    for w in r["workloads"].values()),
    }
    metrics["gates"] = gates
    metrics["greedy_outputs_identical_across_policies"] = same_outputs
    metrics["passed"] = all(gates.values())
    traces = {p: results[p]["traces"] for p in POLICIES}
    return metrics, traces


if __name__ == "__main__":
    sys.exit(main())
