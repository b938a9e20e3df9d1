"""Driving DVC from Python: params overrides written like `dvc exp run --set-param`, and
`dvc repro` run as a subprocess whose output is streamed line by line.

The CLI's `laplace run` and the Prefect flow both go through here, so whichever front
door launched the pipeline, dvc.lock records exactly the params that produced the
outputs and `dvc status` is clean afterwards.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Callable

from laplace.config import ConfigError, apply_overrides, config_from_dict, parse_override, read_params

# Exit status of `laplace <command>` for bad input (config, data): never worth a retry.
USER_ERROR_EXIT = 2
_DVC_CHILD_EXIT = re.compile(r"exited with (\d+)")


def subprocess_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment for DVC and the stage commands it runs: this interpreter's bin first on
    PATH (so `laplace` resolves without an activated venv), no analytics, slow progress bars."""
    env = dict(os.environ)
    bin_dir = str(Path(sys.executable).parent)
    env["PATH"] = bin_dir + os.pathsep + env.get("PATH", "")
    env.setdefault("DVC_NO_ANALYTICS", "1")
    env.setdefault("TQDM_MININTERVAL", "5")  # progress lines every 5 s in logs, not every 0.1 s
    env.setdefault("PYTHONUNBUFFERED", "1")
    if extra:
        env.update(extra)
    return env


def dvc_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "dvc", *args]


def run_streaming(cmd: list[str], cwd: Path, env: dict[str, str], on_line: Callable[[str], None]) -> tuple[int, str]:
    """Run `cmd`, passing each output line (split on \\n and \\r) to `on_line`. Returns (status, tail)."""
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    tail: list[str] = []
    buf = b""
    assert proc.stdout is not None
    try:
        while chunk := proc.stdout.read1(65536):
            buf += chunk
            *lines, buf = re.split(rb"[\r\n]", buf)
            for raw in lines:
                line = raw.decode("utf-8", "replace").rstrip()
                if line:
                    on_line(line)
                    tail = (tail + [line])[-40:]
        if buf.strip():
            on_line(buf.decode("utf-8", "replace").rstrip())
            tail.append(buf.decode("utf-8", "replace").rstrip())
        return proc.wait(), "\n".join(tail)
    finally:
        if proc.poll() is None:  # interrupted (timeout, cancel): do not leave the stage running
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()


def stage_exit_status(dvc_status: int, output_tail: str) -> int:
    """The exit status of the stage command inside `dvc repro` (DVC reports it in its message)."""
    found = _DVC_CHILD_EXIT.findall(output_tail)
    return int(found[-1]) if found else dvc_status


def repro(root: Path, stage: str | None = None, on_line: Callable[[str], None] = print,
          env_extra: dict[str, str] | None = None) -> tuple[int, str]:
    """`dvc repro` (or `dvc repro --single-item STAGE`) in `root`."""
    args = ["repro"] + (["--single-item", stage] if stage else [])
    return run_streaming(dvc_command(*args), Path(root), subprocess_env(env_extra), on_line)


def write_params(path: Path, overrides: list[str] | dict) -> bool:
    """Validate overrides against the params file, then write them into it, keeping its
    comments and layout (what `dvc exp run --set-param` does). Returns True if the file changed.
    Raises ConfigError naming the key before anything is written."""
    path = Path(path)
    raw = read_params(path)
    config_from_dict(apply_overrides(raw, overrides))  # one-line error on a bad key or value
    from ruamel.yaml import YAML  # comes with dvc

    yaml = YAML()
    yaml.preserve_quotes = True
    doc = yaml.load(path.read_text(encoding="utf-8"))
    items = overrides.items() if isinstance(overrides, dict) else (parse_override(o) for o in overrides)
    changed = False
    for key, value in items:
        keys = key.split(".") if isinstance(key, str) else list(key)
        node = doc
        for part in keys[:-1]:
            if part not in node:
                node[part] = {}
            node = node[part]
        if node.get(keys[-1], object()) != value:
            node[keys[-1]] = value
            changed = True
    if changed:
        from io import StringIO

        from laplace.fileio import atomic_write_bytes

        out = StringIO()
        yaml.dump(doc, out)
        atomic_write_bytes(path, out.getvalue().encode("utf-8"))
    return changed


__all__ = ["ConfigError", "USER_ERROR_EXIT", "repro", "run_streaming", "stage_exit_status", "subprocess_env",
           "write_params", "dvc_command"]
