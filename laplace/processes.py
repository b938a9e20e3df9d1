"""Processes that die with their parent: Linux's prctl(PR_SET_PDEATHSIG), the one mechanism that
holds when the parent is SIGKILLed (no handler of the parent's runs then). Used by the tokenize
workers, torchrun's agent and ranks, and every child the pipeline starts (dvc repro, stage workers);
and the CPU-seconds of the children a process has reaped (start-up costs measured robustly to load)."""

from __future__ import annotations

import ctypes
import os
import signal
import sys
from collections.abc import Callable

PR_SET_PDEATHSIG = 1
# the line torchrun's agent (laplace.training.launch) prints when a rank died; the stage worker's
# parent (laplace.pipeline.workers) reads it. Here, below both, so a stage that merely runs a
# worker does not depend on the training modules.
AGENT_FAILED_MARK = "laplace.training.launch: failed: "


def die_with_parent(sig: int = signal.SIGKILL, expected_parent: int | None = None) -> None:
    """Ask the kernel to send `sig` to this process when its parent dies. If the parent is
    already gone (it died before the call: we were re-parented), exit at once."""
    if sys.platform != "linux":
        return
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(sig))
    if expected_parent is not None and os.getppid() != expected_parent:
        os._exit(128 + int(sig))


def child_dies_with_us(sig: int = signal.SIGTERM) -> Callable[[], None] | None:
    """A subprocess preexec_fn: the child gets `sig` when this process dies. libc is loaded here, in
    the parent, so the child (between fork and exec, where other threads' locks may be held) makes
    only the one system call. None off Linux."""
    if sys.platform != "linux":
        return None
    prctl = ctypes.CDLL(None, use_errno=True).prctl
    return lambda: prctl(PR_SET_PDEATHSIG, int(sig))


def reaped_children_cpu_s() -> float:
    """CPU-seconds (user + system) of every child this process has reaped so far, with the children
    they reaped: the difference across a worker's run is that worker's process tree, which a
    loaded machine does not inflate as it does wall-clock time."""
    import resource

    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime
