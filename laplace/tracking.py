"""MLflow glue: one MLflow run per pipeline run, and the generator as an MLflow pyfunc model.

Stages never talk to MLflow while they work: each writes plain metrics and plots to
disk, and the last stage (`track`) logs the whole pipeline run at once: every
effective param, each stage's metrics prefixed by the stage (`train/val_loss`), the
training curve as step metrics, plots as images, the tokenizer, the dataset (with
its DVC hash as digest) and the model, which is registered with the alias
`candidate` and moved to `champion` only when every validation stage passed.
So an MLflow outage never stops training, and every front door (dvc repro, the
Prefect flow, the CLI) produces the same kind of run.
"""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import time
from pathlib import Path

import mlflow.pyfunc
import yaml

log = logging.getLogger(__name__)

# Stages whose metrics carry a `passed` gate; all must pass for the champion alias.
VALIDATION_STAGES = ("serve", "numerics")


# --------------------------------------------------------------------------- where


def project_root(start: str | Path = ".") -> Path:
    """The project directory. Queued DVC experiments run in a copy under
    <project>/.dvc/tmp/exps/...; their tracking store is still the project's."""
    path = Path(start).resolve()
    parts = path.parts
    for i in range(len(parts) - 3):
        if parts[i:i + 3] == (".dvc", "tmp", "exps"):
            return Path(*parts[:i])
    return path


def tracking_store(root: str | Path = ".") -> tuple[str, str | None]:
    """(tracking URI, artifact location for new experiments).

    MLFLOW_TRACKING_URI if set (its server or default decides where artifacts go), else a
    sqlite database at an absolute path in the project with artifacts in mlartifacts/.
    Read this before mlflow.set_tracking_uri, which exports MLFLOW_TRACKING_URI itself."""
    if uri := os.environ.get("MLFLOW_TRACKING_URI"):
        return uri, None
    root = project_root(root)
    return f"sqlite:///{root / 'mlflow.db'}", (root / "mlartifacts").as_uri()


def tracking_uri(root: str | Path = ".") -> str:
    return tracking_store(root)[0]


# --------------------------------------------------------------------------- provenance


def git_info(root: Path) -> dict:
    def git(*args):
        out = subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, timeout=30)
        return out.stdout.strip() if out.returncode == 0 else ""

    commit = git("rev-parse", "HEAD")
    dirty = bool(git("status", "--porcelain", "--untracked-files=no"))
    return {"commit": commit or "unknown", "dirty": dirty}


def dvc_out_hash(root: Path, out_path: str) -> str | None:
    """The md5 DVC recorded in dvc.lock for one output (a directory hash ends in .dir)."""
    lock = Path(root) / "dvc.lock"
    if not lock.exists():
        return None
    data = yaml.safe_load(lock.read_text()) or {}
    for stage in (data.get("stages") or {}).values():
        for out in stage.get("outs") or []:
            if out.get("path") == out_path:
                return out.get("md5") or out.get("hash")
    return None


# --------------------------------------------------------------------------- metrics


def flatten_metrics(stage: str, metrics: dict) -> dict[str, float]:
    """Numeric leaves of a stage's metrics as `stage/key/subkey` (booleans as 0/1)."""
    out: dict[str, float] = {}

    def walk(prefix: str, value):
        if isinstance(value, bool):
            out[prefix] = float(value)
        elif isinstance(value, (int, float)) and value == value and abs(value) != float("inf"):
            out[prefix] = float(value)
        elif isinstance(value, dict):
            for k, v in value.items():
                walk(f"{prefix}/{k}", v)

    walk(stage, metrics)
    return {re.sub(r"[^\w\-./ ]", "_", k): v for k, v in out.items()}


def gates(metrics_by_stage: dict[str, dict]) -> dict[str, bool | None]:
    """passed / failed / missing (None) for each validation stage."""
    result = {}
    for stage in VALIDATION_STAGES:
        m = metrics_by_stage.get(stage)
        result[stage] = None if m is None else bool(m.get("passed"))
    return result


# --------------------------------------------------------------------------- pyfunc


class LaplaceGenerator(mlflow.pyfunc.PythonModel):
    """Text generation from an exported Laplace model (safetensors; nothing unpickled).

    Input: a DataFrame with a `prompt` column, a list of prompts or one prompt.
    Params: max_new_tokens, temperature, top_p, seed. Output: the completions.
    No type hints on predict: with them MLflow would drop the runtime params.
    """

    def load_context(self, context):
        from laplace.export import load_export

        self.model, self.tokenizer, self.config = load_export(context.artifacts["export"])

    def predict(self, context, model_input, params=None):
        import torch

        from laplace.generation import generate_ids

        params = params or {}
        if hasattr(model_input, "columns"):
            column = "prompt" if "prompt" in model_input.columns else model_input.columns[0]
            prompts = [str(p) for p in model_input[column].tolist()]
        elif isinstance(model_input, str):
            prompts = [model_input]
        elif isinstance(model_input, dict):
            prompts = list(model_input["prompt"]) if not isinstance(model_input["prompt"], str) \
                else [model_input["prompt"]]
        else:
            prompts = [str(p) for p in model_input]
        eos = self.config.get("eos_id")
        out = []
        with torch.inference_mode():
            for prompt in prompts:
                ids = generate_ids(
                    self.model, self.tokenizer.encode(prompt).ids,
                    int(params.get("max_new_tokens", 48)), float(params.get("temperature", 0.0)),
                    float(params.get("top_p", 1.0)), int(params.get("seed", 0)),
                    stop_ids=(eos,) if eos is not None else (),
                )
                out.append(self.tokenizer.decode(ids))
        return out


