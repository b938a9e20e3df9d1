"""`make stop`, as the run summary prints it: the servers the Makefile started, and everything
they started (sessions of their own included), are gone when it returns."""

import contextlib
import io
import os
import shutil
import subprocess
import sys
import time
import urllib.request

import psutil
import pytest

from laplace.pipeline.servers import stop

from project import BIN, ROOT, descendants, free_port

IGNORES_TERM = "import signal, subprocess, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "


def alive(pids: list[int]) -> list[int]:
    out = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                out.append(pid)
        except psutil.NoSuchProcess:
            pass
    return out


def test_stop_ends_the_tree_of_a_recorded_server_sessions_of_their_own_and_sigterm_ignored(tmp_path):
    """A recorded process that ignores SIGTERM, with a child in a session of its own (as a Prefect
    flow run is) that ignores it too: both are gone after the grace, by SIGKILL. A pid file whose
    process is gone, or was started after the file was written, is not signalled."""
    child = "subprocess.Popen([sys.executable, '-c', " + repr(IGNORES_TERM + "time.sleep(600)") + "]"
    code = IGNORES_TERM + child + ", start_new_session=True); print('up', flush=True); time.sleep(600)"
    server = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    bystander = None
    try:
        assert server.stdout.readline().strip() == "up"
        time.sleep(0.5)  # the grandchild set its SIGTERM handler
        pids = [server.pid, *descendants(server.pid)]
        assert len(pids) == 2 and os.getsid(pids[1]) != os.getsid(server.pid)
        servers = tmp_path / "servers"
        servers.mkdir()
        (servers / "prefect-worker.pid").write_text(f"{server.pid}\n")
        (servers / "mlflow-ui.pid").write_text("999999999\n")  # gone
        old = servers / "prefect-server.pid"
        old.write_text(f"{os.getpid()}\n")  # this test's own pid, in a file older than the process: reused
        os.utime(old, (psutil.Process().create_time() - 60,) * 2)
        bystander = os.getpid()

        t0 = time.monotonic()
        assert stop(servers, grace_s=1.0) == 0
        assert time.monotonic() - t0 < 1.0 + 5.0 + 2.0  # bounded: the grace, SIGKILL's wait, slack
        server.wait(timeout=5)
        assert alive(pids) == [] and psutil.pid_exists(bystander)
        assert list(servers.iterdir()) == []  # the pid files are removed
    finally:
        for pid in alive([server.pid, *descendants(server.pid)]):
            os.kill(pid, 9)
        server.wait(timeout=10)


# Prefect's worker protocol (prefect.utilities.processutils.setup_signal_handlers_worker): the first
# SIGTERM starts a graceful shutdown that need not end, a second one ends the process
SECOND_TERM_EXITS = """import signal, sys, time
def term(*_):  # each SIGTERM is noted in the file the last argument names; the second one ends it
    with open(sys.argv[-1], "a") as f:
        f.write("TERM ")
    signal.signal(signal.SIGTERM, lambda *_: (open(sys.argv[-1], "a").write("TERM"), sys.exit(3)))
signal.signal(signal.SIGTERM, term)
print("up", flush=True)
time.sleep(600)
"""


def test_a_prefect_worker_gets_the_second_sigterm_it_stops_on_and_nothing_else_does(tmp_path):
    """`prefect worker start` (a script named prefect, run by the interpreter as the venv's entry point
    is) ends on make stop's second SIGTERM; `prefect server start`, the same script, gets one SIGTERM
    and the grace, then SIGKILL."""
    script = tmp_path / "prefect"
    script.write_text(SECOND_TERM_EXITS)
    servers = tmp_path / "servers"
    servers.mkdir()
    procs = {}
    for target, command in (("prefect-worker", ["worker", "start"]), ("prefect-server", ["server", "start"])):
        noted = tmp_path / f"{target}.signals"
        proc = subprocess.Popen([sys.executable, str(script), *command, str(noted)], stdout=subprocess.PIPE, text=True)
        procs[target] = proc
        assert proc.stdout.readline().strip() == "up"
        (servers / f"{target}.pid").write_text(f"{proc.pid}\n")
    try:
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            assert stop(servers, grace_s=3.0) == 0
        assert (tmp_path / "prefect-worker.signals").read_text() == "TERM TERM"  # ended on the second
        assert (tmp_path / "prefect-server.signals").read_text() == "TERM "  # one, then SIGKILL
        assert "1 process(es) ignored SIGTERM for 3 s: killed with SIGKILL" in out.getvalue()
        assert alive([proc.pid for proc in procs.values()]) == []
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
            proc.wait(timeout=10)


