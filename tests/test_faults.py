"""Fault injection into real training runs (`laplace train` processes, torchrun/gloo ranks):
kill -9 of the job, of one rank, during a checkpoint write, and a disk that fills up.
Every recovered run must end with the same weights, bit for bit, as one never disturbed."""

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from laplace.training import checkpoint as ckpt

from project import BIN, PIPELINE_TIMEOUT_S, TINY_PARAMS, copy_project, descendants, env, run

# the module fixtures train two reference runs before the first fault
pytestmark = [pytest.mark.slow, pytest.mark.timeout(PIPELINE_TIMEOUT_S)]

STEPS = 24
FAULT_PARAMS = {
    **TINY_PARAMS,
    "data.max_documents": 300,  # the session's tokenized corpus (tiny_artifacts)
    "tokenizer.vocab_size": 400,
    "model.d_model": 64,
    "model.n_layers": 2,
    "train.steps": STEPS,
    "train.batch_size": 8,
    "train.seq_len": 64,
    "train.checkpoint_every": 2,
    "train.keep_checkpoints": 3,
    "train.eval_every": 12,
    "train.log_every": 1,
}
LAPLACE = [str(BIN / "laplace")]


@pytest.fixture(scope="module")
def tokenized(tiny_artifacts, tmp_path_factory) -> Path:
    """The project, tokenized: the session's tokenized corpus copied in (what `laplace tokenize`
    writes at these data and tokenizer params)."""
    from laplace.pipeline.layout import Paths

    root = copy_project(tmp_path_factory.mktemp("faults"), FAULT_PARAMS)
    shutil.copytree(tiny_artifacts[0], Paths.at(root).data_dir)
    return root


def fresh(tokenized: Path, tmp_path: Path, name: str, **params) -> Path:
    """A copy of the tokenized project with no training run yet."""
    root = tmp_path / name
    shutil.copytree(tokenized, root, ignore=shutil.ignore_patterns("runs", ".git"))
    if params:
        from laplace.pipeline.params import write_params

        write_params(root / "params.yaml", params)
    return root


def final_weights(root: Path) -> dict[str, torch.Tensor]:
    newest = ckpt.list_checkpoints(root / "runs/train/checkpoints")[0]
    assert newest[0] == STEPS, f"the run ended at step {newest[0]}, not {STEPS}"
    return ckpt.model_tensors(newest[1])


