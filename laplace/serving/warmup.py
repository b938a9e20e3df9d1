"""Compile warmup: every decode width and prefill bucket of the serving engine, compiled ahead.

The graphs depend on the architecture and shapes, not on the weights (parameters are
graph inputs), so warmup compiles an untrained model of the same configuration and
needs only the tokenized data's vocabulary size: it can run before training. The
compile cache directory comes from the environment (TORCHINDUCTOR_CACHE_DIR on CPU/CUDA,
the Neuron NEFF cache on Trainium); the warmup stage runs this in fresh processes.

One compile, loaded everywhere: a graph is looked up in the cache by a key that holds more
than the graph. Inductor's FX graph cache key includes the intra-op thread count
(`parallel_num_threads()`: the generated C++ is specialised for it), so warmup, serve-check's
replays and `laplace serve` all call `apply_compile_settings` with the same `server.threads`,
and warmup writes what it compiled under beside the cache (`compile-settings.json`): a server
whose settings differ says so in one line instead of silently recompiling every graph.
Neuron's NEFF cache is keyed by the graph (HLO) hash, the neuronx-cc version and its flags
(NEURON_CC_FLAGS), not by threads: the same flags and compiler must be set where warmup and
serve run.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from laplace.config import Config

SETTINGS_FILE = "compile-settings.json"


def apply_compile_settings(threads: int) -> dict:
    """Set this process's settings that enter the compile cache key (the intra-op thread count:
    server.threads, 0 = torch's default) and return them, as recorded beside the cache."""
    import torch

    from laplace.runtime import set_threads

    set_threads(threads)
    return {"threads": torch.get_num_threads(), "torch": torch.__version__}


def record_compile_settings(cache_dir: Path, settings: dict) -> None:
    from laplace.fileio import atomic_write_json

    atomic_write_json(Path(cache_dir) / SETTINGS_FILE, settings)


def settings_mismatch(cache_dir: Path, settings: dict) -> str | None:
    """One line naming the settings this process compiles under that differ from those the cache
    at `cache_dir` was built under (None when they agree or the cache says nothing)."""
    path = Path(cache_dir) / SETTINGS_FILE
    if not path.is_file():
        return None
    built = json.loads(path.read_text())
    diff = [f"{k} {built[k]} there, {settings[k]} here" for k in settings if k in built and built[k] != settings[k]]
    if not diff:
        return None
    # the thread count is a knob (server.threads); a torch version is not
    fix = (
        f"--set server.threads={built['threads']} as warmup had it, or "
        if built.get("threads") != settings.get("threads")
        else ""
    )
    return (
        f"the compile cache {cache_dir} was built under other settings ({'; '.join(diff)}): "
        f"every graph will compile ({fix}rerun laplace warmup)"
    )


def compile_serving_graphs(cfg: Config, vocab_size: int) -> dict:
    """Build an untrained model of the configured architecture and run every decode width and
    prefill bucket of the padded engine once: with a compiler, that compiles them (into the
    compile cache directory of this process's environment). Returns seconds per graph."""
    started = time.perf_counter()
    import torch

    from laplace.model.lm import LaplaceLM, torch_dtype
    from laplace.runtime import compile_backend, resolve_device
    from laplace.serving.engine import DecodeEngine

    settings = apply_compile_settings(cfg.server.threads)  # as serve-check and laplace serve will run
    device = resolve_device(cfg.engine.device)
    model_cfg = cfg.model_config(vocab_size=vocab_size)
    torch.manual_seed(cfg.seed)
    model = LaplaceLM(model_cfg).to(device=device, dtype=torch_dtype(model_cfg.dtype))
    backend = compile_backend(device)
    engine = DecodeEngine(model, cfg.engine, "padded", backend=backend)
    # one line per graph as it compiles; the ahead-of-time packages a warm start loads are built here
    seconds = engine.runner.warmup(log=lambda line: print(line, flush=True), build_packages=True)
    cache_dir = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if cache_dir:
        record_compile_settings(Path(cache_dir), settings)
    total = sum(seconds["decode"].values()) + sum(seconds["prefill"].values())
    return {
        "backend": backend,
        "device": str(device),
        "graphs": len(seconds["decode"]) + len(seconds["prefill"]),
        "seconds": {
            "decode_s": {str(k): v for k, v in seconds["decode"].items()},
            "prefill_s": {str(k): v for k, v in seconds["prefill"].items()},
            "total_s": total,
        },
        "process_s": time.perf_counter() - started,
        "cache_dir": cache_dir,
        "settings": settings,
        "loaded_from_cache": engine.runner.warmup_report["loaded_from_cache"],
        "compiled": engine.runner.warmup_report["compiled"],
    }
