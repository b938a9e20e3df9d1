"""Where every stage reads and writes: the one place that knows the project's file layout."""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from laplace.fileio import atomic_write_json

# every knob that names a file or directory to read -> the dvc.yaml dependency that holds it: each
# stage reading the knob lists that dependency (tests/test_knob_files.py), so a file replaced in place
# reruns every stage that reads it. Imports (model.init) and given tokenizers (tokenizer.from) live
# under models/ (`laplace import` puts them there); one elsewhere is seen by DVC only by its path, and
# the stage says so (warn_if_untracked). data.hub_path names a hub dataset (its id is the param).
KNOB_FILE_DEPS = {"data.path": "${data.path}", "tokenizer.from": "models", "model.init": "models"}


@dataclass(frozen=True)
class Paths:
    root: Path

    @classmethod
    def at(cls, root: str | Path = ".") -> Paths:
        return cls(Path(root).resolve())

    @property
    def data_dir(self) -> Path:
        return self.root / "data" / "tokenized"

    @property
    def python_docs_dir(self) -> Path:
        """The default corpus as files (the corpus stage writes it; data.path names it)."""
        return self.root / "data" / "python-docs"

    @property
    def run_dir(self) -> Path:
        return self.root / "runs" / "train"

    @property
    def checkpoints(self) -> Path:
        return self.run_dir / "checkpoints"

    @property
    def models_dir(self) -> Path:
        """Imported models (model.init) and given tokenizers (tokenizer.from): a dependency of every
        stage that reads them, so DVC reruns it when one is replaced in place (KNOB_FILE_DEPS)."""
        return self.root / "models"

    def warn_if_untracked(self, key: str, value: str, log) -> None:
        """One warning when a file knob names something outside models/ (see KNOB_FILE_DEPS)."""
        if value and not (self.root / value).resolve().is_relative_to(self.models_dir):
            log.warning(
                "%s %s is outside %s: DVC sees only the path, so replacing it in place reruns nothing "
                "(dvc repro --force does); put it under models/ (laplace import does) to have it tracked",
                key,
                value,
                self.models_dir,
            )

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
    def headline_file(self) -> Path:
        """The few figures DVC compares by default (dvc metrics show/diff, dvc exp show)."""
        return self.root / "metrics.json"

    @property
    def warmup_cache(self) -> Path:
        return self.root / "artifacts" / "warmup" / "compile-cache"

    @property
    def tracking_file(self) -> Path:
        return self.root / "artifacts" / "tracking.json"


def write_metrics(paths: Paths, stage: str, metrics: dict) -> dict:
    atomic_write_json(paths.metrics_file(stage), metrics)
    return metrics


def _iso(epoch: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(epoch))


def stamp_measurement(paths: Paths, stage: str, started: float) -> dict | None:
    """Add `measured` ({id, started, finished, seconds}) to the metrics file a stage wrote since
    `started` (epoch seconds). The stamp travels with the figures: when DVC later restores the
    file from its run-cache, or leaves it as it is because the stage is up to date, the stamp
    still names the measurement, which the track stage traces to the MLflow run that logged it.
    Returns the stamp, or None when the stage wrote no metrics in this run."""
    path = paths.metrics_file(stage)
    if not path.exists() or path.stat().st_mtime < started - 1:  # -1: coarse file-system clocks
        return None
    metrics = json.loads(path.read_text())
    if not isinstance(metrics, dict):
        return None
    finished = time.time()
    metrics["measured"] = {
        "id": uuid.uuid4().hex[:16],
        "started": _iso(started),
        "finished": _iso(finished),
        "seconds": round(finished - started, 3),
    }
    atomic_write_json(path, metrics)
    return metrics["measured"]
