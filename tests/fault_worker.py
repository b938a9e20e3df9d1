"""A stage worker that fails on request, for tests/test_workers.py."""

import os
import signal
import sys

from laplace.errors import DataError
from laplace.pipeline.workers import worker_main


def body(cfg, args):
    if args.fail == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if args.fail == "input":
        raise DataError("data/tokenized/manifest.json is missing (run the tokenize stage first)")
    if args.fail == "crash":
        raise ZeroDivisionError("a bug")
    return {"seed": cfg.seed}


if __name__ == "__main__":
    sys.exit(worker_main("fault worker", body, options={"fail": {"choices": ["kill", "input", "crash", "none"]}}))
