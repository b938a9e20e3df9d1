"""The stage registry: the name, module, metrics file and help of every pipeline stage.

Each stage is one small module (`laplace.pipeline.stage_<name>`, as DVC's
example-get-started has one script per stage) with `run(cfg, paths) -> metrics`. Every
front door goes through here: the CLI (`laplace <stage>`), dvc.yaml (whose `cmd`s are the
CLI) and the Prefect flow (one task per stage, each running `dvc repro --single-item
<stage>`). Adding a stage = one module, one entry below, one dvc.yaml entry; the CLI
command and the Prefect task come from here.
"""

from __future__ import annotations

import importlib
import time
from dataclasses import dataclass

from laplace.config import Config
from laplace.pipeline.layout import Paths, stamp_measurement


@dataclass(frozen=True)
class Stage:
    name: str  # the CLI command and dvc.yaml stage
    module: str  # laplace.pipeline.<module> holds run(cfg, paths)
    metrics: str | None  # metrics/<metrics>.json, None for the tracking stage
    help: str

    def run(self, cfg: Config, paths: Paths, **options) -> dict:
        """Run the stage; its metrics file gets a measurement stamp (layout.stamp_measurement),
        also when a missed gate fails the stage after writing its figures."""
        started = time.time()
        try:
            metrics = importlib.import_module(f"laplace.pipeline.{self.module}").run(cfg, paths, **options)
        finally:
            stamp = stamp_measurement(paths, self.metrics, started) if self.metrics else None
        return {**metrics, "measured": stamp} if stamp else metrics


STAGES: dict[str, Stage] = {
    s.name: s
    for s in (
        Stage("corpus", "stage_corpus", "corpus", "write the default python-docs corpus to data/python-docs"),
        Stage("tokenize", "stage_tokenize", "tokenize", "tokenize the corpus (data.path) into token shards"),
        Stage(
            "warmup", "stage_warmup", "warmup", "compile every decode width and prefill bucket into a cache artifact"
        ),
        Stage("train", "stage_train", "train", "train (resumes from the last complete checkpoint)"),
        Stage("export", "stage_export", "export", "export the final checkpoint"),
        Stage("serve-check", "stage_servecheck", "serve", "replay workloads: exact vs padded vs eager serving"),
        Stage(
            "numerics", "stage_numerics", "numerics", "compiled vs eager vs fp64 on prefill, decode and a training step"
        ),
        Stage("probes", "stage_probes", "probes", "MQAR and passkey retrieval, state vs KV-cache memory"),
        Stage("track", "stage_track", None, "log the pipeline run to MLflow and register the model"),
    )
}
PIPELINE: tuple[str, ...] = tuple(STAGES)
