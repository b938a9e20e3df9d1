"""Compile warmup: every decode width and prefill bucket of the serving engine, compiled ahead.

The graphs depend on the architecture and shapes, not on the weights (parameters are
graph inputs), so warmup compiles an untrained model of the same configuration and
needs only the tokenized data's vocabulary size: it can run before training. The
compile cache directory comes from the environment (TORCHINDUCTOR_CACHE_DIR on CPU/CUDA,
the Neuron NEFF cache on Trainium); the warmup stage runs this in fresh processes.
"""

from __future__ import annotations

import os
import time

from laplace.config import Config


def compile_serving_graphs(cfg: Config, vocab_size: int) -> dict:
    """Build an untrained model of the configured architecture and run every decode width and
    prefill bucket of the padded engine once: with a compiler, that compiles them (into the
    compile cache directory of this process's environment). Returns seconds per graph."""
    started = time.perf_counter()
    import torch

    from laplace.model.lm import LaplaceLM, torch_dtype
    from laplace.runtime import compile_backend, configure_compiler, resolve_device
    from laplace.serving.engine import DecodeEngine

    device = resolve_device(cfg.engine.device)
    model_cfg = cfg.model_config(vocab_size=vocab_size)
    torch.manual_seed(cfg.seed)
    model = LaplaceLM(model_cfg).to(device=device, dtype=torch_dtype(model_cfg.dtype))
    backend = compile_backend(device)
    engine = DecodeEngine.for_policy(model, cfg.engine, "padded", backend)
    configure_compiler(engine.graphs_needed())
    seconds = engine.warmup(log=lambda line: print(line, flush=True))  # one line per graph as it compiles
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
        "cache_dir": os.environ.get("TORCHINDUCTOR_CACHE_DIR"),
    }
