"""The stage registry: every pipeline stage, by reference to its module, with one name.

Each stage is one small module (`laplace.pipeline.stage_<name>`, as DVC's
example-get-started has one script per stage) with `run(cfg, paths) -> metrics`. A stage's
name is its module's, hyphenated: `stage_serve_check` is the stage `serve-check`, the CLI
command `laplace serve-check`, the dvc.yaml stage `serve-check` and the figures
`metrics/serve-check.json` (tests/test_pipeline_frame.py keeps them agreeing). Every front
door goes through here: the CLI (`laplace <stage>`), dvc.yaml (whose `cmd`s are the CLI) and
the Prefect flow (one task per stage, each running `dvc repro --single-item <stage>`).
Adding a stage = one module, one entry below, one dvc.yaml entry.

Stage modules import their heavy parts (torch, the library) inside functions, so that
importing this registry (every `laplace` command, the Prefect flow) stays quick.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from types import ModuleType

from laplace.config import Config
from laplace.pipeline import (
    stage_corpus,
    stage_export,
    stage_numerics,
    stage_probes,
    stage_serve_check,
    stage_tokenize,
    stage_track,
    stage_train,
    stage_warmup,
)
from laplace.pipeline.layout import Paths, stamp_measurement


@dataclass(frozen=True)
class Stage:
    module: ModuleType  # holds run(cfg, paths)
    help: str
    # the stages whose figures this one reads (track: every other stage); passed to its run
    reads: tuple[str, ...] = ()

    @property
    def name(self) -> str:
        """The CLI command, the dvc.yaml stage and the metrics file's name."""
        return self.module.__name__.rsplit(".", 1)[-1].removeprefix("stage_").replace("_", "-")

    @property
    def metrics(self) -> str | None:
        """metrics/<name>.json holds its figures; None for track (its record is artifacts/tracking.json)."""
        return None if self.reads else self.name

    def run(self, cfg: Config, paths: Paths, **options) -> dict:
        """Run the stage; its metrics file gets a measurement stamp (layout.stamp_measurement),
        also when a missed gate fails the stage after writing its figures."""
        started = time.time()
        if self.reads:
            options["stages"] = self.reads
        try:
            metrics = self.module.run(cfg, paths, **options)
        finally:
            stamp = stamp_measurement(paths, self.metrics, started) if self.metrics else None
        return {**metrics, "measured": stamp} if stamp else metrics


_MEASURING = (
    Stage(stage_corpus, "write the default python-docs corpus to data/python-docs"),
    Stage(stage_tokenize, "tokenize the corpus (data.path) into token shards"),
    Stage(stage_warmup, "compile every decode width and prefill bucket into a cache artifact"),
    Stage(stage_train, "train (resumes from the last complete checkpoint)"),
    Stage(stage_export, "export the final checkpoint"),
    Stage(stage_serve_check, "replay workloads: exact vs padded vs eager serving"),
    Stage(stage_numerics, "compiled vs eager vs fp64 on prefill, decode and a training step"),
    Stage(stage_probes, "MQAR and passkey retrieval, state vs KV-cache memory"),
)
STAGES: dict[str, Stage] = {
    s.name: s
    for s in _MEASURING
    + (Stage(stage_track, "log the pipeline run to MLflow and register the model", tuple(s.name for s in _MEASURING)),)
}
PIPELINE: tuple[str, ...] = tuple(STAGES)
