"""torchrun's agent, tied to the `laplace train` that started it.

`python -m laplace.training.launch ARGS` is `python -m torch.distributed.run ARGS` run in this
process after two settings: the kernel kills this agent when its parent dies (PR_SET_PDEATHSIG,
also when the parent was SIGKILLed), and the ranks learn this agent's pid, so each of them dies
with it in turn (laplace.training.lifecycle.die_with_agent). torchrun starts its ranks in their
own sessions, so nothing else would reach them.
"""

from __future__ import annotations

import os
import signal
import sys

from laplace.training.lifecycle import AGENT_PID_ENV, LAUNCHER_PID_ENV, die_with_parent


def main(argv: list[str] | None = None) -> None:
    launcher = os.environ.get(LAUNCHER_PID_ENV)
    die_with_parent(signal.SIGKILL, int(launcher) if launcher else None)
    os.environ[AGENT_PID_ENV] = str(os.getpid())  # the ranks inherit the agent's environment
    from torch.distributed.run import main as torchrun

    torchrun(sys.argv[1:] if argv is None else argv)


if __name__ == "__main__":
    main()
