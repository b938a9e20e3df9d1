"""End to end through a real Prefect server and process worker on 127.0.0.1; the flow file run
directly with no server for the cases that stop early (bad params, rejected input)."""

import json
import os
import signal
import subprocess
import threading
import time
import urllib.request
from pathlib import Path

import pytest
from mlflow import MlflowClient

from project import (
    BIN,
    PIPELINE_RUN_S,
    PIPELINE_TIMEOUT_S,
    TINY_PARAMS,
    copy_project,
    descendants,
    direct_flow_env,
    env,
    free_port,
    run,
    set_params,
)

pytestmark = pytest.mark.slow


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float = 90) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"server exited early: {proc.stdout.read()[-3000:]}")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.5)
    raise AssertionError(f"{url} not healthy after {timeout}s")


def stop(proc: subprocess.Popen) -> None:
    """As `make stop` does (laplace/pipeline/servers.py): SIGTERM, and a second one after 2 s, on which
    Prefect's worker ends (it does not on the first), then SIGKILL."""
    from laplace.pipeline.servers import KILL_WAIT_S, STOP_GRACE_S, WORKER_SECOND_SIGTERM_S

    steps = (
        (signal.SIGTERM, WORKER_SECOND_SIGTERM_S),
        (signal.SIGTERM, STOP_GRACE_S - WORKER_SECOND_SIGTERM_S),
        (signal.SIGKILL, KILL_WAIT_S),
    )
    for sig, wait_s in steps:
        if proc.poll() is not None:
            return
        os.killpg(proc.pid, sig)
        try:
            proc.wait(timeout=wait_s)
        except subprocess.TimeoutExpired:
            pass


def mlflow_runs(repo):
    c = MlflowClient(f"sqlite:///{repo / 'mlflow.db'}")
    return c.search_runs([c.get_experiment_by_name("laplace").experiment_id])


@pytest.fixture(scope="module")
def prefect_home(tmp_path_factory):
    """One Prefect home (its SQLite database) for the module's servers: the deployment's and the
    temporary ones the direct flow runs start. A fresh home's migrations cost ~5 CPU-s per start."""
    return tmp_path_factory.mktemp("prefect")


# An override of a late stage's knob: the flow runs every stage's task, DVC reruns probes and track only
OVERRIDE = ("probes.passkey_samples", TINY_PARAMS["probes.passkey_samples"] + 1)


