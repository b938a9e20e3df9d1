"""The exported model: model.safetensors + config.json + tokenizer.json + manifest.json, byte-reproducible.

The same checkpoint always exports to the same bytes (no timestamps, sorted keys),
so a pipeline re-run that changes nothing upstream does not invalidate downstream
stages. Loading never unpickles anything.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from laplace import manifest
from laplace.errors import InputError
from laplace.fileio import atomic_write_json, replace_dir, staging_dir
from laplace.model.config import ModelConfig, validate_model_config
from laplace.model.lm import LaplaceLM, torch_dtype
from laplace.tokenizer_file import load_tokenizer, tokenizer_sha256

FORMAT = 1
KIND = "export"


class ExportError(InputError):
    pass


def export_model(checkpoint, tokenizer_path: Path, out_dir: Path, special_ids: dict | None = None) -> dict:
    """Write the export directory from a training checkpoint. Returns a summary dict. `special_ids`
    (bos_id, eos_id, and chat_template where it has one): those of the model fine-tuned from
    (model.init), else Laplace's own (no chat template: the server's default applies)."""
    model_cfg = validate_model_config(ModelConfig(**checkpoint.trainer["model_config"]))
    tokenizer = load_tokenizer(tokenizer_path)
    config = {
        "format": FORMAT,
        "model": model_cfg.architecture(),  # the kernel is the serving process's choice
        "step": checkpoint.step,
        "tokenizer_sha256": tokenizer_sha256(tokenizer),
        **(special_ids if special_ids is not None else special_token_ids(tokenizer)),
    }
    return write_export(checkpoint.model, config, tokenizer_path, out_dir)


def special_token_ids(tokenizer) -> dict:
    """bos_id / eos_id of a tokenizer Laplace trained (<|endoftext|> ends documents, nothing begins
    them). An imported model brings its own from its config (laplace.model.hf)."""
    return {"bos_id": None, "eos_id": tokenizer.token_to_id("<|endoftext|>")}


def write_export(tensors: dict, config: dict, tokenizer_path: Path, out_dir: Path) -> dict:
    """The export directory from `tensors` (Laplace names, written as they are: no dtype change)
    and its config (format, model, step, tokenizer_sha256, bos_id, eos_id; `parameters` is added),
    staged and swapped in whole. The same inputs always give the same bytes."""
    model_cfg = validate_model_config(ModelConfig(**config["model"]))
    tokenizer = load_tokenizer(tokenizer_path)
    vocab = tokenizer.get_vocab_size()
    if vocab > model_cfg.vocab_size:
        raise ExportError(f"tokenizer {tokenizer_path} has {vocab} tokens but the model only {model_cfg.vocab_size}")
    tensors = {k: v.contiguous() for k, v in sorted(tensors.items())}
    if model_cfg.tie_embeddings:
        tensors.pop("lm_head.weight", None)
    config = {**config, "parameters": sum(t.numel() for t in tensors.values())}
    tmp = staging_dir(out_dir)
    try:
        # one metadata key only: safetensors writes a multi-key metadata map in random order
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "laplace"})
        shutil.copyfile(tokenizer_path, tmp / "tokenizer.json")
        atomic_write_json(tmp / "config.json", config)
        manifest.write_manifest(tmp, KIND, step=config["step"])  # sizes and sha256 of the three files, last
        replace_dir(tmp, Path(out_dir))
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return {
        "export_dir": str(out_dir),
        "step": config["step"],
        "parameters": config["parameters"],
        "model_bytes": (Path(out_dir) / "model.safetensors").stat().st_size,
    }


def read_export_config(export_dir: Path) -> dict:
    path = Path(export_dir) / "config.json"
    if not path.exists():
        raise ExportError(f"{path}: not an exported model (config.json missing)")
    return json.loads(path.read_text())


def load_export_tensors(export_dir: Path) -> tuple[dict, dict]:
    """(config dict, tensors as stored) of an export directory, its manifest verified."""
    export_dir = Path(export_dir)
    config = read_export_config(export_dir)
    ok, reason = manifest.verify(export_dir, KIND)
    if not ok:
        raise ExportError(reason)
    return config, load_file(str(export_dir / "model.safetensors"))


def load_export(
    export_dir: Path, device: torch.device | str = "cpu", dtype: torch.dtype | None = None, kernel: str = "auto"
):
    """(model in eval mode, tokenizer, config dict) from an export directory; checks they belong together.
    `kernel` (model.kernel) is how this process runs the GLA core; the export does not decide it."""
    export_dir = Path(export_dir)
    config, tensors = load_export_tensors(export_dir)
    model_cfg = validate_model_config(ModelConfig(**{**config["model"], "kernel": kernel}))
    tokenizer = load_tokenizer(export_dir / "tokenizer.json")
    if tokenizer_sha256(tokenizer) != config["tokenizer_sha256"]:
        raise ExportError(f"{export_dir / 'tokenizer.json'} is not the tokenizer this model was trained with")
    if tokenizer.get_vocab_size() > model_cfg.vocab_size:
        raise ExportError(
            f"tokenizer vocab {tokenizer.get_vocab_size()} does not fit the model vocab {model_cfg.vocab_size}"
        )
    with torch.device("meta"):
        model = LaplaceLM(model_cfg)
    model.load_state_dict(tensors, strict=not model_cfg.tie_embeddings, assign=True)
    if model_cfg.tie_embeddings:
        model.lm_head.weight = model.embed.weight
    model = model.to(device=device, dtype=dtype or torch_dtype(model_cfg.dtype)).eval()
    return model, tokenizer, config
