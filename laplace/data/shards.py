"""The token shards on disk: the manifest and read-only memory maps of train.bin / val.bin."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from laplace.errors import DataError, one_line
from laplace.fileio import sha256_file

MANIFEST_FORMAT = 1
MANIFEST_NAME = "manifest.json"
SPLITS = ("train", "val")


def read_manifest(dir: str | Path) -> dict:
    path = Path(dir) / MANIFEST_NAME
    if not path.is_file():
        raise DataError(f"{path}: no manifest (run the tokenize stage first)")
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as exc:
        raise DataError(f"{path}: not valid JSON ({one_line(exc)})") from exc
    if not isinstance(manifest, dict) or manifest.get("format") != MANIFEST_FORMAT:
        found = manifest.get("format") if isinstance(manifest, dict) else None
        raise DataError(f"{path}: unsupported manifest format {found!r} (expected {MANIFEST_FORMAT})")
    return manifest


def open_split(dir: str | Path, split: str, verify: bool = False) -> np.memmap:
    """Read-only memmap of train.bin or val.bin; verify=True also checks its sha256."""
    if split not in SPLITS:
        raise DataError(f"split must be one of {', '.join(SPLITS)}, got {split!r}")
    manifest = read_manifest(dir)
    name = f"{split}.bin"
    path = Path(dir) / name
    try:
        expected = manifest["files"][name]
        tokens = int(manifest["tokens"][split])
        dtype = np.dtype(manifest["dtype"]).newbyteorder("<")
    except (KeyError, TypeError, ValueError) as exc:
        raise DataError(f"{Path(dir) / MANIFEST_NAME}: incomplete entry for {name} ({one_line(exc)})") from exc
    if not path.is_file():
        raise DataError(f"{path}: missing (listed in the manifest)")
    size = path.stat().st_size
    if size != expected["bytes"] or size != tokens * dtype.itemsize:
        raise DataError(f"{path}: {size} bytes, manifest says {expected['bytes']} ({tokens} tokens of {dtype.name})")
    if tokens == 0:
        raise DataError(f"{path}: holds no tokens")
    if verify and sha256_file(path) != expected["sha256"]:
        raise DataError(f"{path}: sha256 does not match the manifest (file corrupted or replaced)")
    return np.memmap(path, dtype=dtype, mode="r", shape=(tokens,))
