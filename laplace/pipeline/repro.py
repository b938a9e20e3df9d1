"""Driving DVC from Python: `dvc repro` run as a subprocess whose output is streamed line by line.

The CLI's `laplace run` and the Prefect flow both go through here (after writing their
overrides into params.yaml, `laplace.pipeline.params.write_params`), so whichever front
door launched the pipeline, dvc.lock records exactly the params that produced the
outputs and `dvc status` is clean afterwards.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from laplace.processes import child_dies_with_us

_DVC_CHILD_EXIT = re.compile(r"exited with (\d+)")


def subprocess_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment for DVC and the stage commands it runs: this interpreter's bin first on
    PATH (so `laplace` resolves without an activated venv), no analytics (DVC, MLflow), slow progress bars."""
    env = dict(os.environ)
    bin_dir = str(Path(sys.executable).parent)
    env["PATH"] = bin_dir + os.pathsep + env.get("PATH", "")
    env.setdefault("DVC_NO_ANALYTICS", "1")
    env.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    # log_model's check of the input example "downloads" the model it just wrote: 6 bar lines in a log
    env.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    env.setdefault("TQDM_MININTERVAL", "5")  # progress lines every 5 s in logs, not every 0.1 s
    env.setdefault("PYTHONUNBUFFERED", "1")
    if extra:
        env.update(extra)
    return env


class WithoutGitHints:
    """Passes DVC's output lines on, less its closing hint ("To track the changes with git, run:"
    and the `git add` line, "To enable auto staging, run:" and its `dvc config` line). The
    Prefect flow runs `dvc repro` once per stage, so the hint would follow each of them; the flow
    says once at its end what to commit."""

    HINTS = ("To track the changes with git, run:", "To enable auto staging, run:")

    def __init__(self, on_line: Callable[[str], None]):
        self.on_line, self.skip_next = on_line, False

    def __call__(self, line: str) -> None:
        if self.skip_next:
            self.skip_next = False
            if line.strip().startswith(("git add", "dvc config")):
                return
        if line.strip() in self.HINTS:
            self.skip_next = True
            return
        self.on_line(line)


def dvc_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "dvc", *args]


def run_streaming(cmd: list[str], cwd: Path, env: dict[str, str], on_line: Callable[[str], None]) -> tuple[int, str]:
    """Run `cmd`, passing each output line (split on \\n and \\r) to `on_line`. Returns (status, tail)."""
    # SIGTERM to the child (dvc repro, a stage worker, torchrun's agent) when this process dies, even
    # by SIGKILL (a Prefect flow run killed, `laplace run` killed): nothing runs on unowned
    proc = subprocess.Popen(
        cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, preexec_fn=child_dies_with_us()
    )
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


def repro(
    root: Path,
    stage: str | None = None,
    on_line: Callable[[str], None] = print,
    env_extra: dict[str, str] | None = None,
) -> tuple[int, str]:
    """`dvc repro` (or `dvc repro --single-item STAGE`) in `root`."""
    args = ["repro"] + (["--single-item", stage] if stage else [])
    return run_streaming(dvc_command(*args), Path(root), subprocess_env(env_extra), on_line)
