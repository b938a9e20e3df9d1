"""`make stop`: end every background server the Makefile started (the MLflow UI, the Prefect
server, the Prefect worker and the flow runs it started), and all they started.

Each server target records its `make` process in runs/servers/<target>.pid before it starts
anything. A Prefect flow run, and the dvc repro, stage workers and torchrun ranks under it, run
in sessions of their own, so neither the shell's job list nor a process group reaches them: the
process tree does (parent links, read before any signal, since an orphan is re-parented away).
Everything in it gets SIGTERM at once, STOP_GRACE_S to exit (a training rank checkpoints at its
next step), then SIGKILL. Bounded: it never waits longer. Prefect's worker turns a first SIGTERM
into its graceful shutdown, which did not end with no flow run left (still running after 20 s), and
a second SIGTERM into SIGKILL (prefect.utilities.processutils.setup_signal_handlers_worker): it gets
that second one after WORKER_SECOND_SIGTERM_S, while its flow runs keep the whole grace."""

from __future__ import annotations

import argparse
import os
import signal
import sys
from pathlib import Path

import psutil

STOP_GRACE_S = 20.0
KILL_WAIT_S = 5.0
WORKER_SECOND_SIGTERM_S = 2.0


def recorded(pid_file: Path) -> psutil.Process | None:
    """The process a pid file names, when it is still the one that wrote it (a pid reused by a
    later process started after the file was written is not)."""
    try:
        pid = int(pid_file.read_text().split()[0])
        proc = psutil.Process(pid)
        if proc.create_time() > pid_file.stat().st_mtime + 1:
            return None
        return proc
    except (OSError, ValueError, IndexError, psutil.Error):
        return None


def tree(procs: list[psutil.Process]) -> list[psutil.Process]:
    """The processes and every descendant, each once."""
    seen: dict[int, psutil.Process] = {}
    for proc in procs:
        try:
            for p in [proc, *proc.children(recursive=True)]:
                seen.setdefault(p.pid, p)
        except psutil.Error:
            continue
    return list(seen.values())


def is_prefect_worker(proc: psutil.Process) -> bool:
    """`prefect worker start ...`, as the Makefile's prefect-worker target runs it."""
    try:
        command = proc.cmdline()
    except psutil.Error:
        return False
    for i, arg in enumerate(command[:2]):  # the prefect script, or the interpreter running it
        if os.path.basename(arg) == "prefect":
            return command[i + 1 : i + 3] == ["worker", "start"]
    return False


def signal_all(procs: list[psutil.Process], sig: int) -> None:
    for p in procs:
        try:
            p.send_signal(sig)
        except psutil.Error:
            pass


def stop(pid_dir: Path, grace_s: float = STOP_GRACE_S) -> int:
    """Stop what the pid files in `pid_dir` name; one line per server. 0, or 1 when a process
    outlived SIGKILL."""
    files = sorted(Path(pid_dir).glob("*.pid"))
    servers = {f.stem: recorded(f) for f in files}
    running = {name: proc for name, proc in servers.items() if proc is not None}
    if not running:
        print("make stop: no server of this project is running")
    procs = tree(list(running.values()))
    counts = {name: len(tree([proc])) for name, proc in running.items()}
    signal_all(procs, signal.SIGTERM)
    _, alive = psutil.wait_procs(procs, timeout=min(grace_s, WORKER_SECOND_SIGTERM_S))
    signal_all([p for p in alive if is_prefect_worker(p)], signal.SIGTERM)
    _, alive = psutil.wait_procs(alive, timeout=max(0.0, grace_s - WORKER_SECOND_SIGTERM_S))
    killed = tree(alive)  # and whatever they started meanwhile
    signal_all(killed, signal.SIGKILL)
    _, left = psutil.wait_procs(killed, timeout=KILL_WAIT_S)
    for name, n in counts.items():
        print(f"make stop: stopped {name} ({n} process{'es' if n != 1 else ''})")
    if killed:
        print(f"make stop: {len(killed)} process(es) ignored SIGTERM for {grace_s:.0f} s: killed with SIGKILL")
    for f in files:
        f.unlink(missing_ok=True)
    if left:
        pids = ", ".join(str(p.pid) for p in left)
        print(f"make stop: error: still running after SIGKILL: {pids}", file=sys.stderr)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="make stop", description=__doc__.splitlines()[0])
    parser.add_argument("pid_dir", type=Path)
    parser.add_argument("--grace-s", type=float, default=float(os.environ.get("STOP_GRACE_S", STOP_GRACE_S)))
    args = parser.parse_args(argv)
    return stop(args.pid_dir, args.grace_s)


if __name__ == "__main__":
    sys.exit(main())
