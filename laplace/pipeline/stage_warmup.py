"""The warmup stage: compile every serving graph into artifacts/warmup/compile-cache.

Processes: `run` (in the `laplace warmup` process) starts this module twice as a worker
(`python -m laplace.pipeline.stage_warmup`, `main`), because a compile cache is per-process
state plus a directory: the first worker with an empty cache directory (cold: what a new deployment pays),
the second reusing it (warm: what serve-check pays when it starts from this artifact); each
measured in wall-clock seconds and in CPU-seconds of its process tree. On CPU the artifact holds
the ahead-of-time packages of the whole-step graphs (`aoti/`, serving/aot.py: a warm start loads
them without tracing, whatever `engine.compile_scope`) beside the Inductor cache directory (what a
graph without a package, e.g. on CUDA, loads from); on Trainium the same directory is handed to
Neuron as its NEFF cache.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path

from laplace.config import Config
from laplace.data.shards import read_manifest
from laplace.pipeline.layout import Paths, write_metrics
from laplace.pipeline.workers import compile_env, run_worker, worker_main
from laplace.processes import reaped_children_cpu_s


def run(cfg: Config, paths: Paths) -> dict:
    vocab = read_manifest(paths.data_dir)["vocab_size"]
    with tempfile.TemporaryDirectory(prefix="laplace-warmup-") as scratch:
        metrics = warm_up(cfg, paths.warmup_cache, vocab, Path(scratch))
    return write_metrics(paths, "warmup", metrics)


def dir_size(path: Path) -> tuple[int, int]:
    files = [p for p in Path(path).rglob("*") if p.is_file()]
    return len(files), sum(p.stat().st_size for p in files)


def warm_up(cfg: Config, cache_dir: Path, vocab_size: int, scratch: Path) -> dict:
    """Cold compile into a fresh `cache_dir`, then a warm start from it, each in a fresh process."""
    from laplace.serving.aot import PACKAGE_DIR

    shutil.rmtree(cache_dir, ignore_errors=True)
    cache_dir.mkdir(parents=True)
    scratch.mkdir(parents=True, exist_ok=True)
    env = compile_env(cache_dir)
    args = ["--vocab-size", str(vocab_size)]
    cpu_s = {}

    def start(name: str) -> dict:  # the worker, and its process tree's CPU-seconds: robust to machine load
        before = reaped_children_cpu_s()
        result = run_worker(__name__, cfg, args, env, Path.cwd(), scratch / f"warmup-{name}.json")
        cpu_s[name] = reaped_children_cpu_s() - before
        return result

    cold, warm = start("cold"), start("warm")
    files, size = dir_size(cache_dir)
    packages = list((cache_dir / PACKAGE_DIR).glob("*.pt2"))
    return {
        "backend": cold["backend"],
        "compile_scope": cfg.engine.compile_scope,
        "device": cold["device"],
        "graphs": cold["graphs"],
        "cold": cold["seconds"],
        "warm": warm["seconds"],
        "compile_seconds_total": cold["seconds"]["total_s"],
        "warm_start_seconds_total": warm["seconds"]["total_s"],
        "warm_speedup": cold["seconds"]["total_s"] / max(warm["seconds"]["total_s"], 1e-9),
        "warm_loaded_from_cache": warm["loaded_from_cache"],  # a warm start must load every graph
        "threads": cold["settings"]["threads"],  # in Inductor's cache key: serve runs with the same
        "cold_process_s": cold["process_s"],
        "warm_process_s": warm["process_s"],
        "cold_cpu_s": cpu_s["cold"],
        "warm_cpu_s": cpu_s["warm"],
        "warm_cpu_fraction": cpu_s["warm"] / max(cpu_s["cold"], 1e-9),  # issue's bound: at most 0.10
        "packages": len(packages),  # AOTInductor packages (serving/aot.py): what a warm start loads
        "cache_files": files,
        "cache_bytes": size,
    }


def main(argv: list[str] | None = None) -> int:
    from laplace.serving.warmup import compile_serving_graphs

    return worker_main(
        "warmup worker: compile every serving graph once",
        lambda cfg, args: compile_serving_graphs(cfg, args.vocab_size),
        argv,
        options={"vocab-size": {"type": int}},
        summary=lambda r: (
            f"compiled {r['graphs']} graphs in {r['seconds']['total_s']:.1f}s (process {r['process_s']:.1f}s)"
        ),
    )


if __name__ == "__main__":
    sys.exit(main())
