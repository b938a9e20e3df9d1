"""The probes stage: MQAR and passkey retrieval and state vs KV memory on the exported model.
Retrieval is reported, not gated on: `passed` (the serving and eager paths agree, the measured
state equals the formula) is one of the champion gates.

Processes: `run` starts this module as a worker (`main`: the probes and their plots) in a fresh
process started from a copy of the warmup compile cache, so the serving graphs are the ones
warmup compiled and the memory measured is a fresh process's."""

from __future__ import annotations

import sys
from pathlib import Path

from laplace.config import Config
from laplace.pipeline.layout import Paths, write_metrics
from laplace.pipeline.workers import run_worker_from_warmup_cache, worker_main


def run(cfg: Config, paths: Paths) -> dict:
    args = [
        "--export-dir",
        str(paths.export_dir),
        "--data-dir",
        str(paths.data_dir),
        "--plots-dir",
        str(paths.plots_dir),
    ]
    metrics = run_worker_from_warmup_cache(__name__, cfg, args, paths.warmup_cache)
    return write_metrics(paths, "probes", metrics)


def probe_and_plot(cfg: Config, export_dir: Path, data_dir: Path, plots_dir: Path) -> dict:
    """The worker's body: run the probes, draw plots/probes_*.png, write their data (DVC plots:
    accuracy against context length) and every passkey prompt; returns the metrics."""
    from laplace.evals.probes import run_probes
    from laplace.pipeline.plots import accuracy_plot, memory_plot, write_rows

    plots_dir = Path(plots_dir)
    metrics, figures = run_probes(cfg, export_dir, data_dir)
    accuracy_plot(figures["mqar"], plots_dir / "probes_mqar.png")
    # DVC plot data: accuracy against context length, a line (`series`) per pair count or depth
    write_rows(
        plots_dir / "probes_mqar.json",
        [
            {"context": int(c), "pairs": int(n), "series": f"{n} pairs", "accuracy": a}
            for c, row in sorted(figures["mqar"]["accuracy"].items(), key=lambda kv: int(kv[0]))
            for n, a in sorted(row.items(), key=lambda kv: int(kv[0]))
        ],
    )
    passkey = {}
    for row in figures["passkey"]:
        passkey.setdefault((int(row["context"]), float(row["depth"])), []).append(bool(row["found"]))
    write_rows(
        plots_dir / "probes_passkey.json",
        [
            {"context": c, "depth": d, "series": f"depth {d:g}", "accuracy": sum(found) / len(found)}
            for (c, d), found in sorted(passkey.items())
        ],
    )
    write_rows(plots_dir / "probes_passkey_prompts.json", figures["passkey"])  # every prompt and its output
    memory_plot(figures["memory"], plots_dir / "probes_memory.png")
    return metrics


def main(argv: list[str] | None = None) -> int:
    return worker_main(
        "probes worker",
        lambda cfg, args: probe_and_plot(cfg, args.export_dir, args.data_dir, args.plots_dir),
        argv,
        paths=("export-dir", "data-dir", "plots-dir"),
    )


if __name__ == "__main__":
    sys.exit(main())
