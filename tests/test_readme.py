"""Every command and snippet in README.md runs as written (issue 17, item 5).

The cheap ones run here, against a tiny trained, exported and tracked project: the predict
snippet (whose greedy output must equal `laplace generate`'s), `laplace generate`, `laplace
info`, `laplace summary` and the bad-key example with its exact output. The rest run end to
end in the test named for each (full pipelines, or servers), and this test checks that file
really runs that command, so a new README command without a test fails here."""

import ast
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from laplace.pipeline import summary

from project import BIN, ROOT, env

README = (ROOT / "README.md").read_text()
TESTS = ROOT / "tests"

# command (a prefix of the README line) -> (test file, words that file must contain to run it)
RUN_ELSEWHERE = {
    "make run": ("conftest.py", ['"laplace"', '"run"']),  # `make run` is `laplace run` (the tiny_pipeline fixture)
    "make test": (".ci/run", ["make test"]),  # CI is `make lint` and `make test`
    "dvc repro": ("test_pipeline_dvc.py", ['"repro"']),
    "git add -A": ("project.py", ['"add", "-A"', '"commit"']),
    "git commit": ("project.py", ['"commit"']),
    # the summary test runs the summary's printed commands, this one among them (it says so)
    "dvc exp run --set-param train.lr=1e-3": ("test_pipeline_dvc.py", ['"dvc exp run --set-param train.lr=1e-3 && "']),
    "dvc metrics diff": ("test_pipeline_dvc.py", ['"metrics", "diff"']),
    "dvc exp show --only-changed": ("test_pipeline_dvc.py", ['"--only-changed"', '"Created|laplace|.*/.*"']),
    "dvc plots diff": ("test_pipeline_dvc.py", ['"plots", "diff"']),
    "make prefect-server": ("test_pipeline_prefect.py", ['"server", "start"']),
    "make prefect-worker": ("test_pipeline_prefect.py", ['"work-pool", "create"', '"deploy"', '"worker", "start"']),
    "export PREFECT_API_URL=": ("test_pipeline_prefect.py", ["PREFECT_API_URL"]),
    "prefect deployment run 'laplace-pipeline/tiny' --watch": ("test_pipeline_prefect.py", ['"deployment"', "--watch"]),
    "prefect deployment run 'laplace-pipeline/tiny' -p": ("test_pipeline_prefect.py", ['"overrides"']),
    "make mlflow-ui": ("test_readme.py", ['"mlflow-ui"']),
    "laplace plan": ("test_distributed.py", ['"plan"', '"--nproc"']),
    "laplace plan --preset tiny-hybrid": ("test_plan.py", ['"plan", "--preset", "tiny-hybrid"']),
    "laplace serve --model models:/laplace-gla@champion": ("test_mlflow_model.py", ['"serve", "--model", uri']),
    "laplace corpus": ("test_pipeline_dvc.py", ['"repro"']),
    "laplace tokenize": ("test_pipeline_dvc.py", ['"repro"']),  # dvc.yaml's cmds are `laplace <stage>`
    "laplace warmup": ("test_pipeline_dvc.py", ['"repro"']),
    "laplace train": ("test_pipeline_dvc.py", ['"repro"']),
    "laplace export": ("test_pipeline_dvc.py", ['"repro"']),
    "laplace serve-check": ("test_pipeline_dvc.py", ['"repro"']),
    "laplace numerics": ("test_pipeline_dvc.py", ['"repro"']),
    "laplace probes": ("test_pipeline_dvc.py", ['"repro"']),
    "laplace track": ("test_tracking.py", ['"track"']),
    "laplace run": ("test_pipeline_frame.py", ['"laplace", "run"']),
    "laplace run --set model.init=": (
        "test_pipeline_real_model.py",
        ['"run", "--set", f"model.init={INIT}"', '"--set", f"tokenizer.from={INIT}"'],
    ),
    "laplace import": ("test_hf.py", ['"import"', '"--out"']),
    "laplace export --format hf": ("test_hf.py", ['"export", "--format", "hf"']),
    "laplace eval": ("test_harness.py", ['"eval"', '"--tasks"']),
    "make compare": ("test_compare.py", ['"compare"', '"make"']),
    "laplace compare --no-track": ("test_compare.py", ['"compare", "--no-track"']),
    "laplace mqar": ("test_compare.py", ['"laplace"), "mqar"']),
    "lm_eval --model laplace": ("test_harness.py", ['"lm_eval"', '"--model", "laplace"', '"--model_args"']),
}
RUN_HERE = ("laplace info", "laplace generate", "laplace summary")
SHELL_SETUP = ("source .venv/bin/activate",)  # not a project command


