"""The tokenize stage's worker pool: spawned processes that die with the stage.

Ours (multiprocessing, not datasets.map) so that the workers die with the stage: they get
SIGKILL when the stage process dies (PR_SET_PDEATHSIG) and are terminated when it fails or
gets SIGTERM.
"""

from __future__ import annotations

import contextlib
import ctypes
import multiprocessing
import os
import signal
import sys
from collections.abc import Callable, Iterator


def die_with_parent(parent: int) -> None:
    """Pool initializer: exit when the stage process dies, whatever kills it (SIGKILL included)."""
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one thread per worker: the pool is the parallelism
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides; it terminates us
    if sys.platform == "linux":
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:  # the parent died before prctl
        os._exit(1)


@contextlib.contextmanager
def sigterm_unwinds():
    """SIGTERM raises SystemExit in the main thread, so `finally` blocks stop the workers and tidy up."""
    if multiprocessing.current_process().name != "MainProcess" or not _is_main_thread():
        yield
        return

    def handler(signum, frame):
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _is_main_thread() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()


@contextlib.contextmanager
def process_pool(num_proc: int) -> Iterator[Callable]:
    """map_unordered(fn, jobs): in num_proc spawned workers, or in this process when num_proc is 1."""
    if num_proc <= 1:
        yield lambda fn, jobs: map(fn, jobs)
        return
    pool = multiprocessing.get_context("spawn").Pool(num_proc, initializer=die_with_parent, initargs=(os.getpid(),))
    try:
        yield lambda fn, jobs: pool.imap_unordered(fn, jobs)
        pool.close()
        pool.join()
    finally:
        pool.terminate()  # no-op after a clean join; kills the workers on any failure or SIGTERM
        pool.join()
