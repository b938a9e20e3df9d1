"""Provenance of a pipeline run: the git commit and the hashes DVC recorded."""

from __future__ import annotations

import subprocess
from pathlib import Path

import yaml


def git_info(root: Path) -> dict:
    def git(*args):
        out = subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, timeout=30)
        return out.stdout.strip() if out.returncode == 0 else ""

    commit = git("rev-parse", "HEAD")
    dirty = bool(git("status", "--porcelain", "--untracked-files=no"))
    return {"commit": commit or "unknown", "dirty": dirty}


def dvc_out_hash(root: Path, out_path: str) -> str | None:
    """The md5 DVC recorded in dvc.lock for one output (a directory hash ends in .dir)."""
    lock = Path(root) / "dvc.lock"
    if not lock.exists():
        return None
    data = yaml.safe_load(lock.read_text()) or {}
    for stage in (data.get("stages") or {}).values():
        for out in stage.get("outs") or []:
            if out.get("path") == out_path:
                return out.get("md5") or out.get("hash")
    return None
