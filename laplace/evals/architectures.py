"""What an architecture costs to serve, measured through the serving engine: the figures the
comparison (laplace compare) puts beside quality and recall, the same code for every arm.

- bytes per sequence: the engine's own allocations for one slot (the GLA layers' recurrent and
  conv state, the attention layers' K/V cache sized for the context; the 8-byte position counter
  of each row apart), at each of
  compare.memory_contexts, beside the formula (laplace.model.lm.sequence_bytes);
- decode time per token after a prompt of each of compare.decode_contexts: one engine per length,
  each holding one sequence prefilled to that length, timed in alternation so machine load hits
  every length alike. Eager: a compiled decode graph per context length would cost more compile
  time than the whole measurement, and the trend with context is the same;
- serving: the serve-check workload replayed through the padded, compiled engine as `laplace
  serve` runs it (output tokens/s, TTFT, compile events while serving);
- RULER through lm-evaluation-harness (compare.lm_eval_tasks): a task that needs data or a
  package that cannot be had offline is reported as not run, with the reason.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import numpy as np
import torch

from laplace.config import Config


def _engine(export_dir: Path, cfg: Config, context: int, compiled: bool, device):
    """A one-sequence engine whose slots hold `context` tokens."""
    from laplace.serving.engine import DecodeEngine

    params = dataclasses.replace(
        cfg.engine, max_slots=1, widths=[], max_context=context, max_prompt_tokens=context, prefix_cache_bytes=0
    )
    engine, _, _ = DecodeEngine.from_export(
        export_dir, params, "padded", device=device, kernel=cfg.model.kernel, compiled=compiled
    )
    return engine


def bytes_per_sequence(cfg: Config, export_dir: Path, contexts: list[int], device) -> dict:
    """{context: bytes} the engine allocates for one slot, and the formula's, at each context."""
    from laplace.model.lm import sequence_bytes

    measured, formula, kv = {}, {}, {}
    for context in contexts:
        engine = _engine(export_dir, cfg, context, compiled=False, device=device)
        # the engine's slot tensors (recurrent and conv state, the attention K/V), measured, per row
        a = engine.cache.allocation()
        rows = engine.cache.max_slots + 1  # the dummy pad row is allocated too
        measured[str(context)] = (a["state_bytes"] + a["kv_bytes"]) // rows
        kv[str(context)] = a["kv_bytes"] // rows
        formula[str(context)] = sequence_bytes(engine.model.cfg, context)["total_bytes"]
        del engine
    return {"bytes_per_sequence": measured, "bytes_per_sequence_formula": formula, "kv_bytes_per_sequence": kv}


def decode_time(cfg: Config, export_dir: Path, contexts: list[int], steps: int, text, device) -> dict:
    """Milliseconds per decoded token after a prompt of each context length (one engine each, timed
    in alternation by generation.decode_step_times): the fastest of the timed steps, as timeit
    reports, because on a shared machine preemption only ever adds time (a median of 12 steps at
    load 3 on 2 cores swung the softmax ratio from 1.0x to 3.4x)."""
    import contextlib

    from laplace.serving.generation import decode_step_times

    with contextlib.ExitStack() as leases:
        engines = {c: _engine(export_dir, cfg, c + steps + 8, compiled=False, device=device) for c in contexts}
        sequences = {}
        for context, engine in engines.items():
            (slot,) = leases.enter_context(engine.cache.leased([-1]))
            sequences[context] = (engine.runner, slot, np.resize(np.asarray(text, dtype=np.int64), context))
        times = decode_step_times(sequences, steps)
    ms = {str(c): 1e3 * min(t) for c, t in times.items()}
    lo, hi = str(min(contexts)), str(max(contexts))
    return {"decode_ms_per_token": ms, "decode_ratio_longest_vs_shortest": ms[hi] / ms[lo]}


def serving_figures(cfg: Config, export_dir: Path, data_dir: Path) -> dict:
    """The serve-check workload (serve_check.workloads[0]) through the padded, compiled engine."""
    from laplace.data.shards import open_split
    from laplace.runtime import resolve_device
    from laplace.serving.engine import DecodeEngine
    from laplace.serving.replay import replay, summarize
    from laplace.serving.warmup import apply_compile_settings
    from laplace.serving.workload import build_requests

    apply_compile_settings(cfg.server.threads)
    device = resolve_device(cfg.engine.device)
    engine, _, _ = DecodeEngine.from_export(export_dir, cfg.engine, "padded", device=device, kernel=cfg.model.kernel)
    start = time.perf_counter()
    engine.runner.warmup()
    warm_s = time.perf_counter() - start
    kind = cfg.serve_check.workloads[0]
    requests = build_requests(kind, cfg.serve_check, open_split(data_dir, "val"), cfg.serve_check.seed)
    with torch.compiler.set_stance("fail_on_recompile"):  # serving runs the warmed graphs only
        done = replay(engine, requests)
    figures = summarize(engine.scheduler.steps, done, cfg.serve_check.slo_ttft_s, cfg.serve_check.slo_tpot_s)
    return {"workload": kind, "warmup_s": warm_s, **figures}


def ruler_figures(cfg: Config, export_dir: Path) -> dict:
    """RULER tasks of lm-evaluation-harness through the engine, lm_eval_limit samples per task and
    length (laplace.evals.ruler), each in a child process, or the reason each did not run."""
    import importlib.util

    from laplace.evals.ruler import run_tasks

    c = cfg.compare
    if importlib.util.find_spec("lm_eval") is None:
        why = "lm-eval is not installed (pip install 'laplace[eval]')"
        return {task: {"run": False, "reason": why} for task in c.lm_eval_tasks}
    lengths = list(c.lm_eval_lengths)
    return run_tasks(export_dir, list(c.lm_eval_tasks), lengths, c.lm_eval_limit, c.lm_eval_timeout_s)


def architecture_figures(cfg: Config, export_dir: Path, data_dir: Path) -> dict:
    """Every figure of one arm that the pipeline's own stages do not already measure."""
    from laplace.data.shards import open_split
    from laplace.model.config import ModelConfig, architecture_family
    from laplace.model.export import read_export_config
    from laplace.runtime import resolve_device

    c = cfg.compare
    device = resolve_device(cfg.engine.device)
    model_cfg = ModelConfig(**read_export_config(Path(export_dir))["model"])
    text = np.asarray(open_split(data_dir, "val")[: max(c.decode_contexts)])
    seconds = {}
    out: dict = {
        "family": architecture_family(model_cfg),
        "attn_layers": list(model_cfg.attn_layers),
        "layers": model_cfg.n_layers,
    }
    for name, measure in (
        ("memory", lambda: bytes_per_sequence(cfg, export_dir, c.memory_contexts, device)),
        ("decode", lambda: decode_time(cfg, export_dir, c.decode_contexts, c.decode_timing_steps, text, device)),
        ("serving", lambda: {"serving": serving_figures(cfg, export_dir, data_dir)}),
        ("ruler", lambda: {"ruler": ruler_figures(cfg, export_dir)} if c.lm_eval_tasks else {}),
    ):
        start = time.perf_counter()
        out.update(measure())
        seconds[name] = round(time.perf_counter() - start, 3)
    out["bytes_match_formula"] = out["bytes_per_sequence"] == out["bytes_per_sequence_formula"]
    out["seconds"] = seconds
    return out
