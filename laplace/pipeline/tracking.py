"""MLflow glue: one MLflow run per pipeline run, and the model logged and registered with it.

Stages never talk to MLflow while they work: each writes plain metrics and plots to
disk, and the last stage (`track`) logs the whole pipeline run at once: every
effective param, each stage's metrics prefixed by the stage (`train/val_loss`), the
training curve as step metrics, plots as images, the tokenizer, the dataset (with
its DVC hash as digest) and the model, which is registered with the alias
`candidate` and moved to `champion` only when every validation stage passed.
So an MLflow outage never stops training, and every front door (dvc repro, the
Prefect flow, the CLI) produces the same kind of run.

The metrics/ and plots/ files are the spool: when the tracking server is down, `track`
retries with backoff for `tracking.retry_seconds`, then fails with one line
(TrackingUnavailable, exit status 75: transient, so the Prefect flow retries it); nothing
is lost, and rerunning `laplace track` (or `dvc repro`) logs the run once the server is back.

Nothing secret is logged: param and tag values are passed through `redact`, which masks
the value of every environment variable whose name says it is a secret (TOKEN, KEY,
SECRET, PASSWORD, PASSWD, CREDENTIAL) and the password of any URL (`https://user:***@host`).
"""

from __future__ import annotations

import json
import logging
import os
import re
import time
from pathlib import Path

from laplace.config import GenerateSection
from laplace.pipeline.redact import redact, secret_values
from laplace.pipeline.store import (
    DEFAULT_RETRY_SECONDS,
    TrackingUnavailable,
    _connection_lost,
    _retrying,
    _short_reason,
    tracking_store,
    tracking_uri,
    unavailable_message,
    wait_for_tracking,
)

log = logging.getLogger(__name__)

# Stages whose metrics carry a `passed` gate; all must pass for the champion alias.
VALIDATION_STAGES = ("serve", "numerics", "probes")


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


# --------------------------------------------------------------------------- logging a run


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
    retry_seconds: float | None = None,
) -> dict:
    """Create one MLflow run holding the whole pipeline run. Returns ids and the model version.

    First waits up to `retry_seconds` (default: the params' tracking.retry_seconds) for the
    tracking server, else raises TrackingUnavailable having logged nothing. Param and tag
    values go through `redact`."""
    import mlflow
    from mlflow import MlflowClient

    if retry_seconds is None:
        retry_seconds = float(params.get("tracking.retry_seconds", DEFAULT_RETRY_SECONDS))
    secrets = secret_values()
    uri, artifacts = tracking_store(root)
    deadline = wait_for_tracking(uri, retry_seconds)
    mlflow.set_tracking_uri(uri)
    client = MlflowClient(uri)

    def ensure_experiment():
        found = client.get_experiment_by_name(experiment)
        if found is not None:
            return found.experiment_id
        return client.create_experiment(experiment, artifact_location=artifacts)

    experiment_id = _retrying(ensure_experiment, uri, deadline, retry_seconds)
    gate_results = gates(metrics_by_stage)
    champion = bool(gate_results) and all(v is True for v in gate_results.values())
    all_tags = {
        **tags,
        "params_hash": params_hash,
        **{f"gate.{k}": {True: "passed", False: "failed", None: "missing"}[v] for k, v in gate_results.items()},
    }
    try:  # MLflow's own run-context tags (user, source, git) come from the environment too
        from mlflow.tracking.context.registry import resolve_tags

        all_tags = {**{k: v for k, v in resolve_tags({}).items() if redact(v, secrets) != v}, **all_tags}
    except ImportError:
        pass
    all_tags = {k: redact(v, secrets) for k, v in all_tags.items()}

    run_id = None
    # MLflow prints "View run ... at: <tracking URI>/#/..." to stdout, credentials included: with
    # a user:password URI, silence it and log the link with the password masked instead.
    hide_url = redact(uri, secrets) != uri
    saved = os.environ.get("MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT")
    try:
        if hide_url:
            os.environ["MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT"] = "true"
        with mlflow.start_run(experiment_id=experiment_id, run_name=redact(run_name, secrets), tags=all_tags) as run:
            run_id = run.info.run_id
            version = _log_run_contents(
                client,
                run_id,
                params=params,
                secrets=secrets,
                metrics_by_stage=metrics_by_stage,
                step_series=step_series,
                plots_dir=plots_dir,
                tokenizer_path=tokenizer_path,
                export_dir=export_dir,
                dataset_path=dataset_path,
                dataset_digest=dataset_digest,
                model_name=model_name,
                register=register,
                champion=champion,
            )
    except Exception as exc:  # the server went away mid-run: the same one line as above
        if isinstance(exc, TrackingUnavailable) or not _connection_lost(exc):
            raise
        during = f" while logging run {run_id} (left incomplete)" if run_id else ""
        raise TrackingUnavailable(unavailable_message(uri, _short_reason(exc), retry_seconds, during)) from exc
    finally:
        if hide_url:
            if saved is None:
                os.environ.pop("MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT", None)
            else:
                os.environ["MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT"] = saved
    if hide_url:
        log.info(
            "MLflow run %s: %s/#/experiments/%s/runs/%s",
            run_id,
            redact(uri, secrets).rstrip("/"),
            experiment_id,
            run_id,
        )
    return {
        "tracking_uri": redact(uri, secrets),
        "experiment_id": experiment_id,
        "run_id": run_id,
        "model_name": model_name if register else None,
        "model_version": int(version) if version is not None else None,
        "champion": champion and version is not None,
        "gates": {k: v for k, v in gate_results.items()},
    }


