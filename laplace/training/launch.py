"""torchrun's agent, tied to the `laplace train` that started it.

`python -m laplace.training.launch ARGS` is `python -m torch.distributed.run ARGS` run in this
process after two settings: the kernel kills this agent when its parent dies (PR_SET_PDEATHSIG,
also when the parent was SIGKILLed), and the ranks learn this agent's pid, so each of them dies
with it in turn (laplace.training.lifecycle.die_with_agent). torchrun starts its ranks in their
own sessions, so nothing else would reach them.

Two more things torchrun does not do for us:
- it acts on the first SIGTERM/SIGINT only: torchrun's handler raises on every signal, so a
  second one (the terminal's SIGINT, then the launcher's SIGTERM) would interrupt the agent's
  wait for its ranks' stop checkpoint and let their death signals kill them mid-write;
- it ends with one line: a stop signal exits 128 + the signal, no traceback; a dead rank is
  one line naming the rank, its exit code or signal and its last error line
  (`describe_failure`), where torchrun prints a 20-line report between `=====` rules.
"""

from __future__ import annotations

import os
import signal
import sys

from laplace.processes import AGENT_FAILED_MARK as FAILED_MARK  # the verdict line laplace.pipeline.workers reads
from laplace.training.lifecycle import AGENT_PID_ENV, LAUNCHER_PID_ENV, die_with_parent


def describe_failure(failures: dict) -> str:
    """One line from torchrun's {global rank: ProcessFailure}: the root cause first. A rank killed
    by a signal from outside is the cause when there is one (its peers then fail in their
    collectives, often within the same second, so torchrun's timestamps cannot tell them apart);
    then a rank that exited with an error; last the ranks the agent itself SIGTERMed after it."""

    def how(f) -> str:
        if f.exitcode < 0:
            return f"was killed by signal {f.signal_name()} ({-f.exitcode})"
        return f"exited with status {f.exitcode}"

    def error_line(f) -> str:
        message = f.message if isinstance(f.message, str) else (f.message or {}).get("message", "")
        if not f.error_file or f.error_file == "<N/A>" or not message:
            return "it wrote no error line" + (" (a signal leaves none)" if f.exitcode < 0 else "")
        return f"its last error: {str(message).strip().splitlines()[0]}"

    def order(r):
        code = failures[r].exitcode
        return (0 if code < 0 and code != -signal.SIGTERM else 1 if code > 0 else 2, failures[r].timestamp, r)

    ranks = sorted(failures, key=order)
    first = failures[ranks[0]]
    line = f"rank {ranks[0]} (local rank {first.local_rank}, pid {first.pid}) {how(first)}; {error_line(first)}"
    if len(ranks) > 1:
        line += f"; then rank{'s' if len(ranks) > 2 else ''} {', '.join(map(str, ranks[1:]))} failed too"
    return line


def _first_signal_only(handler):
    def once(signum, frame):
        for s in (signal.SIGTERM, signal.SIGINT):
            signal.signal(s, signal.SIG_IGN)
        handler(signum, frame)

    return once


def main(argv: list[str] | None = None) -> None:
    launcher = os.environ.get(LAUNCHER_PID_ENV)
    die_with_parent(signal.SIGKILL, int(launcher) if launcher else None)
    os.environ[AGENT_PID_ENV] = str(os.getpid())  # the ranks inherit the agent's environment
    from torch.distributed.elastic.multiprocessing import SignalException
    from torch.distributed.elastic.multiprocessing import api as processes
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun

    # torchrun installs this handler when it starts the ranks (it looks the name up then)
    processes._terminate_process_handler = _first_signal_only(processes._terminate_process_handler)
    try:
        torchrun(sys.argv[1:] if argv is None else argv)
    except SignalException as exc:  # the ranks got the signal and had their grace
        sys.exit(128 + int(exc.sigval))
    except ChildFailedError as exc:
        print(FAILED_MARK + describe_failure(exc.failures), file=sys.stderr, flush=True)
        sys.exit(1)


if __name__ == "__main__":
    main()
