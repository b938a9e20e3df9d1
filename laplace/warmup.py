"""The warmup stage: compile every decode width and prefill bucket ahead of serving.

Compilation runs in fresh worker processes (a compile cache is per process state
plus a directory): the first with an empty cache directory (cold: what a new
deployment pays), the second reusing it (warm: what serve-check pays when it starts
from this stage's artifact). On CPU the artifact is the whole Inductor cache
directory (loading torch.compiler cache artifacts alone does not skip the C++
builds); on Trainium the same directory is handed to Neuron as its NEFF cache.

The graphs depend on the architecture and shapes, not on the weights (parameters
are graph inputs), so warmup compiles an untrained model of the same configuration
and needs only the tokenized data's vocabulary size: it runs before training.
"""

from __future__ import annotations

import os
import shutil
import sys
import time
from pathlib import Path

from laplace.config import Config
from laplace.worker import compile_env, run_worker, worker_main

def dir_size(path: Path) -> tuple[int, int]:
    files = [p for p in Path(path).rglob("*") if p.is_file()]
    return len(files), sum(p.stat().st_size for p in files)


def warmup_stage(cfg: Config, cache_dir: Path, vocab_size: int, scratch: Path) -> dict:
    """Cold compile into a fresh `cache_dir`, then a warm start from it, each in a fresh process."""
    shutil.rmtree(cache_dir, ignore_errors=True)
    cache_dir.mkdir(parents=True)
    scratch.mkdir(parents=True, exist_ok=True)
    env = compile_env(cache_dir)
    args = ["--vocab-size", str(vocab_size)]
    cold = run_worker("laplace.warmup", cfg, args, env, Path.cwd(), scratch / "warmup-cold.json")
    warm = run_worker("laplace.warmup", cfg, args, env, Path.cwd(), scratch / "warmup-warm.json")
    files, size = dir_size(cache_dir)
    return {
        "backend": cold["backend"],
        "compile_scope": cfg.serve.compile_scope,
        "device": cold["device"],
        "graphs": cold["graphs"],
        "cold": cold["seconds"],
        "warm": warm["seconds"],
        "compile_seconds_total": cold["seconds"]["total_s"],
        "warm_start_seconds_total": warm["seconds"]["total_s"],
        "warm_speedup": cold["seconds"]["total_s"] / max(warm["seconds"]["total_s"], 1e-9),
        "cold_process_s": cold["process_s"],
        "warm_process_s": warm["process_s"],
        "cache_files": files,
        "cache_bytes": size,
    }


# --------------------------------------------------------------------------- worker process


def _worker(cfg: Config, vocab_size: int) -> dict:
    started = time.perf_counter()
    import torch

    from laplace.model.lm import LaplaceLM, torch_dtype
    from laplace.runtime import compile_backend, configure_compiler, resolve_device
    from laplace.serve import DecodeEngine

    device = resolve_device(cfg.serve.device)
    model_cfg = cfg.model_config(vocab_size=vocab_size)
    torch.manual_seed(cfg.seed)
    model = LaplaceLM(model_cfg).to(device=device, dtype=torch_dtype(model_cfg.dtype))
    backend = compile_backend(device)
    engine = DecodeEngine.for_policy(model, cfg.serve, "padded", backend)
    configure_compiler(engine.graphs_needed())
    seconds = engine.warmup()
    total = sum(seconds["decode"].values()) + sum(seconds["prefill"].values())
    return {
        "backend": backend,
        "device": str(device),
        "graphs": len(seconds["decode"]) + len(seconds["prefill"]),
        "seconds": {"decode_s": {str(k): v for k, v in seconds["decode"].items()},
                    "prefill_s": {str(k): v for k, v in seconds["prefill"].items()},
                    "total_s": total},
        "process_s": time.perf_counter() - started,
        "cache_dir": os.environ.get("TORCHINDUCTOR_CACHE_DIR"),
    }


def main(argv: list[str] | None = None) -> int:
    return worker_main(
        "warmup worker: compile every serving graph once", lambda cfg, args: _worker(cfg, args.vocab_size), argv,
        options={"vocab-size": {"type": int}},
        summary=lambda r: f"compiled {r['graphs']} graphs in {r['seconds']['total_s']:.1f}s "
                          f"(process {r['process_s']:.1f}s)",
    )


if __name__ == "__main__":
    sys.exit(main())