def bash_commands(text: str) -> list[str]:
    """Every command line of the README's bash blocks (comments cut, `;` and `&&` split)."""
    found = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        for line in block.splitlines():
            line = re.sub(r"\s+#.*$", "", line).strip()
            found += [part.strip() for part in re.split(r" ; | && ", line) if part.strip()]
    return found


def test_every_readme_command_is_run_by_a_test():
    commands = bash_commands(README)
    assert len(commands) > 20
    for command in commands:
        if command.startswith(RUN_HERE + SHELL_SETUP):
            continue
        matches = [k for k in RUN_ELSEWHERE if command.startswith(k)]
        assert matches, f"README command {command!r} is run by no test: add it to RUN_ELSEWHERE or RUN_HERE"
        where, words = RUN_ELSEWHERE[max(matches, key=len)]
        source = (ROOT / where if where.startswith(".") else TESTS / where).read_text()
        missing = [w for w in words if w not in source]
        assert not missing, f"{where} does not run {command!r} (no {missing})"
    # the Prefect commands need the API URL, set before the first `prefect` command
    first_prefect = next(i for i, c in enumerate(commands) if c.startswith("prefect "))
    assert "export PREFECT_API_URL=http://127.0.0.1:4200/api" in commands[:first_prefect]
    assert any("PREFECT_API_URL=http://127.0.0.1:4200/api" in line for line in summary.next_steps(Path("/p")))


