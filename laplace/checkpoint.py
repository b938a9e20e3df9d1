"""Training checkpoints: safetensors + JSON, written atomically, verified on load.

Layout of one checkpoint (runs/train/checkpoints/step_000100/):
    model.safetensors      parameters
    optimizer.safetensors  optimizer state as named tensors
    trainer.json           step, history, config digest
    MANIFEST.json          sizes and sha256 of the files above, written last

A checkpoint is written into a hidden staging directory, every file fsynced, the
manifest written last, then the directory is renamed into place. On load the
newest checkpoint whose manifest and checksums verify wins; a damaged one is
skipped with a warning naming the file.
"""

from __future__ import annotations

import json
import logging
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from laplace.fileio import atomic_write_json, replace_dir, sha256_file, staging_dir

log = logging.getLogger(__name__)

MANIFEST = "MANIFEST.json"
STEP_DIR = re.compile(r"^step_(\d{6,})$")


class CheckpointError(RuntimeError):
    pass


@dataclass
class Checkpoint:
    path: Path
    step: int
    model: dict[str, torch.Tensor]
    optimizer: dict[str, torch.Tensor]
    trainer: dict[str, Any]


def _contiguous(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    # clone: safetensors refuses tensors that share storage (tied weights)
    return {k: v.detach().cpu().contiguous().clone() for k, v in tensors.items()}


def write_manifest(directory: Path, step: int) -> None:
    files = {
        p.name: {"bytes": p.stat().st_size, "sha256": sha256_file(p)}
        for p in sorted(directory.iterdir())
        if p.is_file() and p.name != MANIFEST
    }
    atomic_write_json(directory / MANIFEST, {"format": 1, "step": step, "files": files})


def verify_manifest(directory: Path) -> tuple[bool, str]:
    """(ok, reason): every file listed exists with the recorded size and checksum."""
    manifest_path = directory / MANIFEST
    if not manifest_path.exists():
        return False, f"{manifest_path} is missing (interrupted write?)"
    try:
        manifest = json.loads(manifest_path.read_text())
        files = manifest["files"]
    except (ValueError, KeyError) as exc:
        return False, f"{manifest_path} is unreadable ({exc})"
    for name, meta in files.items():
        p = directory / name
        if not p.exists():
            return False, f"{p} is missing"
        if p.stat().st_size != meta["bytes"]:
            return False, f"{p} is truncated or resized ({p.stat().st_size} bytes, manifest says {meta['bytes']})"
        if sha256_file(p) != meta["sha256"]:
            return False, f"{p} fails its sha256 checksum"
    return True, ""


def save_checkpoint(
    root: Path,
    step: int,
    model_state: dict[str, torch.Tensor],
    optimizer_state: dict[str, torch.Tensor],
    trainer: dict[str, Any],
    keep: int = 2,
) -> Path:
    """Write checkpoint `step` atomically under `root` and prune all but the newest `keep`."""
    root = Path(root)
    final = root / f"step_{step:06d}"
    tmp = staging_dir(final)
    try:
        save_file(_contiguous(model_state), str(tmp / "model.safetensors"), metadata={"step": str(step)})
        save_file(_contiguous(optimizer_state), str(tmp / "optimizer.safetensors"), metadata={"step": str(step)})
        atomic_write_json(tmp / "trainer.json", {**trainer, "step": step})
        write_manifest(tmp, step)
        replace_dir(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    prune_checkpoints(root, keep)
    return final


def list_checkpoints(root: Path) -> list[tuple[int, Path]]:
    """Completed checkpoint directories, newest first (staging directories are ignored)."""
    root = Path(root)
    if not root.exists():
        return []
    found = []
    for p in root.iterdir():
        m = STEP_DIR.match(p.name)
        if m and p.is_dir():
            found.append((int(m.group(1)), p))
    return sorted(found, reverse=True)


def prune_checkpoints(root: Path, keep: int) -> None:
    for _, p in list_checkpoints(root)[keep:]:
        shutil.rmtree(p, ignore_errors=True)
    for p in Path(root).glob(".step_*.partial-*"):
        shutil.rmtree(p, ignore_errors=True)  # leftovers of killed writes


def load_checkpoint(path: Path) -> Checkpoint:
    ok, reason = verify_manifest(path)
    if not ok:
        raise CheckpointError(reason)
    trainer = json.loads((path / "trainer.json").read_text())
    return Checkpoint(
        path=path,
        step=int(trainer["step"]),
        model=load_file(str(path / "model.safetensors")),
        optimizer=load_file(str(path / "optimizer.safetensors")),
        trainer=trainer,
    )


def latest_checkpoint(root: Path) -> Checkpoint | None:
    """The newest checkpoint that verifies; damaged ones are skipped with a warning."""
    for _, path in list_checkpoints(root):
        try:
            return load_checkpoint(path)
        except (CheckpointError, OSError, ValueError, KeyError) as exc:
            log.warning("skipping damaged checkpoint %s: %s", path, exc)
    return None
