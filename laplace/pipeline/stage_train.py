"""The train stage: training, its plots and figures.

Processes: one rank trains in the `laplace train` process itself. When train.nproc_per_node /
nnodes ask for more ranks, `run_training` launches torchrun (its agent as
laplace.training.launch), which starts this module once per rank (`main`: torch.distributed
needs a process per rank); every rank trains, the first rank of each node writes the result
for that node's parent, which writes the plots and metrics.

One job per project and node (runs/.train-node<N>.lock), and every process of it dies with
`laplace train`; SIGTERM stops it at a step boundary, with a checkpoint when there is time
(laplace.training.lifecycle)."""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import tempfile
from pathlib import Path

from laplace.config import Config
from laplace.pipeline.layout import Paths, write_metrics
from laplace.pipeline.logs import setup_logging
from laplace.training import lifecycle  # no torch at import: the registry imports this module

log = logging.getLogger(__name__)


def run(cfg: Config, paths: Paths, resume: bool = True) -> dict:
    from laplace.pipeline.plots import training_curve, write_rows  # matplotlib: only when plotting

    # `laplace train` under DVC or a Prefect task: stop (gracefully) when that parent dies
    lifecycle.die_with_parent(signal.SIGTERM)
    paths.warn_if_untracked("model.init", cfg.model.init, log)
    metrics, history, checkpoint = run_training(cfg, paths, resume=resume)
    if (kept := _already_trained(cfg, paths, metrics, history)) is not None:
        return kept
    metrics = dict(metrics)
    metrics["checkpoint"] = str(checkpoint.relative_to(paths.root)) if checkpoint else None
    write_rows(
        paths.plots_dir / "train_loss.json",
        [{"step": h["step"], "loss": h["loss"], "tokens_per_s": h.get("tokens_per_s")} for h in history if "loss" in h],
    )
    write_rows(
        paths.plots_dir / "val_loss.json",
        [{"step": h["step"], "val_loss": h["val_loss"]} for h in history if "val_loss" in h],
    )
    training_curve(history, paths.plots_dir / "train_curve.png")
    write_metrics(paths, "train", metrics)
    return metrics


def _already_trained(cfg: Config, paths: Paths, metrics: dict, history: list[dict]) -> dict | None:
    """A rerun that resumed from the final checkpoint trained no step: it has no throughput or
    traffic to report. When metrics/train.json already holds that checkpoint's figures (same steps,
    same final validation loss), keep it and the plots as they are (so `dvc status` stays clean)
    and return those figures; else None (they are written from the checkpoint's history)."""
    steps = cfg.train.steps
    if metrics.get("resumed_from_step") != steps:
        return None
    path = paths.metrics_file("train")
    try:
        recorded = json.loads(path.read_text())
    except (OSError, ValueError):
        recorded = None
    evals = [h["val_loss"] for h in history if "val_loss" in h]
    if not isinstance(recorded, dict) or recorded.get("steps") != steps or [recorded.get("val_loss")] != evals[-1:]:
        log.warning(
            "already trained to step %d; %s was missing or another run's: rewritten from the checkpoint's "
            "history (throughput not measured again)",
            steps,
            path.name,
        )
        return None
    log.info(
        "already trained to step %d: %s and plots/ kept as they are (--no-resume trains again)",
        steps,
        path.relative_to(paths.root),
    )
    return recorded


def run_training(cfg: Config, paths: Paths, resume: bool = True, stop_at_step: int | None = None):
    """Train in this process, or under torchrun when train.nproc_per_node / nnodes ask for more ranks,
    holding the project's lock. Returns (metrics, history, checkpoint path)."""
    lock = paths.root / "runs" / f".train-node{cfg.train.node_rank}.lock"
    with lifecycle.project_lock(lock):
        return _run_training(cfg, paths, resume, stop_at_step)


def _run_training(cfg: Config, paths: Paths, resume: bool, stop_at_step: int | None):
    from laplace.training import distributed  # torch: imported when the stage runs, not with the registry
    from laplace.training.loop import check_inputs, train

    if not distributed.needs_torchrun(cfg.train):
        result = train(cfg, paths.data_dir, paths.run_dir, resume=resume, stop_at_step=stop_at_step)
        return result.metrics, result.history, result.checkpoint
    from laplace.pipeline.repro import subprocess_env
    from laplace.pipeline.workers import run_worker

    t = cfg.train
    if t.node_rank == 0:
        # Reject bad data or settings here, before torchrun starts any rank. Other nodes leave it
        # to their ranks: a node that cannot see the shared data must fail inside the job, where
        # every rank learns it, not before joining it, which would leave the others waiting.
        check_inputs(cfg, paths.data_dir, world=t.nproc_per_node * t.nnodes)

    args = (
        ["--data-dir", str(paths.data_dir), "--run-dir", str(paths.run_dir)]
        + (["--no-resume"] if not resume else [])
        + (["--stop-at-step", str(stop_at_step)] if stop_at_step else [])
    )
    env = subprocess_env({lifecycle.LAUNCHER_PID_ENV: str(os.getpid())})
    if t.threads > 0:  # each rank's OpenMP from its start (torchrun would set 1 and warn); train() sets torch's too
        env["OMP_NUM_THREADS"] = str(t.threads)
    stopped = "stopped by {signal}: the ranks save a checkpoint at the next step when there is time; rerun to resume"
    with tempfile.TemporaryDirectory(prefix="laplace-train-") as tmp, lifecycle.sigterm_raises(stopped):
        result = run_worker(
            __name__,
            cfg,
            args,
            env,
            paths.root,
            Path(tmp) / "result.json",
            launcher=distributed.torchrun_launcher(cfg.train),
        )
    return result["metrics"], result["history"], Path(result["checkpoint"]) if result["checkpoint"] else None


def main(argv: list[str] | None = None) -> int:
    """The torchrun entry point: `torchrun ... -m laplace.pipeline.stage_train --config-json C --out O
    --data-dir D --run-dir R`. Every rank trains; each node's first rank writes the result
    (metrics, history, checkpoint) to --out."""
    from laplace.pipeline.workers import worker_main
    from laplace.training.loop import train

    lifecycle.die_with_agent()  # torchrun starts ranks in their own sessions: only this reaches them
    setup_logging()

    def body(cfg: Config, args) -> dict:
        try:
            result = train(cfg, args.data_dir, args.run_dir, resume=not args.no_resume, stop_at_step=args.stop_at_step)
        except BaseException as exc:  # the agent's verdict on a dead rank quotes this line
            lifecycle.record_error(exc)
            raise
        return {
            "metrics": result.metrics,
            "history": result.history,
            "checkpoint": str(result.checkpoint) if result.checkpoint else None,
        }

    return worker_main(
        "distributed training worker (run by torchrun)",
        body,
        argv,
        paths=("data-dir", "run-dir"),
        options={
            "stop-at-step": {"type": int, "default": None, "required": False},
            "no-resume": {"action": "store_true", "required": False},
        },
    )


if __name__ == "__main__":
    sys.exit(main())
