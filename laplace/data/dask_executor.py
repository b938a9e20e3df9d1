"""Tokenize's slices on a Dask cluster (data.executor: dask): the same jobs as the local pool,
submitted with distributed's own client, so the head process only plans and assembles.

Dask's client is the executor (the project writes none of its own): `Client.submit` for each
job and `as_completed` for the results, not Prefect tasks inside Dask workers, so no Prefect
server is started anywhere and a worker runs a slice as plain work. Three rules of ours on top:

* a job's finished result is persisted by the job itself (the encode's slice record, the
  survey's result file, both under the staging directory) and its future is released as soon as
  it is read, so a worker that dies later holds nothing the scheduler would recompute (the
  recomputation of finished tasks when a worker dies, PrefectHQ/prefect 15442, needs futures
  still referenced); a job run again returns its persisted result at once. Every run of a job
  is counted (pool.record_run), so a recompute would show in `slices_rerun`;
* at most data.dask_in_flight jobs are submitted at a time (waves: the next goes in as one
  finishes), so 100k slices never sit in the scheduler at once;
* a `KilledWorker` (the scheduler gave up on a job whose workers kept dying) is resubmitted
  twice, then a WorkerDied (a crash, exit status 1, retried by the flow), never bad input.

distributed is imported here only, and lazily: `executor: local` never loads it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import uuid
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

from laplace.data.pool import WorkerDied, fix_mmap_threshold, record_run
from laplace.errors import Failure, one_line

log = logging.getLogger(__name__)

_RESUBMITS = 2  # a job lost with its worker (KilledWorker) goes back this many times
_CONNECT_TIMEOUT_S = 10  # a scheduler that exists answers at once; an absent one is a quick, retried failure


class SchedulerUnreachable(Failure):
    """The Dask scheduler (data.dask_address) did not answer: not the input's fault, retried."""


_PREPARED = False


def _on_worker(fn: Callable, job, name: str, ledger: str):
    """One job on a Dask worker, as plain work: the worker set up as the local pool's are (one
    tokenizer thread, a fixed mmap threshold), the run counted in the ledger."""
    global _PREPARED
    if not _PREPARED:
        os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one thread per worker: the cluster is the parallelism
        fix_mmap_threshold()
        _PREPARED = True
    record_run(ledger, name)
    return fn(job)


class DaskWorkers:
    """The local pool's interface (map_unordered, call, small) on a Dask client."""

    kind = "dask"

    def __init__(self, client, ledger: Path, in_flight: int):
        self.client, self.ledger, self.in_flight = client, Path(ledger), in_flight
        self.resubmitted = 0

    @property
    def num_proc(self) -> int:
        return len(self.client.scheduler_info(n_workers=-1)["workers"])

    def _submit(self, fn: Callable, job, name: str, attempt: int):
        key = f"laplace-{name.replace(' ', '-').replace('(', '').replace(')', '')}-{attempt}-{uuid.uuid4().hex[:8]}"
        return self.client.submit(_on_worker, fn, job, name, str(self.ledger), key=key, pure=False, retries=0)

    def map_unordered(self, fn: Callable, jobs: Iterable, name: Callable[[object], str]) -> Iterator:
        """fn(job) for every job on the cluster, yielded as each finishes (at most in_flight submitted)."""
        from distributed import as_completed
        from distributed.scheduler import KilledWorker

        pending = iter(jobs)
        futures: dict = {}  # future -> (job, attempt)

        def submit_next(ac) -> None:
            job = next(pending, None)
            if job is not None:
                future = self._submit(fn, job, name(job), 0)
                futures[future] = (job, 0)
                ac.add(future)

        ac = as_completed(loop=self.client.loop)
        try:
            for _ in range(self.in_flight):
                submit_next(ac)
            for future in ac:
                job, attempt = futures.pop(future)
                try:
                    result = future.result()
                except KilledWorker as exc:
                    if attempt >= _RESUBMITS:
                        raise WorkerDied(
                            f"tokenize: Dask workers kept dying while they held {name(job)} ({one_line(exc)}); "
                            "rerun to resume"
                        ) from None
                    log.warning("%s lost with its Dask worker (%s): submitted again", name(job), one_line(exc))
                    self.resubmitted += 1
                    again = self._submit(fn, job, name(job), attempt + 1)
                    futures[again] = (job, attempt + 1)
                    ac.add(again)
                    continue
                finally:
                    future.release()  # the result is persisted by the job; the cluster keeps nothing
                submit_next(ac)
                yield result
        finally:
            if futures:
                self.client.cancel(list(futures))

    def call(self, fn: Callable, job, name: str):
        """fn(job) on one Dask worker (the tokenizer's training: the head only plans)."""
        (result,) = self.map_unordered(fn, [job], lambda _: name)
        return result

    small = call  # the sample's merge reads the slices' files: on a worker too


# distributed's periodic work that a batch of slices does not need, each costing CPU in every process
# for the whole run: the statistical profiler (a stack sample every 10 ms per worker), work stealing,
# the event-loop tick (20 ms), the system monitor (500 ms) and the nanny's memory monitor (100 ms).
# Measured on an idle LocalCluster of 2 workers here: 0.10 CPU-s per second of wall without these
# settings, 0.035 with them (bench/RESULTS.md). They apply to the processes the stage starts (a
# LocalCluster: nannies pass the config to their workers) and to its client; workers started with
# `dask worker` read their own configuration (docs/data.md).
QUIET = {
    "distributed.worker.profile.enabled": False,
    "distributed.scheduler.work-stealing": False,
    "distributed.admin.tick.interval": "1s",
    "distributed.admin.system-monitor.interval": "5s",
    "distributed.worker.memory.monitor-interval": "1s",
}


@contextlib.contextmanager
def dask_pool(address: str, workers: int, ledger: Path, in_flight: int) -> Iterator[DaskWorkers]:
    """A client on the scheduler at `address`, or on a LocalCluster of `workers` single-threaded
    worker processes on loopback; closed (the LocalCluster's processes stopped) however it is left."""
    import dask
    from distributed import Client, LocalCluster

    with contextlib.ExitStack() as stack:
        stack.enter_context(dask.config.set(QUIET))
        if address:
            try:
                client = stack.enter_context(Client(address, timeout=_CONNECT_TIMEOUT_S, set_as_default=False))
            except (OSError, TimeoutError) as exc:
                raise SchedulerUnreachable(
                    f"data.dask_address: no Dask scheduler answered at {address} ({one_line(exc)}); "
                    "start one (`dask scheduler`) or empty the knob for a LocalCluster"
                ) from None
        else:
            cluster = stack.enter_context(
                LocalCluster(
                    n_workers=workers,
                    threads_per_worker=1,
                    processes=True,
                    host="127.0.0.1",
                    dashboard_address=None,
                    silence_logs=logging.WARNING,
                )
            )
            client = stack.enter_context(Client(cluster, set_as_default=False))
        yield DaskWorkers(client, ledger, in_flight)
