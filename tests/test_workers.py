"""A stage worker's verdict crosses the process boundary: bad input stays bad input (exit 2,
never retried), a crash or a kill is a WorkerFailed (retried)."""

from pathlib import Path

import pytest

from laplace.config import Config
from laplace.errors import InputError
from laplace.pipeline.repro import subprocess_env
from laplace.pipeline.workers import WorkerFailed, run_worker

HERE = Path(__file__).parent


def run_fault_worker(tmp_path: Path, fail: str) -> dict:
    env = subprocess_env({"PYTHONPATH": f"{HERE}{':' + e if (e := subprocess_env().get('PYTHONPATH')) else ''}"})
    return run_worker("fault_worker", Config(seed=7), ["--fail", fail], env, tmp_path, tmp_path / "out.json")


def test_a_worker_result_comes_back(tmp_path):
    assert run_fault_worker(tmp_path, "none") == {"seed": 7}


def test_bad_input_in_a_worker_is_an_input_error_with_its_one_line(tmp_path):
    with pytest.raises(
        InputError, match=r"^data/tokenized/manifest\.json is missing \(run the tokenize stage first\)$"
    ):
        run_fault_worker(tmp_path, "input")


def test_a_killed_worker_is_a_worker_failure_not_bad_input(tmp_path):
    with pytest.raises(WorkerFailed, match="killed by signal 9") as caught:
        run_fault_worker(tmp_path, "kill")
    assert not isinstance(caught.value, InputError) and caught.value.exit_status == -9


def test_a_crashed_worker_is_a_worker_failure(tmp_path):
    with pytest.raises(WorkerFailed, match=r"exit status 1\): ZeroDivisionError: a bug") as caught:
        run_fault_worker(tmp_path, "crash")
    assert caught.value.exit_status == 1
