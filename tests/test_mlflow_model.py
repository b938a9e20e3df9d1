"""The registered MLflow model predicts through the serving engine, and `mlflow models serve` on it
answers as the MLflow UI's instructions say: the logged input example is a valid serving payload,
`mlflow.models.predict` on it works, and a bad request is a message, never a stack trace.

The registered model is real: the track stage logs a trained and exported tiny model (the
session's `tiny_artifacts`) into a sqlite MLflow store, with every validation gate passed."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx
import mlflow
import psutil
import pytest

from laplace.config import EngineSection
from laplace.pipeline.layout import Paths
from laplace.pipeline.params import load_config
from laplace.pipeline.stages import STAGES
from laplace.serving.engine import DecodeEngine
from laplace.serving.scheduler import Request

from project import descendants, free_port, wait_until_answers, write_stage_results

pytestmark = pytest.mark.slow

SERVE = {
    "engine.max_slots": 2,
    "engine.widths": [1, 2],
    "engine.prefill_buckets": [16, 32],
    "engine.max_prompt_tokens": 48,
}


@pytest.fixture(scope="module")
def registered(tiny_artifacts, tmp_path_factory):
    """A project whose track stage registered the tiny model as champion: (project, model_uri, export)."""
    data_dir, export_dir = tiny_artifacts
    project = tmp_path_factory.mktemp("registered")
    write_stage_results(project)
    (project / "metrics" / "probes.json").write_text(json.dumps({"passed": True}))
    shutil.copytree(data_dir, project / "data" / "tokenized")
    shutil.copytree(export_dir, project / "artifacts" / "export")
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("MLFLOW_TRACKING_URI", raising=False)
        mp.chdir(project)
        cfg = load_config(project / "params.yaml", {"tracking.retry_seconds": 0, **SERVE})
        summary = STAGES["track"].run(cfg, Paths.at(project))
    assert summary["champion"], summary
    mlflow.set_tracking_uri(f"sqlite:///{project / 'mlflow.db'}")
    return project, "models:/laplace-gla@champion", export_dir, cfg


def engine_for(cfg, export_dir):
    from laplace.model.export import load_export

    model, tokenizer, config = load_export(export_dir)
    s = cfg.engine
    params = dataclasses.replace(s, max_queue=EngineSection().max_queue, prefix_cache_bytes=0)
    engine = DecodeEngine(model, params, "padded", compiled=False)
    return engine, tokenizer, config["eos_id"]


def test_the_pyfunc_predicts_a_batch_through_the_engine_at_the_ladder_widths(registered):
    project, uri, export_dir, cfg = registered
    model = mlflow.pyfunc.load_model(uri)
    inner = model.unwrap_python_model()
    assert inner.engine.scheduler.ladder == [1, 2] and inner.engine.runner.buckets == [
        16,
        32,
    ]  # the run's engine: shapes
    widths = []
    step = inner.engine.runner.decode_step  # every decode step
    inner.engine.runner.decode_step = lambda batch: widths.append(batch.width) or step(batch)
    prompts = ["The function", "A class is", "Return the value of the"]
    out = model.predict({"prompt": prompts}, params={"max_new_tokens": 7, "temperature": 0.0})
    assert set(widths) == {1, 2}  # three prompts on two slots: decoded together, padded to the ladder
    engine, tokenizer, eos = engine_for(cfg, export_dir)
    for prompt, text in zip(prompts, out):  # each equals the same prompt alone through the engine
        (alone,) = engine.complete([Request(0, tokenizer.encode(prompt).ids, 7, stop_ids=(eos,))])
        assert text == tokenizer.decode(alone.output_ids)
    assert inner.engine.cache.pool.owners == {} and not inner.engine.scheduler.steps  # nothing kept between batches
    with pytest.raises(mlflow.exceptions.MlflowException, match="prompt '': empty prompt"):
        model.predict({"prompt": [""]})


def test_the_ui_validation_snippet_works_as_written(registered, capsys):
    """The MLflow UI shows `mlflow.models.predict(model_uri, input_data=pyfunc_model.input_example,
    env_manager=...)` for a model logged with an input example; `local` stands in for `uv`, which
    would build a fresh environment (torch included) from PyPI."""
    _, uri, _, _ = registered
    pyfunc_model = mlflow.pyfunc.load_model(uri)
    assert list(pyfunc_model.input_example["prompt"]) == ["The function"]
    mlflow.models.predict(model_uri=uri, input_data=pyfunc_model.input_example, env_manager="local")
    assert '"predictions"' in capsys.readouterr().out


def test_mlflow_models_serve_answers_one_request_and_a_bad_one_with_a_message(registered, tmp_path):
    project, uri, export_dir, cfg = registered
    logged = mlflow.pyfunc.load_model(uri)
    local = Path(mlflow.artifacts.download_artifacts(artifact_uri=uri, dst_path=str(tmp_path / "model")))
    example = (local / "serving_input_example.json").read_text()  # what the docs tell users to curl
    assert json.loads(example)["params"]["max_new_tokens"] == 16
    port = free_port()
    env = {
        **os.environ,
        "MLFLOW_TRACKING_URI": f"sqlite:///{project / 'mlflow.db'}",
        "OMP_NUM_THREADS": "1",
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
    }
    proc = subprocess.Popen(
        [sys.executable, "-m", "mlflow", "models", "serve", "-m", uri, "--env-manager", "local"]
        + ["--host", "127.0.0.1", "--port", str(port)],
        cwd=project,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until_answers(proc, url + "/ping", 300)
        headers = {"Content-Type": "application/json"}
        r = httpx.post(url + "/invocations", content=example, headers=headers, timeout=120)
        assert r.status_code == 200, r.text
        served = r.json()["predictions"]
        expected = logged.predict({"prompt": ["The function"]}, params=json.loads(example)["params"])
        assert served == expected and len(served) == 1 and isinstance(served[0], str)
        bad = {"dataframe_split": {"columns": ["prompt"], "data": [[""]]}}
        r = httpx.post(url + "/invocations", json=bad, timeout=120)
        assert r.status_code == 400, r.text
        body = r.json()
        assert "empty prompt" in body["message"] and "stack_trace" not in body and "Traceback" not in r.text
    finally:
        children = descendants(proc.pid)  # the CLI execs uvicorn in a child (which it SIGTERMs as it dies)
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        for pid in children:
            for _ in range(100):
                if not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                    break
                time.sleep(0.1)
            else:
                os.kill(pid, 9)


def test_laplace_serve_serves_the_registered_champion(registered):
    """README's `laplace serve --model models:/laplace-gla@champion`: the CLI downloads the
    registered export from the project's MLflow store and answers as the pyfunc does (greedy)."""
    project, uri, _, _ = registered
    port = free_port()
    overrides = [a for k, v in SERVE.items() for a in ("--set", f"{k}={json.dumps(v)}")]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("MLFLOW_TRACKING_URI", None)  # found from the project's mlflow.db, as a user's would be
    proc = subprocess.Popen(
        [str(Path(sys.executable).parent / "laplace"), "serve", "--model", uri, "--port", str(port)]
        + ["--policy", "eager", *overrides],
        cwd=project,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until_answers(proc, url + "/health", 300)  # ready once the engine is built
        (served_model,) = httpx.get(url + "/v1/models", timeout=10).json()["data"]
        body = {"model": served_model["id"], "prompt": "The function", "max_tokens": 16, "temperature": 0}
        r = httpx.post(url + "/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        expected = mlflow.pyfunc.load_model(uri).predict(
            {"prompt": ["The function"]}, params={"max_new_tokens": 16, "temperature": 0.0}
        )
        assert [r.json()["choices"][0]["text"]] == expected
    finally:
        proc.terminate()
        try:
            assert proc.wait(timeout=60) == 0  # SIGTERM drains and exits 0
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
