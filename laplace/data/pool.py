"""The tokenize stage's worker processes: an executor that notices a dead worker, and children
that die with the stage.

concurrent.futures.ProcessPoolExecutor, not multiprocessing.Pool: a Pool worker killed mid-task
(the OOM killer's SIGKILL) is silently replaced and its task never returns, so the stage hangs;
the executor marks itself broken (BrokenProcessPool) and we fail the stage at once, naming the
slice the dead worker held (each job leaves a tag file `<tags>/<pid>` while it runs). Workers get
SIGKILL when the stage process dies (PR_SET_PDEATHSIG) and are killed when it fails or gets
SIGTERM: nothing is left running.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import multiprocessing
import os
import shutil
import signal
import threading
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path

from laplace import processes
from laplace.errors import Failure


class WorkerDied(Failure):
    """A worker process died (killed, out of memory) while it held a job: a crash, retried."""


# glibc's mallopt(M_MMAP_THRESHOLD): buffers above it are mmapped and given back to the system when freed
_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_BYTES = -3, 1 << 20


def fix_mmap_threshold() -> None:
    """Keep glibc's mmap threshold at 1 MiB. By default it rises (up to 32 MiB) each time a large
    buffer is freed, after which a worker's multi-MB records and encodings come from the heap,
    which fragments and grows with the text encoded. On 8 MB records a worker's peak at 100 MB /
    500 MB / 1 GB of corpus went from 144 / 177 / 203 MB to 121 / 144 / 169 MB with it fixed
    (bench/tokenize_worker_memory.py, bench/RESULTS.md). Not glibc (no mallopt): nothing to do."""
    import ctypes

    try:
        ctypes.CDLL(None).mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_BYTES)
    except (AttributeError, OSError):
        pass


def die_with_parent(parent: int) -> None:
    """Worker initializer: exit when the stage process dies, whatever kills it (SIGKILL included);
    a fixed mmap threshold, so its memory is bounded by the batch and not by the text it encoded."""
    fix_mmap_threshold()
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one thread per worker: the pool is the parallelism
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides; it kills us
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    processes.die_with_parent(signal.SIGKILL, expected_parent=parent)


@contextlib.contextmanager
def sigterm_unwinds():
    """SIGTERM raises SystemExit in the main thread, so `finally` blocks stop the workers and tidy up."""
    main = multiprocessing.current_process().name == "MainProcess"
    if not main or threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame):
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def record_run(ledger: str | Path, name: str) -> None:
    """Count one run of the job `name` (a line in `<ledger>/<name>`, appended in one write): a
    job run twice in one stage run (a recompute after a worker died) shows in runs_repeated."""
    path = Path(ledger) / "".join(c if c.isalnum() else "_" for c in name)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.write(fd, f"{name}\t{os.getpid()}\n".encode())
    finally:
        os.close(fd)


def runs_repeated(ledger: Path) -> dict[str, int]:
    """{job: runs beyond its first} for every job that ran more than once (see record_run)."""
    if not ledger.is_dir():
        return {}
    repeated = {}
    for path in sorted(ledger.iterdir()):
        lines = path.read_text().splitlines()
        if len(lines) > 1:
            repeated[lines[0].split("\t")[0]] = len(lines) - 1
    return repeated


def _tagged(fn: Callable, job, name: str, tags: str, ledger: str):
    """Run one job in a worker, leaving `<tags>/<pid>` (the job's name) while it runs."""
    record_run(ledger, name)
    tag = Path(tags) / str(os.getpid())
    tag.write_text(name)
    try:
        return fn(job)
    finally:
        tag.unlink(missing_ok=True)


def _died(pid: int, code: int | None) -> str:
    if code is None:
        return f"worker {pid}"
    if code < 0:
        return f"worker {pid} (killed by {signal.Signals(-code).name})"
    return f"worker {pid} (exit status {code})"


class Workers:
    """Jobs on `num_proc` spawned worker processes (or in this process when num_proc is 1, where
    a crash is a crash of the stage itself), and `call` for one job in a child of its own."""

    kind = "local"

    def __init__(self, num_proc: int, tags: Path, ledger: Path):
        self.num_proc, self.tags, self.ledger = num_proc, Path(tags), Path(ledger)
        self._executors: list[cf.ProcessPoolExecutor] = []
        self._seen: dict = {}  # pid -> multiprocessing.Process, every worker started
        shutil.rmtree(self.tags, ignore_errors=True)  # a killed run's tags name processes long gone
        self.tags.mkdir(parents=True)

    def _executor(self, workers: int) -> cf.ProcessPoolExecutor:
        executor = cf.ProcessPoolExecutor(
            workers,
            mp_context=multiprocessing.get_context("spawn"),
            initializer=die_with_parent,
            initargs=(os.getpid(),),
        )
        self._executors.append(executor)
        return executor

    def map_unordered(self, fn: Callable, jobs: Iterable, name: Callable[[object], str]) -> Iterator:
        """fn(job) for every job, yielded as each finishes; a WorkerDied naming the job a dead worker held."""
        jobs = list(jobs)
        if self.num_proc <= 1 or len(jobs) <= 1:
            for job in jobs:
                record_run(self.ledger, name(job))
                yield fn(job)
            return
        executor = self._executor(min(self.num_proc, len(jobs)))
        futures = {executor.submit(_tagged, fn, j, name(j), str(self.tags), str(self.ledger)): j for j in jobs}
        yield from self._results(executor, futures)
        self._close(executor)

    def call(self, fn: Callable, job, name: str):
        """fn(job) in a child process of its own: SIGTERM (and a kill of the child) stops it at once."""
        executor = self._executor(1)
        futures = {executor.submit(_tagged, fn, job, name, str(self.tags), str(self.ledger)): job}
        (result,) = self._results(executor, futures)
        self._close(executor)
        return result

    def small(self, fn: Callable, job, name: str):
        """fn(job) in this process: light work (the sample's merge) that a child would only delay."""
        record_run(self.ledger, name)
        return fn(job)

    def _results(self, executor: cf.ProcessPoolExecutor, futures: dict) -> Iterator:
        # the executor knows its processes by a private attribute, which it clears once broken:
        # keep the Process objects now (every worker is started by the submits) to name the dead
        self._seen.update(getattr(executor, "_processes", None) or {})
        pending = set(futures)
        while pending:
            # a timeout so that the main thread wakes for signals (SIGTERM -> SystemExit) regularly
            done, pending = cf.wait(pending, timeout=1.0, return_when=cf.FIRST_COMPLETED)
            for future in done:
                try:
                    result = future.result()
                except BrokenProcessPool:
                    self._seen.update(getattr(executor, "_processes", None) or {})
                    raise self._death() from None
                yield result

    def _death(self) -> WorkerDied:
        for process in self._seen.values():
            with contextlib.suppress(Exception):
                process.join(5)  # the executor terminates the survivors of a broken pool
        dead = [(pid, p.exitcode) for pid, p in self._seen.items() if p.exitcode not in (None, 0)]
        # the one that died first, not those the executor then terminated (SIGTERM)
        dead.sort(key=lambda item: item[1] == -signal.SIGTERM)
        tags = {pid: self.tags / str(pid) for pid, _ in dead}
        held = [(pid, code, tags[pid].read_text()) for pid, code in dead if tags[pid].is_file()]
        if held:
            pid, code, job = held[0]
            return WorkerDied(f"tokenize {_died(pid, code)} died while it held {job}; rerun to resume")
        who = ", ".join(_died(pid, code) for pid, code in dead) or "a worker"
        return WorkerDied(f"tokenize {who} died; rerun to resume")

    def _close(self, executor: cf.ProcessPoolExecutor) -> None:
        executor.shutdown(wait=True)
        self._executors.remove(executor)

    def kill(self) -> None:
        """Kill every worker now and reap it (on a failure, SIGTERM or KeyboardInterrupt)."""
        for executor in self._executors:
            processes = list((getattr(executor, "_processes", None) or {}).values())
            for process in processes:
                with contextlib.suppress(Exception):
                    process.kill()
            executor.shutdown(wait=False, cancel_futures=True)
            for process in processes:
                with contextlib.suppress(Exception):
                    process.join(5)
        self._executors.clear()


@contextlib.contextmanager
def process_pool(num_proc: int, tags: Path, ledger: Path) -> Iterator[Workers]:
    """Workers for the stage; every one is killed and reaped on the way out, however it is left."""
    workers = Workers(num_proc, tags, ledger)
    try:
        yield workers
    finally:
        workers.kill()