def wait_for(url: str, proc: subprocess.Popen, seconds: float) -> bool:
    end = time.monotonic() + seconds
    while time.monotonic() < end and proc.poll() is None:
        try:
            with urllib.request.urlopen(url, timeout=5):
                return True
        except OSError:
            time.sleep(1)
    return False


@pytest.mark.slow
def test_make_stop_stops_a_real_mlflow_ui_and_prefect_server(tmp_path):
    """`make mlflow-ui &` and `make prefect-server &` in one fresh bash, as the summary's next steps
    start them; once both answer, `make stop` as printed: no process of either is left."""
    project = tmp_path / "project"
    project.mkdir()
    shutil.copy(ROOT / "Makefile", project / "Makefile")
    shutil.copy(ROOT / "pyproject.toml", project / "pyproject.toml")
    # the venv is this one, already set up, entry by entry, with stamps of its own newer than
    # pyproject.toml: make neither reinstalls nor touches this venv (the test is of make stop)
    os.utime(project / "pyproject.toml", (0, 0))
    venv = project / ".venv"
    venv.mkdir()
    for entry in BIN.parent.iterdir():
        if entry.name not in (".installed", ".runtime"):
            (venv / entry.name).symlink_to(entry)
    for stamp in (".installed", ".runtime"):
        (venv / stamp).touch()
    prefect_port, mlflow_port = free_port(), free_port()
    env = {
        "HOME": str(tmp_path),
        "PATH": "/usr/local/bin:/usr/bin:/bin",
        "PREFECT_PORT": str(prefect_port),
        "MLFLOW_PORT": str(mlflow_port),
        "OMP_NUM_THREADS": "1",
        **({"PYTHONPATH": os.environ["PYTHONPATH"]} if "PYTHONPATH" in os.environ else {}),
    }
    log = tmp_path / "servers.log"
    with log.open("w") as out:
        shell = subprocess.Popen(
            ["bash", "--noprofile", "--norc", "-c", "make mlflow-ui & make prefect-server & wait"],
            cwd=project,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        assert wait_for(f"http://127.0.0.1:{mlflow_port}/", shell, 600), log.read_text()[-3000:]
        assert wait_for(f"http://127.0.0.1:{prefect_port}/api/health", shell, 600), log.read_text()[-3000:]
        started = descendants(shell.pid)
        assert len(started) >= 4, started  # two makes and at least their two servers
        assert sorted(p.name for p in (project / "runs" / "servers").iterdir()) == [
            "mlflow-ui.pid",
            "prefect-server.pid",
        ]
        done = subprocess.run(["make", "stop"], cwd=project, env=env, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stdout + done.stderr
        assert "make stop: stopped mlflow-ui" in done.stdout and "make stop: stopped prefect-server" in done.stdout
        shell.wait(timeout=30)  # its background makes are gone, so `wait` returns
        assert alive(started) == [], [psutil.Process(p).cmdline() for p in alive(started)]
        for port in (mlflow_port, prefect_port):
            with pytest.raises(OSError):
                urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=5)
    finally:
        for pid in alive(descendants(shell.pid)):
            os.kill(pid, 9)
        if shell.poll() is None:
            shell.kill()
        shell.wait(timeout=30)
