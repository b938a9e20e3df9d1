"""A training job's life: one job per project, every process of it dies with its launcher, and
SIGTERM or SIGINT (Ctrl-C) stops it at a step boundary with a checkpoint when there is time for one.

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
- Ctrl-C (SIGINT to the foreground process group: `laplace train` and the agent; the ranks sit in
  sessions of their own): torchrun's agent sends the ranks SIGINT, not SIGTERM, so the ranks treat
  SIGINT exactly as SIGTERM (`stop_on_sigterm`), and `laplace train` ends with one line, exit 130.
  The agent acts on the first signal only (laplace.training.launch): a second one (the launcher's
  SIGTERM after the terminal's SIGINT) would cut its wait for the ranks' checkpoint short.
- `laplace train` itself dies with SIGTERM when its own parent (DVC, a Prefect task) dies, so a
  killed `dvc repro` stops the job the graceful way.
- A rank that fails writes its error line into the file torchrun names (TORCHELASTIC_ERROR_FILE,
  `record_error`), so the agent's one-line verdict names the rank, its exit code or signal and
  that line (laplace.training.launch.describe_failure).

The death signal is Linux's prctl(PR_SET_PDEATHSIG), as the tokenize stage's process pool uses;
elsewhere the calls are no-ops. The lock is fcntl.flock: the kernel drops it when its holder
dies, however it dies, so a killed job never keeps the project. No torch at import (the stage
registry imports this module).
"""

from __future__ import annotations

import fcntl
import json
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


STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)  # torchrun's agent forwards either to the ranks as it got it


class TrainingStopped(Failure):
    """Stopped by SIGTERM or SIGINT at a step boundary (exit status 128 + the signal, as a process
    killed by it: 143, 130)."""

    def __init__(self, message: str, signum: int = signal.SIGTERM):
        super().__init__(message)
        self.exit_status = 128 + int(signum)


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


# --------------------------------------------------------------------------- SIGTERM, SIGINT


class _StopFlag:
    requested_at: float | None = None
    signum: int = signal.SIGTERM


_flag = _StopFlag()


def _on_stop_signal(signum, frame) -> None:
    if _flag.requested_at is None:
        _flag.requested_at = time.monotonic()
        _flag.signum = signum


def stop_signal() -> tuple[str, int]:
    """(name, number) of the signal that asked this rank to stop (SIGTERM when another rank's did)."""
    return signal.Signals(_flag.signum).name, int(_flag.signum)


@contextmanager
def stop_on_sigterm() -> Iterator[None]:
    """For the block, SIGTERM and SIGINT only set a flag that `stop_requested` reads at the next
    step boundary (in the main thread only: Python delivers signals there). SIGINT is what
    torchrun's agent forwards on Ctrl-C; without this it would be a KeyboardInterrupt mid-step."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    _flag.requested_at, _flag.signum = None, signal.SIGTERM
    previous = {s: signal.signal(s, _on_stop_signal) for s in STOP_SIGNALS}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
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
    """For the block (the launcher's wait on torchrun), SIGTERM or SIGINT raises TrainingStopped
    (`message` with {signal} filled in): the unwinding terminates the agent, which gives the ranks
    their grace, then SIGKILLs them. No KeyboardInterrupt traceback on Ctrl-C: one line, exit 130."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame):
        for s in STOP_SIGNALS:  # once: the agent's shutdown is under way
            signal.signal(s, signal.SIG_IGN)
        raise TrainingStopped(message.format(signal=signal.Signals(signum).name), signum)

    previous = {s: signal.signal(s, handler) for s in STOP_SIGNALS}
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


# --------------------------------------------------------------------------- a failed rank's line

ERROR_FILE_ENV = "TORCHELASTIC_ERROR_FILE"  # torchrun sets it per rank; its agent reads it when the rank fails


def record_error(exc: BaseException) -> None:
    """Write a failing rank's one error line where torchrun's agent looks for it (the format its
    ProcessFailure reads: {"message": str, "timestamp": int}). torch's own `record` decorator
    writes the same file, but only for exceptions that escape; the ranks catch theirs to print
    one line, so they write it here."""
    path = os.environ.get(ERROR_FILE_ENV)
    if not path:
        return
    text = str(exc).strip().splitlines()
    line = f"{type(exc).__name__}: {text[0] if text else ''}".rstrip(": ")
    try:
        with open(path, "w") as fp:
            json.dump({"message": line, "timestamp": int(time.time())}, fp)
    except OSError:
        pass  # the verdict then says only how the rank ended
