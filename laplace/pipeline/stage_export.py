"""The export stage: the final training checkpoint -> artifacts/export/ (safetensors, config, tokenizer).

Processes: all of it runs in the `laplace export` process."""

from __future__ import annotations

from pathlib import Path

from laplace.config import Config
from laplace.errors import InputError
from laplace.pipeline.layout import Paths, write_metrics


def run(cfg: Config, paths: Paths) -> dict:
    from laplace.model.export import export_model, read_export_config  # torch: imported when the stage runs
    from laplace.training import checkpoint as ckpt

    found = ckpt.latest_checkpoint(paths.checkpoints)
    if found is None:
        raise InputError(f"no complete checkpoint under {paths.checkpoints}: run the train stage first")
    if found.step < cfg.train.steps:
        raise InputError(
            f"latest checkpoint is step {found.step} of {cfg.train.steps}: training has not finished, "
            "refusing to export"
        )
    special_ids = None
    if cfg.model.init:  # a fine-tuned model keeps the BOS/EOS conventions and chat template of its origin
        init = read_export_config(Path(cfg.model.init))
        special_ids = {"bos_id": init.get("bos_id"), "eos_id": init.get("eos_id")}
        if init.get("chat_template"):
            special_ids["chat_template"] = init["chat_template"]
    summary = export_model(found, paths.data_dir / "tokenizer.json", paths.export_dir, special_ids)
    summary["export_dir"] = str(paths.export_dir.relative_to(paths.root))
    return write_metrics(paths, "export", summary)
