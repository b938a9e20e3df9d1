"""The tokenize stage with its slices fanned out over a Prefect task runner: a Dask cluster
(prefect-dask), one Prefect task per slice. (Not named tokenize.py: run as a script, flows/ leads
sys.path and that name would shadow the standard library's tokenize.)

The stage plans and trains the tokenizer here, then maps `encode_slice` over the slices as
tasks on the runner (each slice an independent, resumable job that writes its own result record
under the staging directory, so a retried or resubmitted task resumes), and finally merges the
records into the manifest here. Every Dask worker must see the project directory (one machine,
or a shared filesystem). The output is byte-identical to the local pool's (`laplace tokenize`,
the default), which DVC runs; this flow is for corpora that want more than one machine.

    python flows/tokenize_slices.py --scheduler tcp://HOST:8786   # an existing Dask cluster
    python flows/tokenize_slices.py --workers 4                   # a LocalCluster on this machine
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from prefect import flow, get_run_logger, task
from prefect_dask import DaskTaskRunner

from laplace.data.tokenize import encode_slice, tokenize_corpus
from laplace.pipeline.layout import Paths, write_metrics
from laplace.pipeline.params import load_config


@task(name="encode-slice", retries=2, retry_delay_seconds=0)
def encode_slice_task(job) -> tuple[dict, int]:
    """One slice: resumes from the shards a killed attempt finished (the stage's own protocol)."""
    return encode_slice(job)


def map_over_tasks(fn, jobs: list) -> list:
    """tokenize_corpus's map_slices: every encode job as a task on the flow's task runner."""
    assert fn is encode_slice
    futures = encode_slice_task.map(jobs)
    return [f.result() for f in futures]


@flow(name="laplace-tokenize")
def tokenize(root: str = ".", overrides: dict[str, Any] | None = None, out_dir: str | None = None) -> dict:
    """The tokenize stage of the project at `root` (its params.yaml, with `overrides`), slices on
    the task runner; writes data/tokenized (or out_dir) and metrics/tokenize.json."""
    logger = get_run_logger()
    paths = Paths.at(root)
    cfg = load_config(Path(root) / "params.yaml", overrides)
    out = Path(out_dir) if out_dir else paths.data_dir
    metrics = tokenize_corpus(cfg.data, cfg.tokenizer, out, cfg.seed, map_slices=map_over_tasks)
    logger.info("tokenized %d slices (%d reused) into %s", metrics["slices"], metrics["slices_reused"], out)
    if out_dir is None:
        write_metrics(paths, "tokenize", metrics)
    return metrics


def on_dask(address: str | None = None, workers: int = 2, threads_per_worker: int = 1):
    """The flow with a Dask task runner: an existing scheduler, else a LocalCluster of processes."""
    if address:
        runner = DaskTaskRunner(address=address)
    else:
        runner = DaskTaskRunner(
            cluster_kwargs={
                "n_workers": workers,
                "threads_per_worker": threads_per_worker,
                "processes": True,
                "host": "127.0.0.1",
                "dashboard_address": None,
            }
        )
    return tokenize.with_options(task_runner=runner)


if __name__ == "__main__":
    import argparse
    import json

    parser = argparse.ArgumentParser(description="the tokenize stage, slices fanned out over Dask")
    parser.add_argument("--root", default=".")
    parser.add_argument("--scheduler", default=None, help="a Dask scheduler address; default: a LocalCluster")
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()
    print(json.dumps(on_dask(args.scheduler, args.workers)(root=args.root), indent=2, default=str))
