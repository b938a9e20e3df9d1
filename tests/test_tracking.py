"""The MLflow tracking server is down: `laplace track` retries for tracking.retry_seconds, then
fails with one line and loses nothing (the stage results stay on disk); a rerun once the server
is back logs the run, and so does the same call when the server returns within the window.
A real `mlflow server` on 127.0.0.1, killed and restarted; no mocks."""

import hashlib
import json
import os
import queue
import signal
import subprocess
import threading
import time
import urllib.request
from pathlib import Path

import pytest
from mlflow import MlflowClient

from project import BIN, SPOOL_TRAIN, env, free_port, write_stage_results

pytestmark = pytest.mark.slow

PASSWORD = "FAKEtrackingPASSWORD-7f3a9c"  # in the tracking URI: must never be printed or stored


def digest_tree(*dirs: Path) -> dict[str, str]:
    return {
        str(p): hashlib.sha256(p.read_bytes()).hexdigest() for d in dirs for p in sorted(d.rglob("*")) if p.is_file()
    }


def listening_addresses(port: int) -> list[str]:
    """Local addresses (hex, from /proc/net/tcp and tcp6) with a socket listening on `port`."""
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        if not os.path.exists(table):
            continue
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            address, hex_port = fields[1].split(":")
            if fields[3] == "0A" and int(hex_port, 16) == port:  # 0A = LISTEN
                found.append(address)
    return found


