"""The Laplace pipeline as a Prefect flow: one task per DVC stage, in order.

Each task runs `dvc repro --single-item <stage>`, so DVC decides whether the stage
is up to date, records what it ran in dvc.lock and caches its outputs: however the
pipeline is launched, `dvc status` is clean afterwards. Stage output is streamed to
the Prefect logs. Transient failures are retried; bad input (a stage exiting with
status 2: bad params, bad data) is not.

    python flows/pipeline.py                      # run once, no server needed
    prefect deployment run 'laplace-pipeline/tiny' --watch   # via a server and worker (README)
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from prefect import flow, get_run_logger, task
from prefect.artifacts import create_link_artifact, create_markdown_artifact
from prefect.runtime import flow_run

from laplace.errors import INPUT_ERROR_EXIT
from laplace.pipeline import repro, summary
from laplace.pipeline.layout import Paths
from laplace.pipeline.params import load_config, write_params
from laplace.pipeline.stages import PIPELINE
from laplace.tracking import views


class StageFailed(RuntimeError):
    """A stage failed for a reason that may pass (killed process, lock held, server down)."""


class StageRejected(RuntimeError):
    """A stage rejected its input (exit status 2): retrying cannot help."""


def retry_transient(task, task_run, state) -> bool:
    exc = state.data if isinstance(state.data, BaseException) else None
    return not isinstance(exc, StageRejected)


@task
def run_stage(stage: str, root: str, flow_run_id: str) -> dict:
    logger = get_run_logger()
    env = {"LAPLACE_LAUNCHER": "prefect", "LAPLACE_PREFECT_FLOW_RUN_ID": flow_run_id}
    status, tail = repro.repro(Path(root), stage, on_line=repro.WithoutGitHints(logger.info), env_extra=env)
    if status != 0:
        child = repro.stage_exit_status(status, tail)
        last = next((line for line in reversed(tail.splitlines()) if "error" in line.lower()), tail[-300:])
        if child == INPUT_ERROR_EXIT:
            raise StageRejected(f"stage {stage} rejected its input: {last}")
        raise StageFailed(f"stage {stage} failed (exit status {child}): {last}")
    stage_metrics = Paths.at(root).metrics_file(stage)
    return {"stage": stage, "metrics_file": str(stage_metrics) if stage_metrics.exists() else None}


def _mlflow_ui_url(info: dict) -> str | None:
    trk = info.get("tracking") or {}
    if not trk.get("run_id"):
        return None
    return views.ui_url(trk["tracking_uri"], trk["experiment_id"], trk["run_id"])


@flow(name="laplace-pipeline")
def pipeline(preset: str = "tiny", overrides: dict[str, Any] | None = None, root: str | None = None) -> dict:
    """Run every stage. `overrides` ({"train.lr": 0.01, ...}) and `preset` are written into
    params.yaml first, as `dvc exp run --set-param` would, so dvc.lock records them."""
    logger = get_run_logger()
    root_path = Path(root or os.getcwd()).resolve()
    params_file = root_path / "params.yaml"
    changed = write_params(params_file, {"model.preset": preset, **(overrides or {})})
    cfg = load_config(params_file)  # already validated by write_params; nothing has run yet
    logger.info("params %s (%s)", cfg.digest(), "updated" if changed else "unchanged")

    run_id = str(flow_run.id or "local")
    for stage in PIPELINE:
        run_stage.with_options(
            name=f"stage-{stage}",
            retries=cfg.pipeline.retries,
            retry_delay_seconds=cfg.pipeline.retry_delay_s,
            timeout_seconds=cfg.pipeline.stage_timeout_s,
            retry_condition_fn=retry_transient,
        )(stage, str(root_path), run_id)

    info = summary.read(Paths.at(root_path))
    create_markdown_artifact(
        summary.as_markdown(info, root_path), key="laplace-summary", description="headline metrics of this pipeline run"
    )
    if url := _mlflow_ui_url(info):
        create_link_artifact(
            url,
            link_text="MLflow run",
            key="laplace-mlflow-run",
            description="open with `mlflow ui` on the project's store (README)",
        )
    status, tail = repro.run_streaming(repro.dvc_command("status"), root_path, repro.subprocess_env(), logger.info)
    logger.info("dvc.lock, params.yaml, metrics.json and plots/ record this run: commit them with git to keep it")
    return {
        "params_hash": cfg.digest(),
        "dvc_status_clean": status == 0 and "up to date" in tail,
        "tracking": info.get("tracking"),
    }


if __name__ == "__main__":
    import argparse
    import json

    parser = argparse.ArgumentParser(description="run the Laplace pipeline flow once (no server needed)")
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    args = parser.parse_args()
    from laplace.pipeline.params import parse_override

    overrides = {".".join(k): v for k, v in (parse_override(o) for o in args.overrides)}
    print(json.dumps(pipeline(preset=args.preset, overrides=overrides), indent=2, default=str))
