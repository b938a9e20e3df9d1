"""The export stage: the final training checkpoint -> artifacts/export/ (safetensors, config, tokenizer).

Processes: all of it runs in the `laplace export` process."""

from __future__ import annotations

from laplace.config import Config
from laplace.errors import InputError
from laplace.pipeline.layout import Paths, write_metrics


def run(cfg: Config, paths: Paths) -> dict:
    from laplace.model.export import export_model  # torch: imported when the stage runs
    from laplace.training import checkpoint as ckpt

    found = ckpt.latest_checkpoint(paths.checkpoints)
    if found is None:
        raise InputError(f"no complete checkpoint under {paths.checkpoints}: run the train stage first")
    if found.step < cfg.train.steps:
        raise InputError(
            f"latest checkpoint is step {found.step} of {cfg.train.steps}: training has not finished, "
            "refusing to export"
        )
    summary = export_model(found, paths.data_dir / "tokenizer.json", paths.export_dir)
    summary["export_dir"] = str(paths.export_dir.relative_to(paths.root))
    return write_metrics(paths, "export", summary)
