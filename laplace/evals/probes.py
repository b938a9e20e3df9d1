"""The probes: what a fixed state recalls and what it costs.

A GLA keeps a fixed-size recurrent state, so its history is compressed: "fits in memory"
is not "recalls accurately", and retrieval has to be measured per workload. `run_probes`
measures MQAR (evals.mqar) and passkey (evals.passkey) on an exported model and puts the
memory figures (evals.memory) next to them.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import numpy as np
import torch

from laplace.config import Config
from laplace.evals.memory import memory_report
from laplace.evals.mqar import mqar_both_paths, mqar_chance, train_mqar
from laplace.evals.passkey import passkey_probe
from laplace.evals.recall import DIGITS, niah_suite, overall_verdict, verdicts
from laplace.serving.engine import DecodeEngine

CONTEXT_ROOM = 64  # tokens a probe prompt may add to its context length (BOS, the question, the answer)


def _str_keys(obj):
    """JSON-friendly: dict keys as strings, all the way down."""
    if isinstance(obj, dict):
        return {str(k): _str_keys(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_str_keys(v) for v in obj]
    return obj


def trained_recall(model, cfg: Config, p, progress: bool) -> dict:
    """The recall suite's MQAR on the probe-trained GLA, through a serving engine at the padded
    ladder widths (eager: a second set of compiled graphs would cost more than it shows), at its
    easiest pair count per length: the suite is seen to measure something on a model that can recall."""
    params = dataclasses.replace(cfg.engine, max_prompt_tokens=2**62, prefix_cache_bytes=0)
    engine = DecodeEngine(model, params, "padded", compiled=False)
    q = min(p.mqar_pairs)
    both = mqar_both_paths(model, engine, p.mqar_contexts, [q], p.mqar_samples, p.seed + 2, progress)
    grid = {c: both["serving"].get(c, both["eager"][c])[q] for c in both["eager"]}
    chance = mqar_chance(model.cfg.vocab_size)
    by_length = verdicts({"mqar": grid}, {"mqar": chance}, {"mqar": p.mqar_samples * q})
    return {
        "recall_trained_mqar": grid,
        "recall_trained_mqar_verdict": by_length,
        "recall_trained_mqar_summary": overall_verdict(by_length),
    }


def recall_lengths(cfg: Config) -> list[int]:
    """The NIAH lengths: probes.recall_contexts plus the training length and four times it, so a
    fine-tune at 2,048 tokens is probed at 2,048 and 8,192 without retuning the knob. The shortest
    configured length is a floor (a shorter prompt may not hold the needles)."""
    floor = min(cfg.probes.recall_contexts, default=0)
    trained = (cfg.train.seq_len, 4 * cfg.train.seq_len)
    return sorted({*cfg.probes.recall_contexts, *(n for n in trained if n >= floor)})


def run_probes(cfg: Config, export_dir: Path, data_dir: Path, progress: bool = True) -> tuple[dict, dict]:
    """MQAR (serving vs eager) and passkey on the exported model, memory accounting, and MQAR on
    a GLA trained here. Returns (metrics, figures): `figures` holds what the plots are drawn from
    (`mqar`: the accuracy grid, `memory`: the memory report, `passkey`: one row per prompt).

    `passed` is true when the serving and eager MQAR paths agree (argmax agreement at least
    probes.paths_agree_min) and the measured state bytes equal the formula; retrieval quality
    is reported, not gated on."""
    from laplace.data.shards import open_split

    p = cfg.probes
    seconds: dict[str, float] = {}
    start = time.perf_counter()
    engine, tokenizer, export_config = _warm_engine(cfg, export_dir)
    model = engine.model
    bos_id = export_config.get("bos_id")  # the model's own convention: Llama tokenizers start with <s>
    seconds["load_and_warmup"] = time.perf_counter() - start
    fits = FittingLengths(engine.cache.max_context)
    haystack = np.asarray(open_split(data_dir, "val"))
    mqar, passkey, niah, memory = _served_probes(engine, tokenizer, haystack, cfg, fits, bos_id, seconds, progress)
    if engine.cache.pool.owners:
        raise RuntimeError(f"probe slots still owned after the probes: {engine.cache.pool.owners}")

    metrics: dict = {
        **mqar["metrics"],
        "passkey_accuracy": passkey["accuracy"],
        "passkey_accuracy_by_depth": passkey["accuracy_by_depth"],
        "passkey_accuracy_overall": passkey["accuracy_overall"],
        **{k: v for k, v in memory.items() if not k.endswith("config")},
        "state_bytes_match": memory["state_bytes_measured"] == memory["state_bytes_analytic"],
        "kv_bytes_match": memory["kv_bytes_measured"] == memory["kv_bytes_analytic"],
        "notes": list(mqar["notes"]),
    }
    if fits.skipped:
        metrics["contexts_over_max_context"] = sorted(fits.skipped)
        metrics["notes"].append(
            f"lengths {sorted(fits.skipped)} not probed: with {CONTEXT_ROOM} tokens to answer in, longer than "
            f"engine.max_context={engine.cache.max_context} "
            "(the attention layers' K/V cache)"
        )
    if p.train_mqar:
        mqar_figure = _trained_mqar(model, cfg, progress, seconds, metrics)
    else:  # the accuracy plot is still drawn, for the exported model
        metrics["notes"].append("probes.train_mqar is false: the MQAR plot shows the exported model")
        mqar_figure = {"accuracy": mqar["best_path"], "chance": metrics["mqar_chance"]}
    metrics.update(_recall_suite(cfg, niah, passkey, metrics))
    metrics["passed"] = bool(mqar["paths_agree"] and metrics["state_bytes_match"] and metrics["kv_bytes_match"])
    seconds["total"] = time.perf_counter() - start
    metrics["seconds"] = seconds
    figures = {"mqar": mqar_figure, "memory": memory, "passkey": passkey["table"]}
    return _str_keys(metrics), figures


class FittingLengths:
    """The probe lengths a model's slots hold: all for a GLA, those within engine.max_context (with
    CONTEXT_ROOM to answer in) for a model with attention layers; the others are kept in `skipped`."""

    def __init__(self, max_context: int | None):
        self.max_context = max_context
        self.skipped: set[int] = set()

    def __call__(self, contexts: list[int]) -> list[int]:
        limit = self.max_context
        kept = [c for c in contexts if limit is None or c + CONTEXT_ROOM <= limit]
        self.skipped.update(set(contexts) - set(kept))
        return kept


def _timed(seconds: dict[str, float], name: str, probe):
    """probe(), its wall time recorded in seconds[name]."""
    start = time.perf_counter()
    out = probe()
    seconds[name] = time.perf_counter() - start
    return out


def _warm_engine(cfg: Config, export_dir: Path):
    """The exported model's padded engine, warmed up: (engine, tokenizer, export config). Pad rows
    read and write the dummy slot: NaN there makes any leak into a real row visible."""
    from laplace.runtime import resolve_device

    device = resolve_device(cfg.engine.device)
    engine, tokenizer, export_config = DecodeEngine.from_export(
        export_dir, cfg.engine, "padded", device=device, kernel=cfg.model.kernel
    )
    engine.runner.warmup()
    dummy = engine.cache.dummy
    for tensor in engine.cache.state.tensors().values():
        if tensor.is_floating_point():  # recurrent, conv and a hybrid's K/V (positions are counters)
            tensor[:, dummy] = float("nan")
    return engine, tokenizer, export_config


def _served_probes(
    engine: DecodeEngine, tokenizer, haystack, cfg: Config, fits: FittingLengths, bos_id, seconds, progress
):
    """The probes of the exported model through its warmed-up engine, each timed in `seconds`:
    MQAR (serving vs eager), passkey, the NIAH tasks and the memory report."""
    p, model = cfg.probes, engine.model
    with torch.compiler.set_stance("fail_on_recompile"):  # serving runs the warmed-up graphs only
        mqar = _timed(seconds, "mqar_exported", lambda: _exported_mqar(model, engine, p, fits, progress))
        passkey = _timed(
            seconds,
            "passkey",
            lambda: passkey_probe(
                engine,
                tokenizer,
                haystack,
                fits(p.passkey_contexts),
                p.passkey_depths,
                p.passkey_samples,
                p.seed,
                progress=progress,
                bos_id=bos_id,
            ),
        )
        lengths = fits(recall_lengths(cfg))
        niah = _timed(
            seconds, "niah", lambda: niah_suite(engine, tokenizer, haystack, lengths, p.recall_samples, p.seed, bos_id)
        )
        text = haystack[: max(p.memory_contexts, default=0)]
        memory = _timed(
            seconds,
            "memory",
            lambda: memory_report(model, engine, fits(p.memory_contexts), p.kv_contexts, text=text, progress=progress),
        )
    return mqar, passkey, niah, memory


def _exported_mqar(model, engine: DecodeEngine, p, fits: FittingLengths, progress: bool) -> dict:
    """MQAR on the exported model through the serving path and the eager forward, at the easiest
    pair count only (it is a text model: if it cannot recall 4 pairs it cannot recall 16; decoding
    every context token one step at a time is the costly part; the trained MQAR model covers the
    whole (context, pairs) grid): its metrics, whether the paths agree, the accuracy grid (serving
    where it ran) and the notes."""
    q = min(p.mqar_pairs)
    mqar = mqar_both_paths(model, engine, fits(p.mqar_contexts), [q], p.mqar_samples, p.seed, progress)
    served_cells = [(c, k) for c in mqar["serving"] for k in mqar["serving"][c]]
    max_gap = max((abs(mqar["serving"][c][k] - mqar["eager"][c][k]) for c, k in served_cells), default=0.0)
    paths_agree = bool(served_cells) and mqar["agreement"] >= p.paths_agree_min and max_gap <= 1 - p.paths_agree_min
    best_path = {c: mqar["serving"].get(c, grid) for c, grid in mqar["eager"].items()}  # serving where it ran
    metrics = {
        "mqar_accuracy": {c: grid[q] for c, grid in best_path.items()},
        "mqar_accuracy_eager": {c: grid[q] for c, grid in mqar["eager"].items()},
        "mqar_exported_pairs": q,
        "mqar_chance": mqar_chance(model.cfg.vocab_size),
        "mqar_serving_vs_eager_agreement": mqar["agreement"],
        "mqar_positions_compared": mqar["positions_compared"],
        "mqar_paths_agree": paths_agree,
    }
    return {"metrics": metrics, "paths_agree": paths_agree, "best_path": best_path, "notes": mqar["notes"]}


def _trained_mqar(model, cfg: Config, progress: bool, seconds: dict[str, float], metrics: dict) -> dict:
    """MQAR on a GLA trained here (the exported model's architecture), then the recall suite's MQAR
    on it through a serving engine: their figures added to `metrics`; returns the plot's figure."""
    p = cfg.probes
    trained = _timed(seconds, "mqar_train_and_eval", lambda: train_mqar(p, p.seed, progress=progress, like=model.cfg))
    recall = _timed(
        seconds, "mqar_trained_recall", lambda: trained_recall(trained.pop("trained_model"), cfg, p, progress)
    )
    metrics.update(recall)
    metrics.update(
        {
            "mqar_trained_accuracy": trained["accuracy"],
            "mqar_trained_chance": trained["chance"],
            "mqar_trained_state_floats": trained["state_floats"],
            "mqar_trained_state_bytes": trained["state_bytes"],
            "mqar_trained_train_seconds": trained["train_seconds"],
            "mqar_trained_final_loss": trained["final_loss"],
        }
    )
    return trained


def _recall_suite(cfg: Config, niah: dict, passkey: dict, metrics: dict) -> dict:
    """The recall suite: every task at every probed length, against chance, with a plain verdict per length."""
    p = cfg.probes
    recall = {**niah, "passkey": passkey["accuracy"], "mqar": metrics["mqar_accuracy"]}
    chance = {**{task: 10.0**-DIGITS for task in niah}, "passkey": 1e-5, "mqar": metrics["mqar_chance"]}
    samples = {
        **{task: p.recall_samples for task in niah},
        "passkey": p.passkey_samples * len(p.passkey_depths),
        "mqar": p.mqar_samples * min(p.mqar_pairs),
    }
    by_length = verdicts(recall, chance, samples)
    return {
        "recall": recall,
        "recall_training_length": cfg.train.seq_len,
        "recall_chance": chance,
        "recall_verdict": by_length,
        "recall_summary": overall_verdict(by_length),
    }
