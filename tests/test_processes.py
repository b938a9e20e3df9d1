"""Children die with their parent: a process that laplace.pipeline.repro.run_streaming started (dvc
repro under a Prefect flow run or `laplace run`, a stage worker) gets SIGTERM when its parent is
SIGKILLed, so nothing of a killed run keeps running."""

import os
import signal
import subprocess
import sys
import time

import pytest

RUNNER = """
import sys
from pathlib import Path
from laplace.pipeline.repro import run_streaming
run_streaming([sys.executable, "-c", "import os, time; print(os.getpid(), flush=True); time.sleep(120)"],
              Path("."), None, lambda line: print("child", line, flush=True))
"""


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has exited
    except FileNotFoundError:
        return False


@pytest.mark.skipif(sys.platform != "linux", reason="PR_SET_PDEATHSIG is Linux's")
def test_a_child_of_run_streaming_dies_when_its_parent_is_sigkilled():
    runner = subprocess.Popen([sys.executable, "-c", RUNNER], stdout=subprocess.PIPE, text=True)
    try:
        line = runner.stdout.readline()
        assert line.startswith("child "), line
        child = int(line.split()[1])
        assert alive(child)
        os.kill(runner.pid, signal.SIGKILL)
        runner.wait(timeout=10)
        deadline = time.monotonic() + 10
        while alive(child) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not alive(child), f"the child {child} outlived its SIGKILLed parent by 10 s"
    finally:
        runner.kill()
        runner.wait(timeout=10)


def test_a_failed_ranks_error_line_reaches_the_agents_one_line_verdict(tmp_path, monkeypatch):
    """The file a rank writes (lifecycle.record_error, where torchrun's TORCHELASTIC_ERROR_FILE
    points) is read by torchrun's own ProcessFailure, and the agent's verdict quotes its line;
    the agent's SIGTERM of the surviving rank is not taken for the cause."""
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    from laplace.training.launch import describe_failure
    from laplace.training.lifecycle import ERROR_FILE_ENV, record_error

    error_file = tmp_path / "error.json"
    monkeypatch.setenv(ERROR_FILE_ENV, str(error_file))
    record_error(OSError("No space left on device: 'runs/train/checkpoints'\nmore detail"))
    failures = {
        0: ProcessFailure(local_rank=0, pid=100, exitcode=-signal.SIGTERM, error_file=str(tmp_path / "none.json")),
        1: ProcessFailure(local_rank=1, pid=101, exitcode=1, error_file=str(error_file)),
    }
    line = describe_failure(failures)
    assert line == (
        "rank 1 (local rank 1, pid 101) exited with status 1; its last error: OSError: No space left on "
        "device: 'runs/train/checkpoints'; then rank 0 failed too"
    ), line
