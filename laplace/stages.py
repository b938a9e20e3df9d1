"""One function per pipeline stage: (config, paths) -> metrics dict.

This is the one place that knows the file layout. Every front door (the CLI,
dvc.yaml, the Prefect flow) calls these functions.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

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


def write_metrics(paths: Paths, stage: str, metrics: dict) -> dict:
    atomic_write_json(paths.metrics_file(stage), metrics)
    return metrics


def tokenize(cfg: Config, paths: Paths) -> dict:
    metrics = tokenize_corpus(cfg.data, cfg.tokenizer, paths.data_dir, cfg.seed)
    return write_metrics(paths, "tokenize", metrics)


def train_stage(cfg: Config, paths: Paths, **kwargs) -> dict:
    result = train(cfg, paths.data_dir, paths.run_dir, **kwargs)
    metrics = dict(result.metrics)
    metrics["checkpoint"] = str(result.checkpoint.relative_to(paths.root)) if result.checkpoint else None
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