@pytest.mark.timeout(PIPELINE_TIMEOUT_S)
def test_deployment_runs_through_server_and_worker(tiny_pipeline_copy, prefect_home):
    """`prefect deployment run` through a real server and process worker, with an override as a
    flow parameter, on a copy of the session's finished tiny pipeline (every stage's task runs;
    DVC reruns the stages the override reaches). Two transient faults, at the two levels a stage
    runs: the probes stage's `laplace probes` process and, in the retry, its worker (a `python -m
    laplace.pipeline.stage_probes` below it) are each killed -9 once; a killed process is a crash,
    not bad input, so Prefect retries the stage and the pipeline completes."""
    repo = tiny_pipeline_copy
    set_params(repo / "params.yaml", {"pipeline.retries": 2, "pipeline.retry_delay_s": 0})
    key, value = OVERRIDE
    port = free_port()
    api = f"http://127.0.0.1:{port}/api"
    e = env(
        PREFECT_HOME=direct_flow_env(prefect_home)["PREFECT_HOME"],  # the direct flow runs' home
        PREFECT_API_URL=api,
        PWD=str(repo),
        PREFECT_SERVER_ANALYTICS_ENABLED="false",
    )
    server = subprocess.Popen(
        [str(BIN / "prefect"), "server", "start", "--host", "127.0.0.1", "--port", str(port)],
        cwd=repo,
        env=e,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    worker, watcher, done, killed, killed_worker = None, None, threading.Event(), [], []
    try:
        wait_healthy(f"{api}/health", server)
        run([str(BIN / "prefect"), "work-pool", "create", "laplace", "--type", "process"], repo, env=e)
        run([str(BIN / "prefect"), "--no-prompt", "deploy", "--all"], repo, env=e)
        worker = subprocess.Popen(
            [str(BIN / "prefect"), "worker", "start", "--pool", "laplace"],
            cwd=repo,
            env=e,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        # the stage's command, then the worker of the retried stage (the first attempt's command dies
        # before it starts one)
        kills = [(is_laplace_command("probes"), killed), (is_module("laplace.pipeline.stage_probes"), killed_worker)]
        watcher = threading.Thread(target=kill_in_turn, args=(worker.pid, kills, mentions("probes"), done))
        watcher.start()
        out = run(
            [
                str(BIN / "prefect"),
                "deployment",
                "run",
                "laplace-pipeline/tiny",
                "--watch",
                "--watch-timeout",
                str(PIPELINE_RUN_S - 100),
                "--params",
                json.dumps({"overrides": {key: value}}),
            ],
            repo,
            env=e,
            timeout=PIPELINE_RUN_S,
        )
        assert "Completed" in out.stdout + out.stderr
    finally:
        done.set()
        if watcher is not None:
            watcher.join()
        if worker is not None:
            stop(worker)
        stop(server)
    assert killed, "the probes stage was never seen running"  # it died once, so Prefect's retry ran it
    assert killed_worker, "the probes worker was never seen running"  # a crash, retried (exit 2 would not be)
    runs = mlflow_runs(repo)
    assert len(runs) == 1 and runs[0].data.tags["launcher"] == "prefect"
    assert runs[0].data.tags.get("prefect_flow_run_id")
    assert runs[0].data.params[key] == str(value)
    assert "Data and pipelines are up to date" in run(["python", "-m", "dvc", "status"], repo).stdout
    import yaml

    lock = yaml.safe_load((repo / "dvc.lock").read_text())
    section, name = key.split(".")
    probes_params = lock["stages"]["probes"]["params"]["params.yaml"]
    assert probes_params.get(key, (probes_params.get(section) or {}).get(name)) == value  # the knob reached it
    assert lock["stages"]["train"]["params"]["params.yaml"]["train"]["lr"] == 0.003  # train did not rerun
    assert "# Laplace pipeline parameters" in (repo / "params.yaml").read_text()  # comments kept


def test_bad_params_fail_the_flow_before_any_stage(tmp_path, prefect_home):
    repo = copy_project(tmp_path / "laplace", TINY_PARAMS)
    out = run(
        ["python", "flows/pipeline.py", "--set", "train.lrr=0.002"],
        repo,
        env=direct_flow_env(prefect_home),
        check=False,
        timeout=300,
    )
    assert out.returncode != 0
    assert "unknown key 'train.lrr'" in out.stdout + out.stderr
    assert not (repo / "data").exists() and not (repo / "dvc.lock").exists()


def is_laplace_command(command: str):
    """Matches the argv of `laplace <command>`."""
    return lambda argv: argv[-1:] == [command] and any(a.endswith("/laplace") or a == "laplace" for a in argv)


def is_module(module: str):
    """Matches the argv of `python -m <module> ...`."""
    return lambda argv: module in argv and argv[argv.index(module) - 1] == "-m"


def mentions(word: str):
    """Matches an argv with `word` among its arguments (the stage's `dvc repro --single-item probes`)."""
    return lambda argv: word in argv


def kill_in_turn(parent: int, kills: list, near, done: threading.Event) -> None:
    """Watch the processes below `parent`; SIGKILL the first whose argv matches the first of
    `kills` (matcher, list the pid goes to), then the first matching the next, in turn. A scan of
    /proc costs ~3 ms of CPU: every 20 ms while a process matching `near` runs (the stage's `dvc
    repro`, a second before its command starts), every 0.25 s before."""
    for matches, killed in kills:
        while not done.is_set() and not killed:
            close = False
            for pid in descendants(parent):
                try:
                    argv = [
                        a for a in Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0") if a
                    ]
                except OSError:
                    continue
                if matches(argv):
                    os.kill(pid, signal.SIGKILL)
                    killed.append(pid)
                    break
                close = close or near(argv)
            else:
                time.sleep(0.02 if close else 0.25)


def test_a_rejected_stage_is_not_retried(tmp_path, prefect_home):
    """Bad data (a corpus with no usable text) makes tokenize exit 2: the flow fails at once, no retry."""
    (tmp_path / "empty.txt").write_text("too short\n")
    repo = copy_project(
        tmp_path / "laplace",
        {
            **TINY_PARAMS,
            "pipeline.retries": 2,
            "pipeline.retry_delay_s": 0,
            "data.source": "files",
            "data.path": str(tmp_path / "empty.txt"),
        },
    )
    out = run(["python", "flows/pipeline.py"], repo, env=direct_flow_env(prefect_home), check=False, timeout=300)
    log = out.stdout + out.stderr
    assert out.returncode != 0
    assert "stage tokenize rejected its input" in log
    assert log.count("Running stage 'tokenize'") == 1  # deterministic: run once, never retried
    assert not (repo / "runs").exists()  # nothing after tokenize ran
