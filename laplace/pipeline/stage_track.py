"""The track stage: write the headline figures for DVC (metrics.json), then log this pipeline run
to MLflow (one run holding every stage) and register the model; it reads only what the other
stages wrote to disk.

Processes: all of it runs in the `laplace track` process (MLflow's client; the model is logged
from code, so nothing here is pickled for another process)."""

from __future__ import annotations

import os
import time

from laplace.config import Config
from laplace.data.shards import split_digest
from laplace.fileio import atomic_write_json
from laplace.pipeline.layout import Paths
from laplace.tracking.headline import headline
from laplace.tracking.provenance import dvc_out_hash, git_info
from laplace.tracking.runs import log_pipeline_run, read_json


def run(cfg: Config, paths: Paths, stages: tuple[str, ...]) -> dict:
    """Write metrics.json, log this pipeline run to MLflow (one run holding every stage) and
    register the model. `stages`: the stages whose figures to gather (the registry passes all)."""
    started = time.time()
    metrics_by_stage = {}
    for stage in stages:
        data = read_json(paths.metrics_file(stage))
        if isinstance(data, dict):
            metrics_by_stage[stage] = data
    # first, so DVC's comparisons work even while the tracking server is down
    atomic_write_json(paths.headline_file, headline(metrics_by_stage))
    train_rows = read_json(paths.plots_dir / "train_loss.json") or []
    val_rows = read_json(paths.plots_dir / "val_loss.json") or []
    step_series = {
        "train_loss": [(r["step"], r["loss"]) for r in train_rows],
        "eval_loss": [(r["step"], r["val_loss"]) for r in val_rows],
    }
    git = git_info(paths.root)
    data_hash = dvc_out_hash(paths.root, "data/tokenized")
    manifest = read_json(paths.data_dir / "manifest.json") or {}
    launcher = os.environ.get("LAPLACE_LAUNCHER") or ("dvc" if os.environ.get("DVC_STAGE") else "cli")
    t = cfg.train
    tags = {
        "git_commit": git["commit"],
        "git_dirty": str(git["dirty"]).lower(),
        "dvc_data_hash": data_hash or "unavailable (not run through dvc)",
        "launcher": launcher,
        "preset": cfg.model.preset,
        # what the validation loss was measured on (champion.COMPARABLE_TAGS)
        "tokenizer_sha256": manifest.get("tokenizer_sha256", ""),
        "val_split_sha256": split_digest(manifest, "val"),
        "val_windows": f"{t.eval_batches} batches x {t.batch_size} x {t.seq_len} tokens, {t.precision}",
    }
    for env, tag in (("DVC_EXP_NAME", "dvc_experiment"), ("LAPLACE_PREFECT_FLOW_RUN_ID", "prefect_flow_run_id")):
        if os.environ.get(env):
            tags[tag] = os.environ[env]
    summary = log_pipeline_run(
        cfg,
        root=paths.root,
        metrics_by_stage=metrics_by_stage,
        step_series=step_series,
        plots_dir=paths.plots_dir,
        metrics_dir=paths.metrics_dir,
        tokenizer_path=paths.data_dir / "tokenizer.json",
        export_dir=paths.export_dir,
        dataset_path=paths.data_dir,
        dataset_digest=data_hash or split_digest(manifest, "train") or None,
        run_name=f"{cfg.model.preset}-{time.strftime('%Y%m%d-%H%M%S')}",
        tags=tags,
        track_started=started,
    )
    atomic_write_json(paths.tracking_file, summary)
    return summary
