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

# A passkey is a random 5-digit number (10000-99999): one guess finds it 1 time in 90,000.
PASSKEY_CHANCE = 1 / 90_000


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
    from laplace.pipeline.plots import accuracy_plot, memory_plot, series_rows, write_rows
    from laplace.serving.warmup import apply_compile_settings

    # server.threads, as warmup compiled the serving graphs probed (the count is in Inductor's cache key)
    apply_compile_settings(cfg.server.threads)

    plots_dir = Path(plots_dir)
    metrics, figures = run_probes(cfg, export_dir, data_dir)
    accuracy_plot(figures["mqar"], plots_dir / "probes_mqar.png")
    # DVC plot data: accuracy against context length, a line (`series`) per pair count or depth,
    # and chance; series that coincide are drawn as one line naming them all (plots.series_rows)
    # the MQAR-trained GLA's accuracy (probes.train_mqar), else the exported model's
    grid = {int(c): {int(n): a for n, a in row.items()} for c, row in figures["mqar"]["accuracy"].items()}
    pairs = sorted({n for row in grid.values() for n in row})
    write_rows(
        plots_dir / "probes_mqar.json",
        series_rows(
            {f"{n} pairs": {c: row[n] for c, row in grid.items() if n in row} for n in pairs},
            x="context",
            y="accuracy",
            chance=figures["mqar"].get("chance"),
        ),
    )
    passkey: dict[float, dict[int, list[bool]]] = {}
    for row in figures["passkey"]:
        passkey.setdefault(float(row["depth"]), {}).setdefault(int(row["context"]), []).append(bool(row["found"]))
    write_rows(
        plots_dir / "probes_passkey.json",
        series_rows(
            {
                f"depth {d:g}": {c: sum(found) / len(found) for c, found in by_context.items()}
                for d, by_context in sorted(passkey.items())
            },
            x="context",
            y="accuracy",
            chance=PASSKEY_CHANCE,
        ),
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