# --------------------------------------------------------------------------- logging a run


def _retrying(fn, what: str, attempts: int = 4, delay: float = 2.0):
    for attempt in range(1, attempts + 1):
        try:
            return fn()
        except Exception as exc:  # the store may be a server that is restarting
            if attempt == attempts:
                raise RuntimeError(f"MLflow {what} failed after {attempts} attempts: {exc}") from exc
            log.warning("MLflow %s failed (%s); retrying in %.0fs", what, exc, delay)
            time.sleep(delay)
            delay *= 2


def log_pipeline_run(
    *,
    root: Path,
    params: dict,
    params_hash: str,
    experiment: str,
    model_name: str,
    register: bool,
    metrics_by_stage: dict[str, dict],
    step_series: dict[str, list[tuple[int, float]]],
    plots_dir: Path | None,
    tokenizer_path: Path | None,
    export_dir: Path | None,
    dataset_path: Path | None,
    dataset_digest: str | None,
    run_name: str,
    tags: dict[str, str],
) -> dict:
    """Create one MLflow run holding the whole pipeline run. Returns ids and the model version."""
    import mlflow
    from mlflow import MlflowClient
    from mlflow.data.dataset_source_registry import resolve_dataset_source
    from mlflow.data.meta_dataset import MetaDataset
    from mlflow.entities import Metric, Param
    from mlflow.models import infer_signature

    uri, artifacts = tracking_store(root)
    mlflow.set_tracking_uri(uri)
    client = MlflowClient(uri)

    def ensure_experiment():
        found = client.get_experiment_by_name(experiment)
        if found is not None:
            return found.experiment_id
        return client.create_experiment(experiment, artifact_location=artifacts)

    experiment_id = _retrying(ensure_experiment, "experiment lookup")
    gate_results = gates(metrics_by_stage)
    champion = bool(gate_results) and all(v is True for v in gate_results.values())

    with mlflow.start_run(experiment_id=experiment_id, run_name=run_name) as run:
        run_id = run.info.run_id
        now = int(time.time() * 1000)
        param_items = [Param(k, str(v)[:6000]) for k, v in sorted(params.items())]
        metrics = [Metric(k, v, now, 0) for stage, m in sorted(metrics_by_stage.items())
                   for k, v in sorted(flatten_metrics(stage, m).items())]
        metrics += [Metric(k, float(v), now, int(step)) for k, series in step_series.items() for step, v in series]
        for i in range(0, len(param_items), 100):
            client.log_batch(run_id, params=param_items[i:i + 100])
        for i in range(0, len(metrics), 500):
            client.log_batch(run_id, metrics=metrics[i:i + 500])
        all_tags = {**tags, "params_hash": params_hash,
                    **{f"gate.{k}": {True: "passed", False: "failed", None: "missing"}[v]
                       for k, v in gate_results.items()}}
        mlflow.set_tags(all_tags)
        if dataset_path is not None and dataset_digest:
            dataset = MetaDataset(source=resolve_dataset_source(str(dataset_path)), name="tokenized",
                                  digest=dataset_digest)
            mlflow.log_input(dataset, context="training")
        if plots_dir is not None and plots_dir.exists():
            mlflow.log_artifacts(str(plots_dir), "plots")
        if tokenizer_path is not None and tokenizer_path.exists():
            mlflow.log_artifact(str(tokenizer_path), "tokenizer")

        version = None
        if export_dir is not None and (export_dir / "config.json").exists():
            import pandas as pd

            import laplace

            signature = infer_signature(
                model_input=pd.DataFrame({"prompt": ["The function"]}),
                model_output=["text"],
                params={"max_new_tokens": 48, "temperature": 0.0, "top_p": 1.0, "seed": 0},
            )
            info = mlflow.pyfunc.log_model(
                name="model",
                python_model=str(Path(laplace.__file__).parent / "mlflow_model.py"),  # from code: no pickle
                artifacts={"export": str(export_dir)},
                signature=signature,
                input_example=pd.DataFrame({"prompt": ["The function"]}),
                code_paths=[str(Path(laplace.__file__).parent)],
                pip_requirements=["torch>=2.13", "safetensors", "tokenizers", "pandas"],
                registered_model_name=model_name if register else None,
            )
            version = info.registered_model_version
            if register and version is not None:
                client.set_registered_model_alias(model_name, "candidate", str(version))
                if champion:
                    client.set_registered_model_alias(model_name, "champion", str(version))
    return {
        "tracking_uri": uri,
        "experiment_id": experiment_id,
        "run_id": run_id,
        "model_name": model_name if register else None,
        "model_version": int(version) if version is not None else None,
        "champion": champion and version is not None,
        "gates": {k: v for k, v in gate_results.items()},
    }


def load_registered_model(root: Path, model_name: str, alias: str = "candidate"):
    """The registered pyfunc by alias (used by tests and by users: models:/name@alias)."""
    import mlflow

    mlflow.set_tracking_uri(tracking_uri(root))
    return mlflow.pyfunc.load_model(f"models:/{model_name}@{alias}")


def read_json(path: Path) -> dict | list | None:
    return json.loads(path.read_text()) if path.exists() else None
