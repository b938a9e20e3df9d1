"""Where every stage reads and writes: the one place that knows the project's file layout."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from laplace.fileio import atomic_write_json


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