class MlflowServer:
    """`mlflow server` on 127.0.0.1 with a sqlite store and proxied artifacts; start/kill at will."""

    def __init__(self, root: Path):
        self.root, self.port, self.proc = root, free_port(), None
        root.mkdir(parents=True, exist_ok=True)

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def uri(self) -> str:  # credentials in the URI: a tracking server behind basic auth
        return f"http://laplace:{PASSWORD}@127.0.0.1:{self.port}"

    def start(self) -> None:
        e = env(MLFLOW_SERVER_ENABLE_JOB_EXECUTION="false")
        self.log = open(self.root / "server.log", "ab")
        self.proc = subprocess.Popen(
            [
                str(BIN / "mlflow"),
                "server",
                "--host",
                "127.0.0.1",
                "--port",
                str(self.port),
                "--workers",
                "1",
                "--backend-store-uri",
                f"sqlite:///{self.root / 'mlflow.db'}",
                "--artifacts-destination",
                str(self.root / "artifacts"),
            ],
            cwd=self.root,
            env=e,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, (self.root / "server.log").read_text()[-3000:]
            try:
                with urllib.request.urlopen(f"{self.base}/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                time.sleep(0.25)
        raise AssertionError(f"mlflow server not healthy after 90 s: {(self.root / 'server.log').read_text()[-3000:]}")

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)  # the whole group: the CLI and its uvicorn child
            self.proc.wait(timeout=30)
            self.log.close()
        deadline = time.monotonic() + 10
        while listening_addresses(self.port) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not listening_addresses(self.port), "the killed server still listens"

    def runs(self):
        client = MlflowClient(self.base)
        exp = client.get_experiment_by_name("laplace")
        return [] if exp is None else client.search_runs([exp.experiment_id])


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = MlflowServer(tmp_path_factory.mktemp("mlflow-server"))
    yield s
    s.kill()


def track_cmd(retry_seconds: float) -> list[str]:
    return [str(BIN / "laplace"), "track", "--set", f"tracking.retry_seconds={retry_seconds}"]


def assert_logged(run, project: Path) -> None:
    assert run.data.metrics["eval_loss"] == SPOOL_TRAIN["val_loss"]
    assert run.data.metrics["gate_serve"] == 1.0 and run.data.params["train.steps"] == "300"
    assert run.data.tags["gates"] == "serve passed, numerics passed, probes missing"
    summary = json.loads((project / "artifacts" / "tracking.json").read_text())
    assert summary["run_id"] == run.info.run_id
    assert PASSWORD not in json.dumps(summary) and ":***@127.0.0.1" in summary["tracking_uri"]


def test_server_down_fails_in_one_line_and_a_rerun_logs_everything(server, tmp_path):
    project = tmp_path / "project"
    project.mkdir()
    write_stage_results(project)
    server.start()
    addresses = listening_addresses(server.port)
    if addresses:  # Linux: the server we started listens on loopback only
        assert set(addresses) == {"0100007F"}, addresses  # 127.0.0.1, nothing on 0.0.0.0 or IPv6
    server.kill()  # the outage
    before = digest_tree(project / "metrics", project / "plots")

    started = time.monotonic()
    out = subprocess.run(
        track_cmd(3), cwd=project, env=env(MLFLOW_TRACKING_URI=server.uri), capture_output=True, text=True, timeout=120
    )
    elapsed = time.monotonic() - started
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 75, out.stderr  # transient (EX_TEMPFAIL): the Prefect flow retries it
    assert "Traceback" not in out.stderr and out.stdout == ""
    error = lines[-1]
    assert error.startswith(
        f"laplace track: error: MLflow tracking server http://laplace:***@127.0.0.1:{server.port} "
        "unreachable (Connection refused; retried for 3s, tracking.retry_seconds)"
    ), error
    assert "nothing was lost" in error and "rerun `laplace track` (or `dvc repro`)" in error
    # besides the error, at most the one notice that it is retrying; never the password
    assert [line for line in lines[:-1] if "laplace.tracking.store:" not in line] == [], lines
    assert len(lines) <= 2 and PASSWORD not in out.stderr
    assert 3 <= elapsed < 3 + 45, elapsed  # bounded by the knob, not MLflow's minutes of HTTP retries
    assert digest_tree(project / "metrics", project / "plots") == before  # the spool is intact
    assert not (project / "artifacts" / "tracking.json").exists()

    server.start()
    assert server.runs() == []  # nothing half-logged during the outage
    out = subprocess.run(
        track_cmd(3), cwd=project, env=env(MLFLOW_TRACKING_URI=server.uri), capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-3000:]
    (run,) = server.runs()
    assert_logged(run, project)
    client = MlflowClient(server.base)
    assert sorted(a.path for a in client.list_artifacts(run.info.run_id, "plots")) == [
        "plots/train_loss.json",
        "plots/val_loss.json",
    ]  # through the server's artifact proxy
    assert {a.path for a in client.list_artifacts(run.info.run_id, "metrics")} == {
        "metrics/tokenize.json",
        "metrics/train.json",
        "metrics/serve-check.json",
        "metrics/numerics.json",
    }  # every detailed figure, logged from the spool too
    history = client.get_metric_history(run.info.run_id, "train_loss")
    assert [m.step for m in history] == list(range(1, 7))
    assert PASSWORD not in out.stdout + out.stderr


def test_server_back_within_the_window_the_same_call_logs_the_run(server, tmp_path):
    project = tmp_path / "project"
    project.mkdir()
    write_stage_results(project)
    server.kill()
    proc = subprocess.Popen(
        track_cmd(90),
        cwd=project,
        env=env(MLFLOW_TRACKING_URI=server.uri),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    lines: queue.Queue[str] = queue.Queue()
    reader = threading.Thread(target=lambda: [lines.put(line) for line in proc.stderr], daemon=True)
    reader.start()
    try:
        seen, deadline = [], time.monotonic() + 90
        while not any("unreachable" in line for line in seen):  # track is up and finds the server down
            assert proc.poll() is None and time.monotonic() < deadline, seen
            try:
                seen.append(lines.get(timeout=1))
            except queue.Empty:
                pass
        assert not (project / "artifacts" / "tracking.json").exists()
        back = time.monotonic()
        server.start()
        assert proc.wait(timeout=240) == 0
        reader.join(timeout=10)
        while not lines.empty():
            seen.append(lines.get())
    finally:
        if proc.poll() is None:
            proc.kill()
    assert time.monotonic() - back < 90, "it had to succeed within the retry window"
    assert any("is back" in line for line in seen), seen
    assert not any("error" in line.lower() for line in seen), seen
    summary = json.loads((project / "artifacts" / "tracking.json").read_text())
    (run,) = [r for r in server.runs() if r.info.run_id == summary["run_id"]]
    assert_logged(run, project)