def _log_run_contents(
    client,
    run_id: str,
    *,
    params,
    secrets,
    metrics_by_stage,
    step_series,
    plots_dir,
    tokenizer_path,
    export_dir,
    dataset_path,
    dataset_digest,
    model_name,
    register,
    champion,
) -> int | str | None:
    """Params, metrics, dataset input, artifacts and the model of the active run; the model version."""
    import mlflow
    from mlflow.data.dataset_source_registry import resolve_dataset_source
    from mlflow.data.meta_dataset import MetaDataset
    from mlflow.entities import Metric, Param
    from mlflow.models import infer_signature

    now = int(time.time() * 1000)
    param_items = [Param(k, redact(str(v), secrets)[:6000]) for k, v in sorted(params.items())]
    metrics = [
        Metric(k, v, now, 0)
        for stage, m in sorted(metrics_by_stage.items())
        for k, v in sorted(flatten_metrics(stage, m).items())
    ]
    metrics += [Metric(k, float(v), now, int(step)) for k, series in step_series.items() for step, v in series]
    for i in range(0, len(param_items), 100):
        client.log_batch(run_id, params=param_items[i : i + 100])
    for i in range(0, len(metrics), 500):
        client.log_batch(run_id, metrics=metrics[i : i + 500])
    if dataset_path is not None and dataset_digest:
        # MLflow caps digests at 36 characters: a DVC md5 (".dir" included) fits, the manifest's
        # sha256 (the fallback outside DVC) is cut to its first 36 hex digits
        dataset = MetaDataset(
            source=resolve_dataset_source(str(dataset_path)), name="tokenized", digest=dataset_digest[:36]
        )
        mlflow.log_input(dataset, context="training")
    if plots_dir is not None and plots_dir.exists():
        mlflow.log_artifacts(str(plots_dir), "plots")
    if tokenizer_path is not None and tokenizer_path.exists():
        mlflow.log_artifact(str(tokenizer_path), "tokenizer")

    if export_dir is None or not (export_dir / "config.json").exists():
        return None
    import pandas as pd

    import laplace
    from laplace.serving.engine import SHAPE_KEYS

    generate = GenerateSection()
    example = pd.DataFrame({"prompt": ["The function"]})
    # the serving payload shown by the MLflow UI and used with `mlflow models serve` (serving_input_example.json)
    example_params = {"max_new_tokens": 16, "temperature": 0.0, "top_p": 1.0, "seed": generate.seed}
    signature = infer_signature(
        model_input=example,
        model_output=["text"],
        params={
            "max_new_tokens": int(params.get("generate.max_new_tokens", generate.max_new_tokens)),
            "temperature": 0.0,
            "top_p": 1.0,
            "seed": int(params.get("generate.seed", generate.seed)),
        },
    )
    info = mlflow.pyfunc.log_model(
        name="model",
        python_model=str(Path(laplace.__file__).parent / "pipeline" / "mlflow_model.py"),  # from code: no pickle
        artifacts={"export": str(export_dir)},
        signature=signature,
        input_example=(example, example_params),
        model_config={k: params[f"serve.{k}"] for k in SHAPE_KEYS if f"serve.{k}" in params},  # the engine's shapes
        code_paths=[str(Path(laplace.__file__).parent)],
        pip_requirements=["torch>=2.13", "numpy", "safetensors", "tokenizers", "pandas"],
        registered_model_name=model_name if register else None,
    )
    version = info.registered_model_version
    if register and version is not None:
        client.set_registered_model_alias(model_name, "candidate", str(version))
        if champion:
            client.set_registered_model_alias(model_name, "champion", str(version))
    return version


def load_registered_model(root: Path, model_name: str, alias: str = "candidate"):
    """The registered pyfunc by alias (used by tests and by users: models:/name@alias)."""
    import mlflow

    mlflow.set_tracking_uri(tracking_uri(root))
    return mlflow.pyfunc.load_model(f"models:/{model_name}@{alias}")


def read_json(path: Path) -> dict | list | None:
    return json.loads(path.read_text()) if path.exists() else None