@pytest.fixture(scope="module")
def project(tiny_artifacts, tmp_path_factory):
    """A tiny project after a pipeline run: its export, data, metrics and a champion in MLflow."""
    from test_champion import prepare_project

    root = prepare_project(tmp_path_factory.mktemp("readme"), tiny_artifacts)
    out = subprocess.run(
        [str(BIN / "laplace"), "track", "--set", "tracking.retry_seconds=0"],
        cwd=root,
        env=env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "champion" in out.stdout
    return root


def readme_command(prefix: str) -> list[str]:
    (line,) = [c for c in bash_commands(README) if c.startswith(prefix)]
    return shlex.split(line)


def laplace(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    assert args[0] == "laplace"
    return subprocess.run(
        [str(BIN / "laplace"), *args[1:]], cwd=cwd, env=env(), capture_output=True, text=True, timeout=600
    )


@pytest.mark.slow
def test_the_predict_snippet_runs_as_written_and_matches_the_cli_greedy_output(project):
    (snippet,) = re.findall(r"```python\n(.*?)```", README, re.S)
    assert 'pd.DataFrame({"prompt": ["The function"]})' in snippet  # the signature's input, one row a prompt
    code = snippet.replace("sqlite:////ABS/PATH/mlflow.db", f"sqlite:///{project / 'mlflow.db'}")
    out = subprocess.run([sys.executable, "-c", code], cwd=project, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    (completion,) = ast.literal_eval(out.stdout.strip().splitlines()[-1])
    assert "['The function']" not in completion  # the prompt reached the model as text, not a list's repr
    # the same prompt, greedy, the same number of tokens, through the CLI
    cli = laplace(shlex.split('laplace generate --prompt "The function" --max-new-tokens 32 --temperature 0'), project)
    assert cli.returncode == 0, cli.stderr
    assert cli.stdout == "The function" + completion + "\n"


@pytest.mark.slow
def test_the_readme_laplace_commands_run_as_written(project):
    out = laplace(readme_command("laplace generate"), project)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("The function")
    text = out.stdout[len("The function") :].strip()
    # text, or one line saying why there is none
    assert text or "laplace generate: no text generated: " in out.stderr, (out.stdout, out.stderr)

    out = laplace(readme_command("laplace info"), project)
    import json

    facts = json.loads(out.stdout)
    assert facts["preset"] == "laplace-3b" and facts["params"] > 2.5e9

    out = laplace(readme_command("laplace summary"), project)
    assert out.returncode == 0 and "registered laplace-gla v1 as champion" in out.stdout

    # the bad-key example prints exactly what the README shows, and exits 2
    (example,) = re.findall(r"```\n\$ (laplace train --set train\.lrr=0\.01)\n(.*?)\n```", README, re.S)
    out = laplace(shlex.split(example[0]), project)
    assert out.returncode == 2 and out.stderr.strip().splitlines()[-1] == example[1]


def test_generate_says_why_when_it_produced_no_text(monkeypatch, capsys, tmp_path):
    """The model may end the text at once (it samples end-of-text first): the CLI says so rather
    than print the prompt alone. The model is replaced here by its outcome."""
    import laplace.serving.generation as generation
    from laplace.pipeline.cli import main

    monkeypatch.setattr(
        generation, "generate_text", lambda *a, **kw: {"prompt": "The function", "completion": "", "new_tokens": 1}
    )
    (tmp_path / "artifacts" / "export").mkdir(parents=True)
    (tmp_path / "artifacts" / "export" / "config.json").write_text("{}")  # an export is there (not read)
    assert main(["generate", "--params", str(ROOT / "params.yaml"), "--root", str(tmp_path)]) == 0
    out = capsys.readouterr()
    assert out.out == "The function\n"
    assert out.err.strip() == (
        "laplace generate: no text generated: the model sampled end-of-text after 1 token(s); "
        "try another --seed, or --temperature 0 (greedy)"
    )


@pytest.mark.slow
def test_the_mlflow_ui_serves_the_runs_table_with_the_headline_columns(project):
    """`make mlflow-ui`'s command on the project's store; the runs table reads the run through
    the UI's own API: the headline metrics as the run's metrics, the experiment marked as
    model training (so MLflow 3 opens its runs table, not the GenAI overview)."""
    import json
    import time
    import urllib.request

    from project import free_port

    port = free_port()
    server = subprocess.Popen(
        make_mlflow_ui(port),
        cwd=project,
        env=env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    base = f"http://127.0.0.1:{port}"

    def call(path: str, body: dict | None = None) -> dict:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(base + path, data=data, headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=10) as r:
            return json.loads(r.read())

    try:
        deadline = time.monotonic() + 300  # a loaded machine
        while True:
            assert server.poll() is None, "mlflow ui exited"
            try:
                experiment = call("/ajax-api/2.0/mlflow/experiments/get-by-name?experiment_name=laplace")
                break
            except OSError:
                assert time.monotonic() < deadline, "mlflow ui did not answer in 300 s"
                time.sleep(0.5)
        tags = {t["key"]: t["value"] for t in experiment["experiment"]["tags"]}
        assert tags["mlflow.experimentKind"] == "custom_model_development"
        found = call(
            "/ajax-api/2.0/mlflow/runs/search", {"experiment_ids": [experiment["experiment"]["experiment_id"]]}
        )
        (run,) = found["runs"]
        # the compare view charts the first metric the UI receives: the validation loss
        assert run["data"]["metrics"][0]["key"] == "eval_loss"
        metrics = {m["key"] for m in run["data"]["metrics"]}
        assert metrics == {"eval_loss", "train_loss", "tps", "srv_tps", "ttft_p99", "srv_compile"} | {
            f"gate_{s}" for s in ("serve", "numerics", "probes")
        }
        with urllib.request.urlopen(base + "/", timeout=10) as r:
            assert r.status == 200 and b"<html" in r.read().lower()  # the UI page itself
    finally:
        import os
        import signal

        os.killpg(server.pid, signal.SIGTERM)  # the CLI and its uvicorn workers
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait(timeout=30)


def make_mlflow_ui(port: int) -> list[str]:
    """`make mlflow-ui` as the README runs it, on this checkout's venv (already set up) and Makefile."""
    venv = Path(sys.executable).parent.parent
    return [
        "make",
        "-s",
        "-f",
        str(ROOT / "Makefile"),
        f"VENV={venv}",
        "-o",
        f"{venv}/.installed",
        "-o",
        f"{venv}/.runtime",
    ] + [
        f"MLFLOW_PORT={port}",
        "mlflow-ui",
    ]


def test_make_mlflow_ui_is_one_server_process_without_job_consumers(tmp_path):
    """The local UI as `make mlflow-ui` starts it: one uvicorn worker and no job runner or huey
    consumers (MLflow's defaults were 16 processes, ~2.9 GB), answering on its port."""
    import os
    import signal
    import time
    import urllib.request

    from project import descendants, free_port

    port = free_port()
    server = subprocess.Popen(
        make_mlflow_ui(port),
        cwd=tmp_path,
        env=env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 300
        while True:
            assert server.poll() is None, "make mlflow-ui exited"
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
                    if r.status == 200:
                        break
            except OSError:
                assert time.monotonic() < deadline, "make mlflow-ui did not answer in 300 s"
                time.sleep(0.5)
        time.sleep(3)  # the job runner, when enabled, starts its consumers after the server answers
        commands = []
        for pid in descendants(server.pid):
            try:
                commands.append(Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode())
            except OSError:
                pass
        pythons = [c for c in commands if not c.startswith("/bin/sh ")]  # make's shell runs the recipe
        assert not [c for c in pythons if "huey" in c or "jobs" in c], commands
        # the `mlflow ui` launcher and the one uvicorn server it runs (make's shell may sit above them)
        assert len(pythons) <= 2, commands
        assert (tmp_path / "mlflow.db").is_file()  # the project's store, where make ran
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait(timeout=30)


def test_make_prefect_ready_gives_up_in_its_bound_when_the_server_never_answers(tmp_path):
    """Every check of `make prefect-ready` is bounded: against a port that accepts connections and
    never answers (a server still starting), it stops after PREFECT_READY_S plus one check's bound
    (PREFECT_CHECK_S: 3 s here, 20 by default; the check cannot answer, so any bound proves it),
    with one line saying what to start."""
    import socket
    import time

    venv = Path(sys.executable).parent.parent
    with socket.socket() as mute:
        mute.bind(("127.0.0.1", 0))
        mute.listen(64)  # connections complete in the backlog; nothing is ever read or answered
        started = time.monotonic()
        done = subprocess.run(
            [
                "make",
                "-s",
                "-f",
                str(ROOT / "Makefile"),
                f"VENV={venv}",
                "-o",
                f"{venv}/.installed",
                "-o",
                f"{venv}/.runtime",
            ]
            + [f"PREFECT_PORT={mute.getsockname()[1]}", "PREFECT_READY_S=5", "PREFECT_CHECK_S=3", "prefect-ready"],
            cwd=tmp_path,
            env=env(),
            capture_output=True,
            text=True,
            timeout=120,
        )
        took = time.monotonic() - started
    assert done.returncode != 0 and "is make prefect-worker running?" in done.stderr, done.stderr
    assert took < 5 + 3 + 3 + 15, took  # the deadline, one bounded check, the pause, slack for a loaded machine


def test_the_shared_prefix_line_says_when_the_cache_comparison_is_within_noise():
    """One replay a side: a p50 gap smaller than both replays' p50-to-p99 spread is called noise,
    a larger one faster or slower; the README's sample line is what the summary prints on its figures."""

    def line(on_p50, on_p99, off_p50, off_p99):
        pc = {
            "on": {"ttft_p50_s": on_p50, "ttft_p99_s": on_p99, "hits": 46, "misses": 2},
            "off": {"ttft_p50_s": off_p50, "ttft_p99_s": off_p99},
            "identical_outputs_share": 1.0,
        }
        (out,) = summary._prefix_cache_line({"prefix_cache": pc})
        return out

    sample = line(0.2513, 0.7036, 0.0802, 0.2615)
    assert sample.endswith("within noise: the p50s differ by 0.1711s, less than either replay's p50-to-p99 spread")
    assert sample in README
    # a gap wider than the tighter replay's spread is a verdict, either way
    assert "slower with the cache by 0.2000s at p50" in line(0.30, 0.32, 0.10, 0.40)
    assert "faster with the cache by 0.2000s at p50" in line(0.10, 0.40, 0.30, 0.32)


def test_the_venv_was_byte_compiled_at_setup():
    """`make setup` byte-compiles the venv and the package: where PYTHONDONTWRITEBYTECODE is set,
    Python never writes a .pyc, and every process would compile every module it imports."""
    import importlib.util

    for module in ("torch", "torch._inductor.compile_fx", "mlflow", "laplace.pipeline.cli"):
        cached = Path(importlib.util.cache_from_source(importlib.util.find_spec(module).origin))
        assert cached.exists(), f"{cached} missing: make setup byte-compiles the venv (rm .venv/.installed; make setup)"


def copy_makefile(into: Path) -> None:
    """The Makefile and the pyproject.toml it depends on, for `make -n` of the install targets."""
    import shutil

    for name in ("Makefile", "pyproject.toml"):
        shutil.copy(ROOT / name, into / name)


def test_make_setup_takes_the_distributions_python_where_it_qualifies(tmp_path):
    """The venv's interpreter (Makefile): PYTHON when given, else SYSTEM_PYTHON (/usr/bin/python3)
    where it answers as a 3.11+ with venv, else python3 on PATH. Stand-ins for the interpreter
    (`make -n` runs only the check), so the rule is tested whatever this machine has."""
    copy_makefile(tmp_path)
    qualifies, too_old = tmp_path / "distro-python", tmp_path / "old-python"
    qualifies.write_text(f'#!/bin/sh\nexec {sys.executable} "$@"\n')  # this 3.11+, with venv
    too_old.write_text("#!/bin/sh\nexit 1\n")  # what the check sees of a 3.10 (sys.exit(True))
    for stand_in in (qualifies, too_old):
        stand_in.chmod(0o755)

    def venv_line(*args: str) -> str:
        out = subprocess.run(["make", "-n", "VENV=v", *args, "run"], cwd=tmp_path, capture_output=True, text=True)
        return next(part.strip() for part in out.stdout.split("&&") if " -m venv v" in part).split("else ")[-1]

    assert venv_line(f"SYSTEM_PYTHON={qualifies}") == f"{qualifies} -m venv v"
    assert venv_line(f"SYSTEM_PYTHON={too_old}") == "python3 -m venv v"
    assert venv_line(f"SYSTEM_PYTHON={tmp_path / 'absent'}") == "python3 -m venv v"
    assert venv_line(f"SYSTEM_PYTHON={qualifies}", "PYTHON=python3.12") == "python3.12 -m venv v"  # the user's pick


def test_make_run_installs_the_runtime_set_and_make_test_upgrades_it_to_dev(tmp_path):
    """`make run` installs `.` (no test oracles), `make test` `.[dev]`, also over a venv `make run`
    made; a dev venv needs no runtime install. The Makefile's own decisions (`make -n`, and with
    PYTHON=false, so that any install attempt fails): a real install takes minutes."""
    copy_makefile(tmp_path)

    def make(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(["make", "VENV=v", *args], cwd=tmp_path, capture_output=True, text=True, timeout=60)

    fresh = make("-n", "run").stdout
    assert "pip install --quiet --no-compile -e . " in fresh and "[dev]" not in fresh and "laplace run" in fresh
    assert "compileall -qq -j 0" in fresh  # the venv byte-compiled once, at setup (the Makefile says why)
    venv = tmp_path / "v"
    venv.mkdir()
    (venv / ".runtime").touch()  # what make run leaves
    assert "[dev]" not in make("-n", "run").stdout
    upgrade = make("-n", "test").stdout
    assert "pip install --quiet --no-compile -e '.[dev]'" in upgrade and "touch v/.installed v/.runtime" in upgrade
    assert "compileall -qq -j 0" in upgrade
    (venv / ".runtime").unlink()
    (venv / ".installed").touch()  # what make setup / make test leaves, in a venv without .runtime
    done = make("PYTHON=false", "v/.runtime")
    assert done.returncode == 0 and (venv / ".runtime").exists(), done.stdout + done.stderr
