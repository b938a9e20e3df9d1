"""The serve-check stage: replay seeded workloads under the exact, padded and eager policies, each
in its own fresh process so compile caches cannot leak between them:

- exact:  an empty compile cache (a fresh deployment with no warmup);
- padded: a copy of the warmup stage's compile cache, serving under fail_on_recompile;
- eager:  no compiler at all.

The figures go to metrics/serve.json and plots/serve_*.png; a missed gate fails the stage.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path

from laplace.config import Config
from laplace.errors import GateFailed
from laplace.pipeline.layout import Paths, write_metrics
from laplace.pipeline.workers import compile_env, run_worker, worker_main
from laplace.serving.engine import POLICIES


def run(cfg: Config, paths: Paths) -> dict:
    """Replay the workloads under the three policies; fail on a missed gate (metrics and plots first)."""
    from laplace.pipeline import plots

    with tempfile.TemporaryDirectory(prefix="laplace-serve-") as scratch:
        metrics, traces = replay_policies(cfg, paths.export_dir, paths.data_dir, paths.warmup_cache, Path(scratch))
    workload = metrics["headline_workload"]
    plots.latency_cdfs(traces, workload, paths.plots_dir / "serve_latency_cdf.png")
    plots.step_timeline(traces, workload, paths.plots_dir / "serve_timeline.png")
    plots.width_histogram(traces, workload, paths.plots_dir / "serve_widths.png")
    write_metrics(paths, "serve", metrics)
    if not metrics["passed"]:
        missed = ", ".join(k for k, ok in metrics["gates"].items() if not ok)
        raise GateFailed(f"serve-check gates missed: {missed} (see {paths.metrics_file('serve')})")
    return metrics


def replay_policies(
    cfg: Config, export_dir: Path, data_dir: Path, warmup_cache: Path, scratch: Path
) -> tuple[dict, dict]:
    """Run the three policies, each in a fresh worker process; returns (metrics, traces)."""
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
            results[policy] = run_worker(
                __name__,
                cfg,
                args + ["--policy", policy],
                compile_env(cache),
                Path.cwd(),
                scratch / f"serve-{policy}.json",
            )
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
        for p in ("exact", "eager")
        for k in results[p]["workloads"]
        if k in results["padded"]["workloads"]
    )
    states = set(cost["state_bytes_per_sequence"].values())
    gates = {
        "padded_zero_compiles": padded_compiles == 0,
        "decode_cost_ratio": cost["ratio"] <= cfg.serve.max_decode_cost_ratio,
        "state_bytes_constant": len(states) == 1,
        "every_request_served": all(
            w["served"] == w["requests"] for r in results.values() for w in r["workloads"].values()
        ),
    }
    metrics["gates"] = gates
    metrics["greedy_outputs_identical_across_policies"] = same_outputs
    metrics["passed"] = all(gates.values())
    traces = {p: results[p]["traces"] for p in POLICIES}
    return metrics, traces


def main(argv: list[str] | None = None) -> int:
    from laplace.serving.replay import replay_policy

    return worker_main(
        "serve-check worker: replay the workloads under one policy",
        lambda cfg, args: replay_policy(cfg, args.policy, args.export_dir, args.data_dir),
        argv,
        paths=("export-dir", "data-dir"),
        options={"policy": {"choices": POLICIES}},
    )


if __name__ == "__main__":
    sys.exit(main())
