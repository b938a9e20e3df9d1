"""A training job's life: one job per project, every process of it dies with its launcher, and
SIGTERM stops it at a step boundary with a checkpoint when there is time for one.

The process tree of a multi-rank `laplace train`:

    laplace train (holds runs/.train-node<N>.lock)
      python -m laplace.training.launch   torchrun's agent (PR_SET_PDEATHSIG: SIGKILL)
        rank 0 .. rank W-1                 each in its own session, as torchrun starts them
                                           (PR_SET_PDEATHSIG: SIGKILL)

- SIGKILL of `laplace train`: the kernel kills the agent (its death signal), and the agent's
  death kills every rank (theirs). Nothing outlives it by more than the kernel's reaping.
- SIGTERM of `laplace train`: it terminates the agent (laplace.pipeline.repro.run_streaming's
  cleanup), torchrun's agent SIGTERMs every rank and waits up to AGENT_GRACE_S before SIGKILL;
  each rank's handler only sets a flag, the ranks agree on it after every step (one all-reduce
  of one integer), save a checkpoint if the last save took less than the grace left, and exit.
- `laplace train` itself dies with SIGTERM when its own parent (DVC, a Prefect task) dies, so a
  killed `dvc repro` stops the job the graceful way.

The death signal is Linux's prctl(PR_SET_PDEATHSIG), as the tokenize stage's process pool uses;
elsewhere the calls are no-ops. The lock is fcntl.flock: the kernel drops it when its holder
dies, however it dies, so a killed job never keeps the project. No torch at import (the stage
registry imports this module).
"""

from __future__ import annotations

import fcntl
import os
import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

from laplace.errors import Failure, InputError
from laplace.processes import die_with_parent

if TYPE_CHECKING:
    import torch

AGENT_PID_ENV = "LAPLACE_AGENT_PID"  # set by laplace.training.launch for its ranks
LAUNCHER_PID_ENV = "LAPLACE_LAUNCHER_PID"  # set by `laplace train` for the agent
AGENT_GRACE_S = 30  # torchrun's agent: SIGTERM to the ranks, then SIGKILL after this long
SAVE_MARGIN_S = 5  # a checkpoint is attempted only if the last one took this much less than the grace left


class ProjectBusy(InputError):
    """Another `laplace train` holds this project: exit 2, one line."""


class TrainingStopped(Failure):
    """Stopped by SIGTERM at a step boundary (exit status 143, as a process killed by SIGTERM)."""

    exit_status = 128 + signal.SIGTERM


def die_with_agent() -> None:
    """A torchrun rank started by laplace.training.launch: die when the agent does."""
    agent = os.environ.get(AGENT_PID_ENV)
    if agent:
        die_with_parent(signal.SIGKILL, int(agent))


# --------------------------------------------------------------------------- the project lock


@contextmanager
def project_lock(path: Path) -> Iterator[None]:
    """Hold `path` (an flock) for the block; ProjectBusy if another process holds it. The fd is not
    inherited by children (PEP 446), so it is this process's alone."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "?"
            raise ProjectBusy(
                f"another `laplace train` (pid {holder}) is training this project ({path}): "
                "wait for it to finish or stop it first"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        yield
    finally:
        os.close(fd)  # releases the lock


# --------------------------------------------------------------------------- SIGTERM


class _StopFlag:
    requested_at: float | None = None


_flag = _StopFlag()


def _on_sigterm(signum, frame) -> None:
    if _flag.requested_at is None:
        _flag.requested_at = time.monotonic()


@contextmanager
def stop_on_sigterm() -> Iterator[None]:
    """For the block, SIGTERM only sets a flag that `stop_requested` reads at the next step
    boundary (in the main thread only: Python delivers signals there)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    _flag.requested_at = None
    previous = signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
        _flag.requested_at = None


def stop_requested(device: torch.device) -> bool:
    """Collective: True on every rank when any rank got SIGTERM (so they stop at the same step)."""
    import torch
    import torch.distributed as dist

    t = torch.tensor([0 if _flag.requested_at is None else 1], dtype=torch.long, device=device)
    if dist.is_initialized():
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    if int(t.item()) and _flag.requested_at is None:  # another rank's signal: this rank's grace starts now
        _flag.requested_at = time.monotonic()
    return bool(t.item())


def time_to_save(last_save_seconds: float | None, device: torch.device) -> bool:
    """Collective: rank 0 decides whether a checkpoint fits in what is left of the agent's grace
    (its last save's duration plus a margin; the first save of a run is always tried)."""
    from laplace.training.distributed import broadcast_int

    left = AGENT_GRACE_S - (time.monotonic() - (_flag.requested_at or time.monotonic()))
    fits = last_save_seconds is None or last_save_seconds + SAVE_MARGIN_S < left
    return bool(broadcast_int(int(fits), device))


@contextmanager
def sigterm_raises(message: str) -> Iterator[None]:
    """For the block (the launcher's wait on torchrun), SIGTERM raises TrainingStopped: the
    unwinding terminates the agent, which gives the ranks their grace, then SIGKILLs them."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # once: the agent's shutdown is under way
        raise TrainingStopped(message)

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
