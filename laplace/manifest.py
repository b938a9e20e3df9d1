"""One manifest format for every directory the pipeline hands on: token shards, training
checkpoints and model exports.

A manifest is `manifest.json` in the directory it describes:

    {"format": 1, "kind": "tokenized" | "checkpoint" | "export", "files": {name: {"bytes", "sha256"}}, ...}

It is written last and atomically, so its presence means the directory is complete, and
`verify` checks each listed file's size and sha256, naming the first file that fails.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from laplace.fileio import atomic_write_json, sha256_file

MANIFEST = "manifest.json"
FORMAT = 1


def describe(path: Path) -> dict[str, Any]:
    """The manifest entry of one file: its size and sha256."""
    path = Path(path)
    return {"bytes": path.stat().st_size, "sha256": sha256_file(path)}


def write_manifest(
    directory: Path, kind: str, names: list[str] | None = None, known: dict[str, dict] | None = None, **fields: Any
) -> dict:
    """Describe `names` (default: every file in `directory` but the manifest) and write the manifest
    last, atomically. `known` holds entries a writer already computed while writing (no second
    read of a large file); `fields` are stored beside the file list. Returns the manifest."""
    directory = Path(directory)
    if names is None:
        names = sorted(p.name for p in directory.iterdir() if p.is_file() and p.name != MANIFEST)
    known = known or {}
    files = {n: known[n] if n in known else describe(directory / n) for n in names}
    manifest = {**fields, "format": FORMAT, "kind": kind, "files": files}
    atomic_write_json(directory / MANIFEST, manifest)
    return manifest


def read_manifest(directory: Path, kind: str) -> tuple[dict | None, str]:
    """(manifest, "") or (None, why not): missing, unreadable, another format or kind."""
    path = Path(directory) / MANIFEST
    if not path.is_file():
        return None, f"{path} is missing (an interrupted write, or not a {kind} directory)"
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as exc:
        return None, f"{path} is not valid JSON ({exc})"
    if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), dict):
        return None, f"{path} has no file list"
    if manifest.get("format") != FORMAT or manifest.get("kind") != kind:
        found = (manifest.get("format"), manifest.get("kind"))
        return None, f"{path} is format {found[0]!r} of kind {found[1]!r}, expected format {FORMAT} of kind {kind!r}"
    return manifest, ""


def verify_file(directory: Path, name: str, entry: dict, checksum: bool = True) -> str:
    """ "" when the file matches its manifest entry, else one line naming the file and what is wrong."""
    path = Path(directory) / name
    if not path.is_file():
        return f"{path} is missing"
    size = path.stat().st_size
    if size != entry.get("bytes"):
        return f"{path} is truncated or resized ({size} bytes, the manifest says {entry.get('bytes')})"
    if checksum and sha256_file(path) != entry.get("sha256"):
        return f"{path} fails its sha256 checksum (corrupted or replaced)"
    return ""


def verify(directory: Path, kind: str, checksum: bool = True) -> tuple[bool, str]:
    """(ok, reason): the manifest is there, of this kind, and every listed file matches it."""
    manifest, reason = read_manifest(directory, kind)
    if manifest is None:
        return False, reason
    for name, entry in manifest["files"].items():
        if reason := verify_file(directory, name, entry, checksum):
            return False, reason
    return True, ""
