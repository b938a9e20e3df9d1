"""The token shards on disk: the manifest and read-only memory maps of train.bin / val.bin."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from laplace import manifest
from laplace.errors import DataError, one_line

KIND = "tokenized"
SPLITS = ("train", "val")


def read_manifest(dir: str | Path) -> dict:
    """The tokenized directory's manifest (laplace.manifest's format, kind "tokenized")."""
    found, reason = manifest.read_manifest(Path(dir), KIND)
    if found is None:
        raise DataError(f"{reason} (run the tokenize stage first)")
    return found


def open_split(dir: str | Path, split: str, verify: bool = False) -> np.memmap:
    """Read-only memmap of train.bin or val.bin; verify=True also checks its sha256."""
    if split not in SPLITS:
        raise DataError(f"split must be one of {', '.join(SPLITS)}, got {split!r}")
    name = f"{split}.bin"
    path = Path(dir) / name
    found = read_manifest(dir)
    try:
        expected = found["files"][name]
        tokens = int(found["tokens"][split])
        dtype = np.dtype(found["dtype"]).newbyteorder("<")
    except (KeyError, TypeError, ValueError) as exc:
        raise DataError(f"{Path(dir) / manifest.MANIFEST}: incomplete entry for {name} ({one_line(exc)})") from exc
    if tokens == 0:
        raise DataError(f"{path}: holds no tokens")
    if expected.get("bytes") != tokens * dtype.itemsize:
        raise DataError(f"{path}: the manifest lists {expected.get('bytes')} bytes for {tokens} tokens of {dtype.name}")
    if reason := manifest.verify_file(Path(dir), name, expected, checksum=verify):
        raise DataError(reason)
    return np.memmap(path, dtype=dtype, mode="r", shape=(tokens,))
