"""The tokenize stage's assembly: the new output built beside the old one of hard links only (to
the old output's shards for a reused slice, to the staged ones for a new slice), the manifest
written last, then swapped in at once; and the recovery from a run killed in the middle of it."""

from __future__ import annotations

import ctypes
import os
import shutil
import sys
from pathlib import Path

from laplace import manifest
from laplace.data.shards import KIND, SPLITS, TOKENS
from laplace.data.tokenizer import TOKENIZER_NAME
from laplace.fileio import atomic_write_bytes, fsync_dir, fsync_file


def assembly_step(name: str) -> None:
    """Called at each step of the assembly (a no-op): the crash tests kill the stage here."""


def next_dir(out_dir: Path) -> Path:
    return out_dir.parent / f".{out_dir.name}.next"


def _old_dir(out_dir: Path) -> Path:
    return out_dir.parent / f".{out_dir.name}.old"


def recover(out_dir: Path) -> None:
    """Undo what a run killed during the assembly left: a half-built (or swapped-out) `.next`, and
    the previous output parked as `.old` when the swap is two renames (see _swap)."""
    old = _old_dir(out_dir)
    if old.is_dir() and not out_dir.exists():
        os.replace(old, out_dir)  # killed between the two renames: the previous output comes back
    shutil.rmtree(old, ignore_errors=True)
    shutil.rmtree(next_dir(out_dir), ignore_errors=True)


_RENAME_EXCHANGE = 2


def _swap(nxt: Path, out_dir: Path) -> None:
    """Put `nxt` in place of `out_dir` in one step: renameat2(RENAME_EXCHANGE) swaps the two names
    atomically (Linux 3.15+, most local filesystems), so a kill leaves either output. Elsewhere two
    renames, with the previous output parked as `.old` for recover to put back."""
    for p in nxt.rglob("*"):
        if p.is_file():
            fsync_file(p)
    fsync_dir(nxt)
    if out_dir.exists() and sys.platform == "linux":
        libc = ctypes.CDLL(None, use_errno=True)
        at_fdcwd = -100
        if libc.renameat2(at_fdcwd, os.fsencode(nxt), at_fdcwd, os.fsencode(out_dir), _RENAME_EXCHANGE) == 0:
            fsync_dir(out_dir.parent)
            assembly_step("swapped")
            shutil.rmtree(nxt, ignore_errors=True)  # now the previous output
            return
    if out_dir.exists():
        os.replace(out_dir, _old_dir(out_dir))
        assembly_step("parked")
    os.replace(nxt, out_dir)
    fsync_dir(out_dir.parent)
    assembly_step("swapped")
    shutil.rmtree(_old_dir(out_dir), ignore_errors=True)


def assemble(
    out_dir: Path,
    staging: Path,
    records: dict[int, dict],
    reused: set[int],
    busy: list[int],
    raw_tokenizer: bytes,
    fields: dict,
) -> None:
    """Build the new output beside the old one and swap it in; the manifest is written last.

    Every shard is a hard link: to the old output's file for a reused slice (the same inode:
    neither rewritten nor rehashed by DVC), to the staged file for a new one. Nothing is moved out
    of the staging directory until the new output is in place, so a kill at any step leaves the old
    output or the new one, and the staging directory to resume from (tests kill at each step).
    """
    nxt = next_dir(out_dir)
    shutil.rmtree(nxt, ignore_errors=True)
    nxt.mkdir(parents=True)
    assembly_step("started")
    known: dict[str, dict] = {}
    names: list[str] = []
    order: dict[str, list[dict]] = {s: [] for s in SPLITS}
    for i in busy:
        for split in SPLITS:
            for shard in records[i]["shards"][split]:
                source = (out_dir if i in reused else staging) / shard["path"]
                target = nxt / shard["path"]
                target.mkdir(parents=True)
                for name in (TOKENS, manifest.MANIFEST):
                    os.link(source / name, target / name)
                assembly_step("linked a shard")
                names += [f"{shard['path']}/{TOKENS}", f"{shard['path']}/{manifest.MANIFEST}"]
                known[f"{shard['path']}/{TOKENS}"] = {"bytes": shard["bytes"], "sha256": shard["sha256"]}
                order[split].append({"path": shard["path"], "tokens": shard["tokens"]})
    old_tokenizer = out_dir / TOKENIZER_NAME
    if old_tokenizer.is_file() and old_tokenizer.read_bytes() == raw_tokenizer:
        os.link(old_tokenizer, nxt / TOKENIZER_NAME)
    else:
        atomic_write_bytes(nxt / TOKENIZER_NAME, raw_tokenizer)
    names.append(TOKENIZER_NAME)
    assembly_step("wrote the tokenizer")
    manifest.write_manifest(
        nxt,
        KIND,
        names,
        known=known,
        shards=order,
        slices={f"{i:05d}": records[i] for i in busy},
        **fields,
    )
    assembly_step("wrote the manifest")
    _swap(nxt, out_dir)
