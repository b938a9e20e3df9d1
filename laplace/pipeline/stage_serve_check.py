"""The serve-check stage: replay seeded workloads under the exact, padded and eager policies.

Processes: `run` starts this module as a worker once per policy (`main`,
laplace.serving.replay.replay_policy), each in its own fresh process so compile caches cannot
leak between them:

- exact:  an empty compile cache (a fresh deployment with no warmup);
- padded: a copy of the warmup stage's compile cache (every graph must load from it), serving
          under fail_on_recompile; also the shared_prefix workload with the state prefix
          cache off and on, TTFT side by side;
- eager:  no compiler at all.

Then a short live phase (serve_check.live): `laplace serve` (padded, from the warmup cache) in a
process of its own (`python -m laplace.pipeline.serve`, a real server) on a free loopback port,
the headline workload sent by the load generator in wall-clock time, SIGTERM.
The live figures sit beside the replay's, with how well the replay's virtual clock predicted
them (live / replay).

The figures go to metrics/serve-check.json and plots/serve_*.png; a missed gate fails the stage.
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


def run(cfg: Config, paths: Paths) -> dict:
    """Replay the workloads under the three policies; fail on a missed gate (metrics and plots first)."""
    from laplace.pipeline import plots

    with tempfile.TemporaryDirectory(prefix="laplace-serve-") as scratch:
        metrics, traces = replay_policies(cfg, paths.export_dir, paths.data_dir, paths.warmup_cache, Path(scratch))
    if cfg.serve_check.live:
        metrics = add_live(metrics, live_phase(cfg, paths.export_dir, paths.data_dir, paths.warmup_cache, "padded"))
    metrics.pop("_outputs", None)
    workload = metrics["headline_workload"]
    plots.latency_cdfs(traces, workload, paths.plots_dir / "serve_latency_cdf.png")
    plots.step_timeline(traces, workload, paths.plots_dir / "serve_timeline.png")
    plots.width_histogram(traces, workload, paths.plots_dir / "serve_widths.png")
    write_metrics(paths, "serve-check", metrics)
    if not metrics["passed"]:
        missed = ", ".join(k for k, ok in metrics["gates"].items() if not ok)
        raise GateFailed(f"serve-check gates missed: {missed} (see {paths.metrics_file('serve-check')})")
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
    from laplace.serving.engine import POLICIES  # torch: imported when the stage runs, not with the registry

    headline = headline_workload(cfg)
    metrics: dict = {"headline_workload": headline, "compile_backend": results["padded"].get("backend", "inductor")}
    for policy in POLICIES:
        wl = results[policy]["workloads"]
        metrics[policy] = dict(wl.get(headline) or next(iter(wl.values())))
    metrics["by_workload"] = {
        kind: {p: results[p]["workloads"][kind] for p in POLICIES if kind in results[p]["workloads"]}
        for kind in cfg.serve_check.workloads
    }
    cost = results["padded"]["decode_cost"]
    metrics["decode_s_per_token"] = cost["decode_s_per_token"]
    metrics["state_bytes_per_sequence"] = cost["state_bytes_per_sequence"]
    metrics["decode_rss_bytes"] = cost["rss_bytes"]
    lo, hi = min(cfg.serve_check.decode_contexts), max(cfg.serve_check.decode_contexts)
    metrics[f"decode_cost_ratio_{hi}_vs_{lo}"] = cost["ratio"]
    metrics["warm_start_s"] = results["padded"]["warm_start_s"]
    warm = results["padded"]["warm_start_report"]
    metrics["warm_start_loaded_from_cache"] = f"{warm['loaded_from_cache']}/{warm['graphs']}"
    metrics["prefix_cache"] = prefix_cache_figures(results["padded"]["prefix_cache"])
    # chunked prefill: a long prompt's TTFT and the other streams' decode gaps with it and without it
    metrics["long_prompt"] = results["padded"].get("long_prompt")
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
        # one compile, loaded everywhere: warmup's graphs are the ones the replay looks up
        "padded_warm_start_from_cache": warm["loaded_from_cache"] == warm["graphs"] or not inductor(results),
        # None: a model with attention layers whose slots hold fewer than two of the contexts
        "decode_cost_ratio": cost["ratio"] is None or cost["ratio"] <= cfg.serve_check.max_decode_cost_ratio,
        "state_bytes_constant": len(states) == 1,
        "every_request_served": all(
            w["served"] == w["requests"] for r in results.values() for w in r["workloads"].values()
        ),
    }
    metrics["gates"] = gates
    metrics["greedy_outputs_identical_across_policies"] = same_outputs
    metrics["passed"] = all(gates.values())
    metrics["_outputs"] = {p: results[p].get("outputs", {}).get(headline) for p in POLICIES}  # for add_live
    traces = {p: results[p]["traces"] for p in POLICIES}
    return metrics, traces


def inductor(results: dict) -> bool:
    """Whether the compile cache counters mean anything (Inductor's FX graph cache; not Neuron's)."""
    return results["padded"].get("backend", "inductor") == "inductor"


def prefix_cache_figures(pc: dict) -> dict:
    """The shared_prefix workload with the prefix cache off and on: the figures side by side."""
    keys = ("ttft_p50_s", "ttft_p99_s", "output_tokens_per_s", "prefill_tokens_computed")
    out = {"budget_bytes": pc["budget_bytes"], "off": {k: pc["off"].get(k) for k in keys}}
    if "on" in pc:
        out["on"] = {k: pc["on"].get(k) for k in keys} | pc["on"]["prefix_cache"]
        out["on_vs_off"] = pc["on_vs_off"]
        out["identical_outputs_share"] = pc["identical_outputs_share"]
    return out


# --------------------------------------------------------------------------- the live phase

LIVE_VS_REPLAY = (
    "output_tokens_per_s",
    "ttft_p50_s",
    "ttft_p99_s",
    "tpot_p50_s",
    "tpot_p99_s",
    "itl_p99_s",
    "e2e_p50_s",
    "e2e_p99_s",
)


def scrape(url: str) -> dict[str, float]:
    """The server's Prometheus samples as {name{labels}: value}."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    out = {}
    for family in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=10).text):
        for sample in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items()))
            out[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return out


def live_phase(cfg: Config, export_dir: Path, data_dir: Path, warmup_cache: Path | None, policy: str) -> dict:
    """Serve the headline workload live: `laplace serve` from the warmup cache on a free loopback
    port, the load generator sending the replay's requests at their arrival times, SIGTERM.
    Client-side figures, the server's own counters, and its exit status."""
    from laplace.data.shards import open_split
    from laplace.pipeline.serve import ServerProcess
    from laplace.serving.loadgen import run_load, summarize_load
    from laplace.serving.workload import build_requests

    headline = headline_workload(cfg)
    requests = build_requests(headline, cfg.serve_check, open_split(data_dir, "val"), cfg.serve_check.seed)
    server = ServerProcess(
        cfg,
        model=export_dir,
        policy=policy,
        compile_cache=warmup_cache,
        echo=lambda line: print(f"  [serve] {line}", flush=True),
    )
    with server:
        ready_s = server.wait_ready(cfg.serve_check.live_startup_s)
        results, wall_s = run_load(server.url, requests, cfg.tracking.model_name)
        counters = scrape(server.url)
        status = server.stop()
    summary = summarize_load(results, cfg.serve_check.slo_ttft_s, cfg.serve_check.slo_tpot_s)
    log_text = "\n".join(server.lines)
    live = {
        "workload": headline,
        "policy": policy,
        **summary,
        "wall_s": wall_s,
        "server_ready_s": ready_s,
        "server_startup_s": counters.get("laplace_startup_seconds"),
        "warmup_graphs": counters.get("laplace_warmup_graphs", 0.0),
        "warmup_graphs_from_cache": counters.get("laplace_warmup_graphs_loaded_from_cache", 0.0),
        "compile_events": counters.get("laplace_compile_events_total", 0.0),
        "engine_errors": sum(v for k, v in counters.items() if k.startswith("laplace_engine_errors_total")),
        "busy_slots_after": counters.get("laplace_busy_slots", 0.0),
        "server_exit_status": status,
        "server_traceback": "Traceback (most recent call last)" in log_text,
        "outputs": [r.output_ids for r in results],
    }
    print(
        f"live/{headline}: {summary['output_tokens_per_s']:.0f} tokens/s, TTFT p99 {summary['ttft_p99_s'] or 0:.3f}s, "
        f"{summary['served']}/{summary['requests']} served, {live['compile_events']:.0f} compiles, exit {status}",
        flush=True,
    )
    return live


def add_live(metrics: dict, live: dict) -> dict:
    """The live figures beside the replay's, the ratios (live / replay: 1.0 is a perfect prediction
    by the virtual clock) and the live gates."""
    outputs = live.pop("outputs")
    replay = metrics[live["policy"]]
    metrics["live"] = live
    metrics["live_vs_replay"] = {
        k: live[k] / replay[k] for k in LIVE_VS_REPLAY if live.get(k) is not None and replay.get(k)
    }
    replay_outputs = metrics.pop("_outputs", {}).get(live["policy"])
    if replay_outputs is not None:
        same = sum(a == b for a, b in zip(outputs, replay_outputs))
        metrics["live_vs_replay"]["identical_outputs_share"] = same / max(1, len(replay_outputs))
    metrics["gates"].update(
        {
            "live_zero_compiles": live["compile_events"] == 0,
            "live_warm_start_from_cache": live["warmup_graphs_from_cache"] == live["warmup_graphs"]
            or live["policy"] == "eager"
            or metrics.get("compile_backend", "inductor") != "inductor",
            "live_every_request_served": live["served"] == live["requests"],
            "live_clean_shutdown": live["server_exit_status"] == 0 and not live["server_traceback"],
        }
    )
    metrics["passed"] = all(metrics["gates"].values())
    return metrics


def headline_workload(cfg: Config) -> str:
    return "poisson" if "poisson" in cfg.serve_check.exact_workloads else cfg.serve_check.exact_workloads[0]


def main(argv: list[str] | None = None) -> int:
    from laplace.serving.engine import POLICIES
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