def assert_bitwise_equal(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    different = [k for k in a if not torch.equal(a[k], b[k])]
    assert not different, f"tensors differ: {different[:5]}"


def train_metrics(root: Path) -> dict:
    return json.loads((root / "metrics/train.json").read_text())


@pytest.fixture(scope="module")
def reference_runs(tokenized, tmp_path_factory) -> dict[int, Path]:
    """Undisturbed `laplace train` runs, by world size: their project roots."""
    out = {}
    for world in (1, 2):
        root = fresh(tokenized, tmp_path_factory.mktemp("ref"), f"ref{world}", **{"train.nproc_per_node": world})
        run(LAPLACE + ["train"], root)
        out[world] = root
    return out


@pytest.fixture(scope="module")
def reference(reference_runs) -> dict[int, dict[str, torch.Tensor]]:
    """Final weights of the undisturbed runs, by world size."""
    return {world: final_weights(root) for world, root in reference_runs.items()}


def test_the_train_stage_reports_its_world_size_and_the_muon_traffic_of_two_ranks(reference_runs):
    """metrics/train.json (which track logs to MLflow whole): torchrun's world, and the bytes the
    sharded Muon exchange moved, zero in one process."""
    one, two = (train_metrics(reference_runs[world]) for world in (1, 2))
    assert (one["world_size"], two["world_size"]) == (1, 2)
    most = "muon_bytes_per_rank_per_step_max"
    assert one["traffic"][most] == 0 < two["traffic"][most]


def start_training(root: Path) -> subprocess.Popen:
    return subprocess.Popen(
        LAPLACE + ["train"],
        cwd=root,
        env=env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


def wait_for_step(proc: subprocess.Popen, step: int, timeout: float = 300) -> list[str]:
    """Read the job's log until rank 0 reports `step`; returns the lines read."""
    lines, deadline = [], time.monotonic() + timeout
    for line in proc.stdout:
        lines.append(line)
        if f"step {step}/{STEPS} " in line:
            return lines
        assert time.monotonic() < deadline, "training did not reach the step in time"
    raise AssertionError(f"training ended before step {step}:\n{''.join(lines[-20:])}")


def worker_of_rank(launcher: int, rank: int) -> int:
    for pid in descendants(launcher):
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"RANK={rank}".encode() in environ and b"LOCAL_RANK=" + str(rank).encode() in environ:
            return pid
    raise AssertionError(f"no rank {rank} worker under pid {launcher}")


def test_kill_9_of_the_whole_job_resumes_to_the_same_weights(tokenized, reference, tmp_path):
    root = fresh(tokenized, tmp_path, "killed")
    kill_at = random.Random(os.getpid()).randint(3, STEPS // 2)  # a random step, recorded on failure
    proc = start_training(root)
    wait_for_step(proc, kill_at)
    os.killpg(proc.pid, signal.SIGKILL)
    assert proc.wait() == -signal.SIGKILL
    survived = ckpt.list_checkpoints(root / "runs/train/checkpoints")
    assert survived and survived[0][0] < STEPS, f"killed at step {kill_at}, yet the run had finished"

    run(LAPLACE + ["train"], root)  # the train stage again, as dvc repro would
    resumed = train_metrics(root)["resumed_from_step"]
    assert 0 < resumed <= survived[0][0], (kill_at, resumed, survived[0][0])
    assert_bitwise_equal(final_weights(root), reference[1])


def test_kill_9_of_one_rank_under_torchrun_restarts_and_finishes_the_same(tokenized, reference, tmp_path):
    root = fresh(tokenized, tmp_path, "rank-killed", **{"train.nproc_per_node": 2, "train.max_restarts": 1})
    proc = start_training(root)
    wait_for_step(proc, 6)
    victim = worker_of_rank(proc.pid, 1)
    os.kill(victim, signal.SIGKILL)
    log = "".join(proc.stdout)  # torchrun notices, restarts both ranks, they resume
    assert proc.wait() == 0, log[-3000:]
    assert "resumed from" in log, log[-3000:]
    assert train_metrics(root)["resumed_from_step"] > 0
    assert_bitwise_equal(final_weights(root), reference[2])


DIE_WRITING_MANIFEST = """
import os, signal, sys
from laplace import manifest
write = manifest.write_manifest
def die_at_step_6(directory, kind, *args, **fields):
    if kind == "checkpoint" and fields.get("step") == 6:  # shards and trainer.json are written: SIGKILL now
        os.kill(os.getpid(), signal.SIGKILL)
    return write(directory, kind, *args, **fields)
manifest.write_manifest = die_at_step_6
from laplace.pipeline.cli import main
sys.exit(main(["train"]))
"""


def test_kill_during_a_checkpoint_write_and_a_truncated_checkpoint_are_never_loaded(tokenized, reference, tmp_path):
    root = fresh(tokenized, tmp_path, "torn")
    died = subprocess.run(
        [sys.executable, "-c", DIE_WRITING_MANIFEST], cwd=root, env=env(), capture_output=True, text=True, timeout=600
    )
    assert died.returncode == -signal.SIGKILL, died.stderr[-2000:]
    checkpoints = root / "runs/train/checkpoints"
    assert (checkpoints / ".step_000006.partial").is_dir()  # the torn write, under its staging name
    assert [s for s, _ in ckpt.list_checkpoints(checkpoints)] == [4, 2]
    # and the newest complete checkpoint gets truncated on disk as well
    shard = sorted((checkpoints / "step_000004").glob("*.safetensors"))[0]
    with open(shard, "r+b") as f:
        f.truncate(shard.stat().st_size // 2)

    out = run(LAPLACE + ["train"], root)
    assert f"skipping damaged checkpoint {checkpoints / 'step_000004'}" in out.stderr
    assert str(shard) in out.stderr and "truncated" in out.stderr
    assert train_metrics(root)["resumed_from_step"] == 2
    assert not list(checkpoints.glob(".step_*.partial"))  # cleaned up by the next save
    assert_bitwise_equal(final_weights(root), reference[1])


DISK_FULL_AT_STEP_5 = """
import resource, signal, sys
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit then fails with EFBIG, like ENOSPC
from laplace.training import loop  # stage_train imports train from it when the stage runs
train = loop.train
def fill_the_disk(step, model, optimizer):
    if step == 5:  # after checkpoint 4: no file may grow past 4 KiB any more
        resource.setrlimit(resource.RLIMIT_FSIZE, (4096, resource.RLIM_INFINITY))
def train_with_a_full_disk(*args, **kwargs):
    return train(*args, before_step=fill_the_disk, **kwargs)
loop.train = train_with_a_full_disk
from laplace.pipeline.cli import main
sys.exit(main(["train"]))
"""


def test_disk_full_while_writing_is_a_clear_error_and_the_previous_checkpoint_survives(tokenized, tmp_path):
    root = fresh(tokenized, tmp_path, "full")
    out = subprocess.run(
        [sys.executable, "-c", DISK_FULL_AT_STEP_5], cwd=root, env=env(), capture_output=True, text=True, timeout=600
    )
    assert out.returncode == 1, out.stderr[-2000:]  # not bad input: a retry may find the space freed
    assert "Traceback" not in out.stderr
    error = out.stderr.strip().splitlines()[-1]
    assert error.startswith("laplace train: error: could not write checkpoint step_000006"), error
    assert "File too large" in error and "the previous checkpoint step_000004 is intact" in error
    checkpoints = root / "runs/train/checkpoints"
    assert [s for s, _ in ckpt.list_checkpoints(checkpoints)] == [4, 2]
    assert ckpt.verify_manifest(checkpoints / "step_000004") == (True, "")
    assert not list(checkpoints.glob(".step_*"))  # no half-written staging directory left behind


# --------------------------------------------------------------------------- a job that stops


def job_processes(pid: int) -> list[int]:
    """`pid` and everything below it that is still alive (zombies are dead)."""
    alive = []
    for p in [pid, *descendants(pid)]:
        try:
            state = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z":
            alive.append(p)
    return alive


def still_alive(pids: list[int]) -> list[int]:
    out = []
    for p in pids:
        try:
            if Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
                out.append(p)
        except OSError:
            pass
    return out


def wait_for_ranks(proc: subprocess.Popen, world: int, step: int, timeout: float = 300) -> list[int]:
    """Read the log until rank 0 reports `step`; returns the job's processes (laplace train, the
    torchrun agent, every rank)."""
    deadline = time.monotonic() + timeout
    for line in proc.stdout:
        if f" step {step}/" in line:
            break
        assert time.monotonic() < deadline, "training did not reach the step in time"
    pids = job_processes(proc.pid)
    assert len(pids) >= 2 + world, pids  # laplace train, the agent, the ranks
    return pids


def gone_within(pids: list[int], seconds: float) -> list[int]:
    deadline = time.monotonic() + seconds
    while still_alive(pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    return still_alive(pids)


LONG = {"train.nproc_per_node": 2, "train.steps": 400, "train.checkpoint_every": 1000, "train.eval_every": 1000}


def test_sigterm_checkpoints_and_stops_every_process_a_second_train_is_refused_and_sigkill_of_the_next_leaves_none(
    tokenized, tmp_path
):
    """SIGTERM to `laplace train` on two ranks; then the next train resumes from its checkpoint, and a
    SIGKILL of that `laplace train` alone leaves no process of its job (one job serves both checks)."""
    root = fresh(tokenized, tmp_path, "sigterm", **LONG)
    proc = start_training(root)
    pids = wait_for_ranks(proc, 2, 3)
    # a second job on the same project while the first runs: one line, exit status 2
    second = run(LAPLACE + ["train"], root, check=False)
    lines = second.stderr.strip().splitlines()
    assert second.returncode == 2 and len(lines) == 1, (second.returncode, second.stderr[-2000:])
    assert lines[0].startswith("laplace train: error: another `laplace train` (pid ") and str(proc.pid) in lines[0]
    assert still_alive(pids) == pids  # the refused job touched nothing of the running one

    os.kill(proc.pid, signal.SIGTERM)
    log = "".join(proc.stdout)
    assert proc.wait() == 128 + signal.SIGTERM, log[-3000:]
    assert gone_within(pids, 10) == [], "processes of the job still alive 10 s after SIGTERM"
    # checkpoint_every is 1000: the only checkpoint is the one SIGTERM wrote, at a step boundary
    saved = ckpt.list_checkpoints(root / "runs/train/checkpoints")
    assert len(saved) == 1 and 3 <= saved[0][0] < LONG["train.steps"], (saved, log[-3000:])
    assert ckpt.verify_manifest(saved[0][1])[0]
    assert log.strip().splitlines()[-1].startswith("laplace train: error: stopped by SIGTERM"), log[-3000:]
    # and the lock went with the job: the next train starts (and resumes from that step)
    again = start_training(root)
    try:
        resumed = next(line for line in again.stdout if "resumed from" in line or "error" in line)
        assert f"(step {saved[0][0]}," in resumed, resumed
        pids = wait_for_ranks(again, 2, saved[0][0] + 1)
    finally:
        os.kill(again.pid, signal.SIGKILL)  # the launcher alone: the agent and the ranks must follow
        again.wait()
    # the ranks run in their own sessions; nothing but their death signals reaches them
    assert gone_within(pids, 10) == [], "processes of the job still alive 10 s after SIGKILL"


def test_sigkill_of_the_parent_of_laplace_train_stops_the_job_too(tokenized, tmp_path):
    """What `dvc repro` or a Prefect task is to `laplace train`: a parent process. Killed with -9,
    its child `laplace train` gets SIGTERM (its death signal) and stops the job the graceful way."""
    root = fresh(tokenized, tmp_path, "parent-killed", **LONG)
    parent = subprocess.Popen(
        ["/bin/sh", "-c", f"{LAPLACE[0]} train; exit $?"],  # not `exec`: the shell stays the parent
        cwd=root,
        env=env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    pids = wait_for_ranks(parent, 2, 3)
    os.kill(parent.pid, signal.SIGKILL)
    parent.wait()
    assert gone_within(pids, 10) == [], "processes of the job still alive 10 s after its parent was killed"
    saved = ckpt.list_checkpoints(root / "runs/train/checkpoints")
    assert len(saved) == 1 and saved[0][0] >= 3, saved  # the graceful stop's checkpoint


def test_ctrl_c_to_the_process_group_checkpoints_and_ends_with_one_line(tokenized, tmp_path):
    """Ctrl-C in a terminal is SIGINT to the foreground process group: `laplace train` and
    torchrun's agent (the ranks run in sessions of their own, the agent forwards SIGINT to them).
    The ranks stop at a step boundary with the stop checkpoint, as on SIGTERM; the job ends with
    one line and exit status 130, no traceback, no process left."""
    root = fresh(tokenized, tmp_path, "sigint", **LONG)
    proc = start_training(root)  # its own session: killpg reaches it and the agent, as a terminal's Ctrl-C
    pids = wait_for_ranks(proc, 2, 3)
    os.killpg(proc.pid, signal.SIGINT)
    log = "".join(proc.stdout)
    assert proc.wait() == 128 + signal.SIGINT, log[-3000:]
    assert gone_within(pids, 10) == [], "processes of the job still alive 10 s after Ctrl-C"
    saved = ckpt.list_checkpoints(root / "runs/train/checkpoints")
    assert len(saved) == 1 and 3 <= saved[0][0] < LONG["train.steps"], (saved, log[-3000:])
    assert ckpt.verify_manifest(saved[0][1])[0]
    assert "Traceback" not in log and "KeyboardInterrupt" not in log, log[-3000:]
    assert log.strip().splitlines()[-1].startswith("laplace train: error: stopped by SIGINT"), log[-3000:]


def test_a_killed_rank_is_named_in_the_one_line_error(tokenized, tmp_path):
    """kill -9 of rank 1 with no restarts left: `laplace train` fails with one line naming rank 1
    and its signal (not torchrun's `=====` report rule), and the other rank's own error follows."""
    root = fresh(tokenized, tmp_path, "dead-rank", **LONG)
    proc = start_training(root)
    wait_for_ranks(proc, 2, 3)
    os.kill(worker_of_rank(proc.pid, 1), signal.SIGKILL)
    log = "".join(proc.stdout)
    assert proc.wait() == 1, log[-3000:]
    last = log.strip().splitlines()[-1]
    assert last.startswith("laplace train: error: laplace.pipeline.stage_train worker failed (exit status 1): "), last
    assert "rank 1 (local rank 1, pid " in last and "was killed by signal SIGKILL (9)" in last, last
    assert "=====" not in last and "then rank 0 failed too" in last, last
