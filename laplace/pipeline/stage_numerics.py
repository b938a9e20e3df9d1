"""The numerics stage: compiled vs eager vs fp64 on prefill, decode widths and a training step;
a missed gate fails it.

Processes: `run` starts this module as a worker (`main`, laplace.evals.numerics.run_numerics)
in a fresh process started from a copy of the warmup compile cache: the compiled graphs
checked are the ones warmup compiled, with no state left over from this process. It runs on
the CPU, with the portable torch GLA core (the oracle); the fla kernel is compared with it by
tests/test_kernels.py on CUDA."""

from __future__ import annotations

import sys

from laplace.config import Config
from laplace.errors import GateFailed
from laplace.pipeline.layout import Paths, write_metrics
from laplace.pipeline.workers import run_worker_from_warmup_cache, worker_main


def run(cfg: Config, paths: Paths) -> dict:
    args = ["--export-dir", str(paths.export_dir), "--data-dir", str(paths.data_dir)]
    metrics = run_worker_from_warmup_cache(__name__, cfg, args, paths.warmup_cache)
    write_metrics(paths, "numerics", metrics)
    if not metrics["passed"]:
        print(metrics["gate_table"], file=sys.stderr)
        missed = [k for k, g in metrics["gates"].items() if not g["passed"]]
        raise GateFailed(
            f"{len(missed)} numerics gate(s) missed: {'; '.join(missed)} "
            f"(table above, figures in {paths.metrics_file('numerics')})"
        )
    return metrics


def _serving_threads(cfg: Config) -> Config:
    """server.threads, as warmup compiled the graphs checked (the thread count is in Inductor's
    cache key) and so that the checks do not take one thread per core of a shared machine."""
    from laplace.serving.warmup import apply_compile_settings

    apply_compile_settings(cfg.server.threads)
    return cfg


def main(argv: list[str] | None = None) -> int:
    from laplace.evals.numerics import run_numerics

    return worker_main(
        "numerics worker",
        lambda cfg, args: run_numerics(_serving_threads(cfg), args.export_dir, args.data_dir),
        argv,
        paths=("export-dir", "data-dir"),
        summary=lambda r: r["gate_table"],
    )


if __name__ == "__main__":
    sys.exit(main())
