"""One function per pipeline stage: (config, paths) -> metrics dict.

This is the one place that knows the file layout. Every front door calls these
functions: the CLI (`laplace <stage>`), dvc.yaml (whose `cmd`s are the CLI) and the
Prefect flow (one task per stage, each running `dvc repro --single-item <stage>`).
Adding a stage = one function registered in STAGES, one dvc.yaml entry; the flow
and the CLI pick it up from here.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from laplace import checkpoint as ckpt
from laplace.config import Config
from laplace.data import tokenize_corpus
from laplace.export import export_model, load_export
from laplace.fileio import atomic_write_json
from laplace.generation import generate_ids
from laplace.train import train


@dataclass(frozen=True)
class Paths:
    root: Path

    @classmethod
    def at(cls, root: str | Path = ".") -> "Paths":
        return cls(Path(root).resolve())

    @property
    def data_dir(self) -> Path:
        return self.root / "data" / "tokenized"

    @property
    def run_dir(self) -> Path:
        return self.root / "runs" / "train"

    @property
    def checkpoints(self) -> Path:
        return self.run_dir / "checkpoints"

    @property
    def export_dir(self) -> Path:
        return self.root / "artifacts" / "export"

    @property
    def metrics_dir(self) -> Path:
        return self.root / "metrics"

    @property
    def plots_dir(self) -> Path:
        return self.root / "plots"

    def metrics_file(self, stage: str) -> Path:
        return self.metrics_dir / f"{stage}.json"

    @property
    def warmup_cache(self) -> Path:
        return self.root / "artifacts" / "warmup" / "compile-cache"

    @property
    def tracking_file(self) -> Path:
        return self.root / "artifacts" / "tracking.json"


def write_metrics(paths: Paths, stage: str, metrics: dict) -> dict:
    atomic_write_json(paths.metrics_file(stage), metrics)
    return metrics


def tokenize(cfg: Config, paths: Paths) -> dict:
    metrics = tokenize_corpus(cfg.data, cfg.tokenizer, paths.data_dir, cfg.seed)
    return write_metrics(paths, "tokenize", metrics)


def warmup(cfg: Config, paths: Paths) -> dict:
    """Compile every serving graph into the compile cache artifact; cold and warm timings."""
    import tempfile

    from laplace.data import read_manifest
    from laplace.warmup import warmup_stage

    vocab = read_manifest(paths.data_dir)["vocab_size"]
    with tempfile.TemporaryDirectory(prefix="laplace-warmup-") as scratch:
        metrics = warmup_stage(cfg, paths.warmup_cache, vocab, Path(scratch))
    return write_metrics(paths, "warmup", metrics)


def serve_check(cfg: Config, paths: Paths) -> dict:
    """Replay the workloads under the exact, padded and eager policies; fail on a missed gate."""
    import tempfile

    from laplace import plots
    from laplace.servecheck import GateFailed, serve_check_stage

    with tempfile.TemporaryDirectory(prefix="laplace-serve-") as scratch:
        metrics, traces = serve_check_stage(cfg, paths.export_dir, paths.data_dir, paths.warmup_cache,
                                            Path(scratch), paths.plots_dir)
    workload = metrics["headline_workload"]
    plots.latency_cdfs(traces, workload, paths.plots_dir / "serve_latency_cdf.png")
    plots.step_timeline(traces, workload, paths.plots_dir / "serve_timeline.png")
    plots.width_histogram(traces, workload, paths.plots_dir / "serve_widths.png")
    write_metrics(paths, "serve", metrics)
    if not metrics["passed"]:
        missed = ", ".join(k for k, ok in metrics["gates"].items() if not ok)
        raise GateFailed(f"serve-check gates missed: {missed} (see {paths.metrics_file('serve')})")
    return metrics


def numerics(cfg: Config, paths: Paths) -> dict:
    """Compiled vs eager vs fp64 on prefill, decode widths and a training step; fail on a missed gate."""
    import sys

    from laplace.numerics import GateFailed, numerics_stage

    metrics = numerics_stage(cfg, paths.export_dir, paths.data_dir, paths.warmup_cache)
    write_metrics(paths, "numerics", metrics)
    if not metrics["passed"]:
        print(metrics["gate_table"], file=sys.stderr)
        missed = [k for k, g in metrics["gates"].items() if not g["passed"]]
        raise GateFailed(f"{len(missed)} numerics gate(s) missed: {'; '.join(missed)} "
                         f"(table above, figures in {paths.metrics_file('numerics')})")
    return metrics


def probes(cfg: Config, paths: Paths) -> dict:
    """MQAR and passkey retrieval, state vs KV memory; reports retrieval, gates only path agreement."""
    from laplace.probes import probes_stage

    metrics = probes_stage(cfg, paths.export_dir, paths.data_dir, paths.warmup_cache, paths.plots_dir)
    return write_metrics(paths, "probes", metrics)


def run_training(cfg: Config, paths: Paths, resume: bool = True, stop_at_step: int | None = None):
    """Train in this process, or under torchrun when train.nproc_per_node / nnodes ask for more ranks.
    Returns (metrics, history, checkpoint path)."""
    from laplace import distributed

    if not distributed.needs_torchrun(cfg.train):
        result = train(cfg, paths.data_dir, paths.run_dir, resume=resume, stop_at_step=stop_at_step)
        return result.metrics, result.history, result.checkpoint
    import tempfile

    from laplace.repro import subprocess_env
    from laplace.worker import run_worker

    args = ["--data-dir", str(paths.data_dir), "--run-dir", str(paths.run_dir)] + \
        (["--no-resume"] if not resume else []) + (["--stop-at-step", str(stop_at_step)] if stop_at_step else [])
    with tempfile.TemporaryDirectory(prefix="laplace-train-") as tmp:
        result = run_worker("laplace.train", cfg, args, subprocess_env(), paths.root, Path(tmp) / "result.json",
                            launcher=distributed.torchrun_launcher(cfg.train))
    return result["metrics"], result["history"], Path(result["checkpoint"]) if result["checkpoint"] else None


def train_stage(cfg: Config, paths: Paths, resume: bool = True) -> dict:
    from laplace.plots import training_curve, write_rows  # matplotlib: only when plotting

    metrics, history, checkpoint = run_training(cfg, paths, resume=resume)
    metrics = dict(metrics)
    metrics["checkpoint"] = str(checkpoint.relative_to(paths.root)) if checkpoint else None
    write_rows(paths.plots_dir / "train_loss.json",
               [{"step": h["step"], "loss": h["loss"], "tokens_per_s": h.get("tokens_per_s")}
                for h in history if "loss" in h])
    write_rows(paths.plots_dir / "val_loss.json",
               [{"step": h["step"], "val_loss": h["val_loss"]} for h in history if "val_loss" in h])
    training_curve(history, paths.plots_dir / "train_curve.png")
    write_metrics(paths, "train", metrics)
    return metrics


def export(cfg: Config, paths: Paths) -> dict:
    found = ckpt.latest_checkpoint(paths.checkpoints)
    if found is None:
        raise FileNotFoundError(f"no complete checkpoint under {paths.checkpoints}: run the train stage first")
    if found.step < cfg.train.steps:
        raise RuntimeError(
            f"latest checkpoint is step {found.step} of {cfg.train.steps}: training has not finished, refusing to export"
        )
    summary = export_model(found, paths.data_dir / "tokenizer.json", paths.export_dir)
    summary["export_dir"] = str(paths.export_dir.relative_to(paths.root))
    return write_metrics(paths, "export", summary)


def sample_text(cfg: Config, paths: Paths, prompt: str | None = None) -> dict:
    """Generate from the exported model with the `generate:` knobs."""
    g = cfg.generate
    return generate_text(paths.export_dir, prompt if prompt is not None else g.prompt,
                         g.max_new_tokens, g.temperature, g.top_p, g.seed)


def generate_text(model_dir: Path, prompt: str, max_new_tokens: int, temperature: float, top_p: float,
                  seed: int) -> dict:
    model, tokenizer, config = load_export(model_dir)
    prompt_ids = tokenizer.encode(prompt).ids
    start = time.perf_counter()
    with torch.inference_mode():
        ids = generate_ids(model, prompt_ids, max_new_tokens, temperature, top_p, seed,
                           stop_ids=(config["eos_id"],) if config.get("eos_id") is not None else ())
    seconds = time.perf_counter() - start
    return {"prompt": prompt, "completion": tokenizer.decode(ids), "new_tokens": len(ids),
            "tokens_per_s": len(ids) / max(seconds, 1e-9)}


def track(cfg: Config, paths: Paths) -> dict:
    """Log this pipeline run to MLflow (one run holding every stage) and register the model."""
    from laplace import tracking

    metrics_by_stage = {}
    for stage in STAGES.values():
        data = tracking.read_json(paths.metrics_file(stage.metrics)) if stage.metrics else None
        if isinstance(data, dict):
            metrics_by_stage[stage.metrics] = data
    train_rows = tracking.read_json(paths.plots_dir / "train_loss.json") or []
    val_rows = tracking.read_json(paths.plots_dir / "val_loss.json") or []
    step_series = {
        "train/loss": [(r["step"], r["loss"]) for r in train_rows],
        "train/tokens_per_s_window": [(r["step"], r["tokens_per_s"]) for r in train_rows if r.get("tokens_per_s")],
        "train/val_loss_curve": [(r["step"], r["val_loss"]) for r in val_rows],
    }
    git = tracking.git_info(paths.root)
    data_hash = tracking.dvc_out_hash(paths.root, "data/tokenized")
    manifest = tracking.read_json(paths.data_dir / "manifest.json") or {}
    launcher = os.environ.get("LAPLACE_LAUNCHER") or ("dvc" if os.environ.get("DVC_STAGE") else "cli")
    tags = {
        "git_commit": git["commit"],
        "git_dirty": str(git["dirty"]).lower(),
        "dvc_data_hash": data_hash or "unavailable (not run through dvc)",
        "launcher": launcher,
        "preset": cfg.model.preset,
        "tokenizer_sha256": manifest.get("tokenizer_sha256", ""),
    }
    for env, tag in (("DVC_EXP_NAME", "dvc_experiment"), ("LAPLACE_PREFECT_FLOW_RUN_ID", "prefect_flow_run_id")):
        if os.environ.get(env):
            tags[tag] = os.environ[env]
    summary = tracking.log_pipeline_run(
        root=paths.root,
        params=cfg.flat(),
        params_hash=cfg.digest(),
        experiment=cfg.tracking.experiment,
        model_name=cfg.tracking.model_name,
        register=cfg.tracking.register,
        metrics_by_stage=metrics_by_stage,
        step_series=step_series,
        plots_dir=paths.plots_dir,
        tokenizer_path=paths.data_dir / "tokenizer.json",
        export_dir=paths.export_dir,
        dataset_path=paths.data_dir,
        dataset_digest=data_hash or manifest.get("files", {}).get("train.bin", {}).get("sha256"),
        run_name=f"{cfg.model.preset}-{time.strftime('%Y%m%d-%H%M%S')}",
        tags=tags,
    )
    atomic_write_json(paths.tracking_file, summary)
    return summary


# --------------------------------------------------------------------------- registry


@dataclass(frozen=True)
class Stage:
    name: str  # the CLI command and dvc.yaml stage
    run: Callable[[Config, Paths], dict]
    metrics: str | None  # metrics/<metrics>.json, None for the tracking stage
    help: str


STAGES: dict[str, Stage] = {
    s.name: s
    for s in (
        Stage("tokenize", tokenize, "tokenize", "tokenize the corpus into packed shards"),
        Stage("warmup", warmup, "warmup", "compile every decode width and prefill bucket into a cache artifact"),
        Stage("train", train_stage, "train", "train (resumes from the last complete checkpoint)"),
        Stage("export", export, "export", "export the final checkpoint"),
        Stage("serve-check", serve_check, "serve", "replay workloads: exact vs padded vs eager serving"),
        Stage("numerics", numerics, "numerics", "compiled vs eager vs fp64 on prefill, decode and a training step"),
        Stage("probes", probes, "probes", "MQAR and passkey retrieval, state vs KV-cache memory"),
        Stage("track", track, None, "log the pipeline run to MLflow and register the model"),
    )
}
PIPELINE: tuple[str, ...] = tuple(STAGES)


def summary(paths: Paths) -> dict:
    """Headline figures of the last pipeline run, from the metrics on disk."""
    def read(name):
        p = paths.metrics_file(name)
        return json.loads(p.read_text()) if p.exists() else {}

    info = {stage.metrics: read(stage.metrics) for stage in STAGES.values() if stage.metrics}
    info["tracking"] = json.loads(paths.tracking_file.read_text()) if paths.tracking_file.exists() else {}
    return info
