"""The `laplace` command line as a newcomer meets it: no arguments, options before the command, a
knob value that would crash a stage later."""

from __future__ import annotations

import subprocess

from project import BIN, ROOT


def laplace(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(BIN / "laplace"), *args], cwd=ROOT, capture_output=True, text=True, timeout=120)


def test_no_arguments_lists_the_commands():
    done = laplace()
    assert done.returncode == 2
    for command in ("run", "summary", "serve", "import", "train", "eval"):
        assert f"\n    {command} " in done.stdout, command  # each with its help line


def test_options_before_the_command_are_the_commands():
    done = laplace("--set", "model.d_model=abc", "info")  # understood as `laplace info --set ...`
    assert done.returncode == 2 and "invalid choice" not in done.stderr
    assert done.stderr.strip() == "laplace info: error: model.d_model: expected int, got str 'abc'"


def test_an_empty_exact_workload_list_is_refused_before_anything_runs():
    done = laplace("info", "--set", "serve_check.exact_workloads=[]")
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1
    assert "serve_check.exact_workloads: must name at least one workload" in done.stderr


def test_serving_a_registered_model_before_anything_is_tracked_is_one_line_and_creates_nothing(tmp_path):
    import os
    import shutil

    shutil.copy(ROOT / "params.yaml", tmp_path / "params.yaml")
    clean = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
    done = subprocess.run(
        [str(BIN / "laplace"), "serve", "--model", "models:/laplace-gla@champion"],
        cwd=tmp_path,
        env=clean,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert "nothing is tracked yet" in done.stderr and "run `laplace run` first" in done.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["params.yaml"]  # no empty mlflow.db


def test_the_summary_of_an_unfinished_run_says_so_and_that_nothing_is_tracked(tmp_path):
    import json
    import shutil

    shutil.copy(ROOT / "params.yaml", tmp_path / "params.yaml")
    (tmp_path / "metrics").mkdir()
    (tmp_path / "metrics" / "corpus.json").write_text(json.dumps({"documents": 10}))  # a run stopped after corpus
    done = subprocess.run([str(BIN / "laplace"), "summary"], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    status = [line for line in done.stdout.splitlines() if line.startswith("status")]
    assert status and "UNFINISHED: no results yet from tokenize, warmup, train" in status[0], done.stdout
    assert "nothing is tracked in MLflow yet" in done.stdout
    assert done.stdout.index("UNFINISHED") < done.stdout.index("next ")  # before the next steps
