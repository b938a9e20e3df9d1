"""How a pipeline run reads in MLflow: stage figures flattened to metric names, the figures
table, the saved runs-table view of the headline figures and the UI links that open it.
Plain data in and out (no MLflow import): the tracking module logs what these build."""

from __future__ import annotations

import json
import re
import time
from urllib.parse import urlsplit

# The experiment tag that marks an experiment as model training rather than GenAI development.
EXPERIMENT_KIND = ("mlflow.experimentKind", "custom_model_development")
# A saved view of the runs table (MLflow 3's "Views" menu keeps them as experiment tags under
# this prefix) showing the headline figures as columns, and the UI link that opens it. MLflow
# 3.17's UI opens an experiment in the workflow last picked in the browser (GenAI by default,
# whatever the tag says) unless the link names one, so the link says `machine_learning`.
VIEW_TAG_PREFIX = "mlflow.sharedViewState."
HEADLINE_VIEW = "headline"
# The runs table at laptop width: the figures that answer "which run is better" and the params
# that varied between runs (these when none has yet); the rest is one click away in each run.
VIEW_METRICS = ("eval_loss", "train_loss", "tps", "ttft_p99", "srv_tps")
VIEW_PARAMS = ("train.lr", "train.steps", "model.preset")
VIEW_MAX_PARAMS = 5


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


def headline_view(existing: str | None, params: tuple[str, ...] | list[str] = VIEW_PARAMS) -> str | None:
    """The saved runs-table view "Headline figures" (an MLflow saved-view envelope: name, times,
    the table state as JSON): VIEW_METRICS and `params` (those that varied) as columns, in that
    order right after the run's name and start, narrow enough that the first ones show at a
    laptop's 1,440 px beside MLflow's Assistant panel. None when `existing` already holds it."""
    first = [f"metrics.`{name}`" for name in VIEW_METRICS[:4]]
    shown = [f"params.`{name}`" for name in list(params)[:VIEW_MAX_PARAMS]]
    later = [f"metrics.`{name}`" for name in VIEW_METRICS[4:]]
    models = "attributes.`Models`"
    state = json.dumps(
        {
            "selectedColumns": first + shown + later + [models],
            # the UI's own keys for a table whose columns were dragged and resized (ag-grid colIds)
            "columnOrder": first + shown + later,
            "columnWidths": {**{c: 84 for c in first + later}, **{c: 92 for c in shown}, models: 130},
        }
    )
    now = int(time.time() * 1000)
    try:
        old = json.loads(existing) if existing else None
    except ValueError:
        old = None
    if isinstance(old, dict) and old.get("state") == state:
        return None
    created = old.get("createdAt", now) if isinstance(old, dict) else now
    return json.dumps({"name": "Headline figures", "createdAt": created, "updatedAt": now, "state": state})


def varied_params(current: dict[str, str], earlier: list[dict[str, str]]) -> list[str]:
    """The params whose value differs between this run and an earlier one (train.lr first, then
    by name), or VIEW_PARAMS when nothing varied yet."""
    keys = set(current) | {k for params in earlier for k in params}
    varied = sorted(k for k in keys if any(params.get(k) != current.get(k) for params in earlier))
    varied.sort(key=lambda k: (k not in VIEW_PARAMS, k))
    return varied or list(VIEW_PARAMS)


def ui_url(tracking_uri: str, experiment_id: str, run_id: str | None = None, base: str | None = None) -> str:
    """The MLflow UI page of the experiment's runs table in the headline view (or of one run).
    `base`: the UI's address; default the tracking server itself, or `mlflow ui`'s
    http://127.0.0.1:5000 for a local store."""
    if base is None and tracking_uri.startswith("http"):
        parts = urlsplit(tracking_uri)
        base = f"{parts.scheme}://{parts.hostname}{f':{parts.port}' if parts.port else ''}{parts.path.rstrip('/')}"
    base = base or "http://127.0.0.1:5000"
    if run_id:
        return f"{base}/#/experiments/{experiment_id}/runs/{run_id}?workflowType=machine_learning"
    return f"{base}/#/experiments/{experiment_id}/runs?workflowType=machine_learning&viewStateShareKey={HEADLINE_VIEW}"


def figures_table(metrics_by_stage: dict[str, dict]) -> dict[str, list]:
    """Every numeric figure of every stage as one table (columns stage, figure, value)."""
    rows = [
        (stage, name.split("/", 1)[1], value)
        for stage, m in sorted(metrics_by_stage.items())
        for name, value in sorted(flatten_metrics(stage, m).items())
    ]
    return {"stage": [r[0] for r in rows], "figure": [r[1] for r in rows], "value": [r[2] for r in rows]}
