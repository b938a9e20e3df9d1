"""MLflow glue: one MLflow run per pipeline run, and the model logged and registered with it.

Stages never talk to MLflow while they work: each writes plain metrics and plots to
disk, and the last stage (`track`) logs the whole pipeline run at once: every
effective param, the headline figures under short names (`eval_loss`, `tps`, ...:
laplace.tracking.headline; the loss curves as step histories), every detailed figure as
artifacts (the metrics/*.json files and one table, `figures.json`), plots as images, the
tokenizer, the dataset (with its DVC hash as digest) and the model. So an MLflow outage
never stops training, and every front door (dvc repro, the Prefect flow, the CLI)
produces the same kind of run. The experiment is tagged as model training
(`mlflow.experimentKind`), so the UI opens on its runs, not on the GenAI overview.

The run starts when the pipeline run did: at the first stage measured in it. A stage that
DVC did not run this time (up to date, or restored from its run-cache) carries the
measurement stamp of the run that did, and the MLflow run says so: the tag
`source.<stage>` reads "cached from run NAME (ID), measured TIME" instead of presenting
old timings as new (laplace.tracking.provenance).

The model is registered with the alias `candidate`, and takes `champion` when the champion
rule (laplace.tracking.champion) says so; the decision and its reason are the run's tags
`registered_as` and `registered_reason`, and the summary prints them. What the run looks
like in the UI (metric names, the headline view, links) is laplace.tracking.views;
where each stage's figures came from is laplace.tracking.provenance.

The metrics/ and plots/ files are the spool: when the tracking server is down, `track`
retries with backoff for `tracking.retry_seconds`, then fails with one line
(TrackingUnavailable, exit status 75: transient, so the Prefect flow retries it); nothing
is lost, and rerunning `laplace track` (or `dvc repro`) logs the run once the server is back.

Nothing secret is logged: param and tag values are passed through `redact`, which masks
the value of every environment variable whose name says it is a secret (TOKEN, KEY,
SECRET, PASSWORD, PASSWD, CREDENTIAL) and the password of any URL (`https://user:***@host`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
import warnings
from datetime import UTC, datetime
from pathlib import Path

from laplace.config import Config
from laplace.tracking.champion import COMPARABLE_TAGS, champion_decision
from laplace.tracking.headline import GATE_NAMES, HEADLINE, gates, gates_word, mlflow_metrics, rounded
from laplace.tracking.provenance import measured_tag, measurement_sources, pipeline_started, source_text
from laplace.tracking.redact import redact, secret_values
from laplace.tracking.store import (
    TrackingUnavailable,
    _connection_lost,
    _retrying,
    _short_reason,
    tracking_store,
    tracking_uri,
    unavailable_message,
    wait_for_tracking,
)
from laplace.tracking.views import (
    EXPERIMENT_KIND,
    HEADLINE_VIEW,
    VIEW_TAG_PREFIX,
    figures_table,
    headline_view,
    ui_url,
    varied_params,
)

log = logging.getLogger(__name__)


# --------------------------------------------------------------------------- the current champion


def recall_tags(probes: dict) -> dict[str, str]:
    """The recall suite's plain verdict as one run tag, `recall`: overall, then per length (one tag,
    not one a length: the run keeps few tags for a person to read)."""
    by_length = probes.get("recall_verdict") or {}
    if not probes.get("recall_summary"):
        return {}
    per_length = "; ".join(f"{ctx}: {v}" for ctx, v in sorted(by_length.items(), key=lambda kv: int(kv[0])))
    return {"recall": probes["recall_summary"] + (f" ({per_length})" if per_length else "")}


def current_champion(client, model_name: str) -> dict | None:
    """The version holding the champion alias: its number, val_loss and comparability tags."""
    from mlflow.exceptions import MlflowException

    try:
        version = client.get_model_version_by_alias(model_name, "champion")
    except MlflowException:  # no such model, or no champion yet
        return None
    run = client.get_run(version.run_id)
    recall: dict = {}
    for name, value in run.data.metrics.items():  # probes/recall/<task>/<context>, as flatten_metrics logs them
        parts = name.split("/")
        if len(parts) == 4 and parts[:2] == ["probes", "recall"]:
            recall.setdefault(parts[2], {})[parts[3]] = value
    return {
        "version": version.version,
        "run_id": version.run_id,
        "val_loss": run.data.metrics.get("eval_loss"),
        "recall": recall,
        "recall_samples": _int_or_none(run.data.params.get("probes.recall_samples")),
        **{key: run.data.tags.get(key) for key in COMPARABLE_TAGS},
    }


def _int_or_none(value) -> int | None:
    try:
        return int(value)
    except (TypeError, ValueError):
        return None


# --------------------------------------------------------------------------- logging a run


# Knobs that are not the run: where the live server listens and how it compiles (no stage reads
# them), Prefect's task settings, and the comparison's own project (compare/, its own MLflow runs).
# Not logged, so the track stage does not depend on them (dvc.yaml): a new port is no new run.
NOT_THE_RUN = ("server.host", "server.port", "server.policy", "pipeline", "compare", "mqar")


def resolved_params(cfg: Config) -> dict:
    """Every effective knob of the run (not NOT_THE_RUN) as `section.key`, with `model.*` as the
    model that was built (the preset's values where params.yaml leaves a key null), not `None`."""
    params = cfg.flat(without=NOT_THE_RUN)
    model = cfg.model_config().to_dict()
    for key in list(params):
        section, _, name = key.partition(".")
        if section == "model" and params[key] is None:
            # the built model's value; a value that is null in the model too (attn: no attention
            # layers) is logged as params.yaml spells it
            params[key] = model[name] if model.get(name) is not None else "null"
    return params


def log_pipeline_run(
    cfg: Config,
    *,
    root: Path,
    metrics_by_stage: dict[str, dict],
    step_series: dict[str, list[tuple[int, float]]],
    plots_dir: Path | None,
    tokenizer_path: Path | None,
    export_dir: Path | None,
    dataset_path: Path | None,
    dataset_digest: str | None,
    run_name: str,
    tags: dict[str, str],
    metrics_dir: Path | None = None,
    track_started: float | None = None,
) -> dict:
    """Create one MLflow run holding the whole pipeline run. Returns ids, the model version, the
    alias it got and why, and where each stage's figures came from.

    Every effective knob of `cfg` is logged as a param; its `tracking:` section says where and
    how. First waits up to tracking.retry_seconds for the tracking server, else raises
    TrackingUnavailable having logged nothing. Param and tag values go through `redact`.
    `tags` should hold the COMPARABLE_TAGS of this run's validation loss; `track_started`
    (epoch seconds) is when the track stage began."""
    model_name, register = cfg.tracking.model_name, cfg.tracking.register
    track_started = time.time() if track_started is None else track_started
    secrets = secret_values()
    client, uri, artifacts, retrying = _connect(root, cfg.tracking.retry_seconds)
    experiment_id = retrying(lambda: ensure_experiment(client, cfg, artifacts, secrets))
    sources = retrying(lambda: measurement_sources(client, experiment_id, metrics_by_stage))
    champion = retrying(lambda: current_champion(client, model_name)) if register else None
    gate_results = gates(metrics_by_stage)
    all_tags = run_tags(cfg, tags, metrics_by_stage, sources, gate_results, secrets)
    started = pipeline_started(metrics_by_stage, sources, fallback=track_started)
    contents = {  # what _log_run_contents logs besides the params
        "metrics_by_stage": metrics_by_stage,
        "step_series": step_series,
        "plots_dir": plots_dir,
        "metrics_dir": metrics_dir,
        "tokenizer_path": tokenizer_path,
        "export_dir": export_dir,
        "dataset_path": dataset_path,
        "dataset_digest": dataset_digest,
    }
    run_id, version, decision = _log_run(
        client,
        cfg,
        uri,
        experiment_id,
        run_name=run_name,
        started=started,
        all_tags=all_tags,
        secrets=secrets,
        contents=contents,
        champion=champion,
        gate_results=gate_results,
        tags=tags,
    )
    if version is not None:
        log.info("%s v%s: %s (%s)", model_name, version, "champion" if decision[0] else "candidate", decision[1])
    return {
        "tracking_uri": redact(uri, secrets),
        "experiment_id": experiment_id,
        "ui_url": ui_url(redact(uri, secrets), experiment_id),
        "run_id": run_id,
        "run_name": redact(run_name, secrets),
        "started": datetime.fromtimestamp(started, UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "model_name": model_name if register else None,
        "model_version": int(version) if version is not None else None,
        "champion": decision[0] and version is not None,
        "registered_reason": decision[1],
        "gates": {k: v for k, v in gate_results.items()},
        "sources": sources,
    }


def _connect(root: Path, retry_seconds: float):
    """(client, URI, artifact location, retrying) of the project's tracking store, once its server
    answers: TrackingUnavailable, with nothing logged, if it does not within retry_seconds;
    `retrying(call)` retries a call on it, with backoff, until the same deadline."""
    import mlflow
    from mlflow import MlflowClient

    uri, artifacts = tracking_store(root)
    deadline = wait_for_tracking(uri, retry_seconds)
    mlflow.set_tracking_uri(uri)
    client = MlflowClient(uri)

    def retrying(call):
        return _retrying(call, uri, deadline, retry_seconds)

    return client, uri, artifacts, retrying


def _log_run(
    client,
    cfg: Config,
    uri: str,
    experiment_id: str,
    *,
    run_name: str,
    started: float,
    all_tags: dict[str, str],
    secrets: list[str],
    contents: dict,
    champion: dict | None,
    gate_results: dict,
    tags: dict[str, str],
) -> tuple[str | None, int | str | None, tuple[bool, str]]:
    """Create the run (started when the pipeline run did, with `all_tags`), log its `contents` and
    register its model by the champion rule: (run id, model version, the rule's decision). A
    server lost on the way is one TrackingUnavailable line naming the run left incomplete."""
    import mlflow

    run_id, version, decision = None, None, (False, "not registered")
    # MLflow prints "View run ... at: <tracking URI>/#/..." to stdout, credentials included: with
    # a user:password URI, silence it and log the link with the password masked instead.
    hide_url = redact(uri, secrets) != uri
    try:
        with _no_url_printed(hide_url):
            # created with the pipeline's start time, so the run's duration is the pipeline run's
            created = client.create_run(
                experiment_id, start_time=int(started * 1000), tags=all_tags, run_name=redact(run_name, secrets)
            )
            run_id = created.info.run_id
            with mlflow.start_run(run_id=run_id):
                version = _log_run_contents(
                    client,
                    run_id,
                    cfg,
                    secrets=secrets,
                    model_name=cfg.tracking.model_name,
                    register=cfg.tracking.register,
                    **contents,
                )
                decision = _register(
                    client, cfg, run_id, version, champion, contents["metrics_by_stage"], gate_results, tags
                )
    except Exception as exc:  # the server went away mid-run: the same one line as when it is down at first
        if isinstance(exc, TrackingUnavailable) or not _connection_lost(exc):
            raise
        during = f" while logging run {run_id} (left incomplete)" if run_id else ""
        raise TrackingUnavailable(
            unavailable_message(uri, _short_reason(exc), cfg.tracking.retry_seconds, during)
        ) from exc
    if hide_url:
        log.info(
            "MLflow run %s: %s/#/experiments/%s/runs/%s",
            run_id,
            redact(uri, secrets).rstrip("/"),
            experiment_id,
            run_id,
        )
    return run_id, version, decision


def ensure_experiment(client, cfg: Config, artifacts: str | None, secrets: list[str]) -> str:
    """The experiment's id, created if new; tagged as model training, with the headline view of
    the runs table showing the params that varied between runs (this one included)."""
    experiment = cfg.tracking.experiment
    found = client.get_experiment_by_name(experiment)
    experiment_id = (
        found.experiment_id if found is not None else client.create_experiment(experiment, artifact_location=artifacts)
    )
    tags = found.tags if found is not None else {}
    if tags.get(EXPERIMENT_KIND[0]) != EXPERIMENT_KIND[1]:
        client.set_experiment_tag(experiment_id, *EXPERIMENT_KIND)
    earlier = client.search_runs([experiment_id], max_results=50, order_by=["attributes.start_time DESC"])
    logged = {k: redact(str(v), secrets)[:6000] for k, v in resolved_params(cfg).items()}
    shown = varied_params(logged, [r.data.params for r in earlier])
    view = headline_view(tags.get(VIEW_TAG_PREFIX + HEADLINE_VIEW), shown)
    if view is not None:
        client.set_experiment_tag(experiment_id, VIEW_TAG_PREFIX + HEADLINE_VIEW, view)
    return experiment_id


def run_tags(
    cfg: Config,
    tags: dict[str, str],
    metrics_by_stage: dict[str, dict],
    sources: dict,
    gate_results: dict,
    secrets: list[str],
) -> dict[str, str]:
    """The run's tags, redacted: `tags`, the params hash, one tag each for the gates and the
    measurement stamps (provenance.measured_tag), a source.<stage> tag only for a stage whose
    figures an earlier run measured (few tags to read), the recall verdict, and MLflow's own
    run-context tags (user, source, git) as mlflow.start_run would add them."""
    all_tags = {
        **tags,
        "params_hash": cfg.digest(without=NOT_THE_RUN),
        "gates": ", ".join(
            f"{GATE_NAMES[k]} {({True: 'passed', False: 'failed', None: 'missing'})[v]}"
            for k, v in gate_results.items()
        ),
        "measured": measured_tag(metrics_by_stage),
        **{f"source.{stage}": source_text(source) for stage, source in sources.items() if source is not None},
        **recall_tags(metrics_by_stage.get("probes") or {}),
    }
    try:
        from mlflow.tracking.context.registry import resolve_tags

        all_tags = resolve_tags(all_tags)
    except ImportError:
        pass
    return {k: redact(str(v), secrets) for k, v in all_tags.items()}


@contextlib.contextmanager
def _no_url_printed(hide: bool):
    """MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT while `hide`, then as it was."""
    saved = os.environ.get("MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT")
    try:
        if hide:
            os.environ["MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT"] = "true"
        yield
    finally:
        if hide:
            if saved is None:
                os.environ.pop("MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT", None)
            else:
                os.environ["MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT"] = saved


def _register(
    client, cfg: Config, run_id: str, version, champion, metrics_by_stage: dict, gate_results: dict, tags: dict
) -> tuple[bool, str]:
    """The champion rule's decision for the registered `version` (None: not registered), applied
    as aliases, and the run's tags registered_as / registered_reason."""
    decision = (False, "not registered")
    if cfg.tracking.register and version is not None:
        new = {"val_loss": (metrics_by_stage.get("train") or {}).get("val_loss"), "gates": gate_results}
        new.update({key: tags.get(key) for key in COMPARABLE_TAGS})
        new["recall"] = (metrics_by_stage.get("probes") or {}).get("recall") or {}
        new["recall_samples"] = cfg.probes.recall_samples
        decision = champion_decision(
            new, champion, cfg.tracking.champion_tolerance, cfg.tracking.champion_recall_tolerance
        )
        _assign_aliases(client, cfg.tracking.model_name, version, decision, metrics_by_stage)
    registered_as = ("champion" if decision[0] else "candidate") if version is not None else "not registered"
    client.set_tag(run_id, "registered_as", registered_as)
    client.set_tag(run_id, "registered_reason", decision[1])
    return decision


def _assign_aliases(
    client, model_name: str, version, decision: tuple[bool, str], metrics_by_stage: dict[str, dict]
) -> None:
    """`candidate` always; `champion` when the rule said so. The reason goes on the version too,
    with the trained model's figures (description, and eval_loss / train_loss tags), so the
    registry's version page shows the loss."""
    take, reason = decision
    client.set_registered_model_alias(model_name, "candidate", str(version))
    client.set_model_version_tag(model_name, str(version), "registered_reason", reason)
    figures = mlflow_metrics(metrics_by_stage)
    for name in ("eval_loss", "train_loss"):
        if name in figures:
            client.set_model_version_tag(model_name, str(version), name, f"{rounded(name, figures[name])}")
    client.update_model_version(model_name, str(version), description=version_description(metrics_by_stage))
    if take:
        client.set_registered_model_alias(model_name, "champion", str(version))


def _log_run_contents(
    client,
    run_id: str,
    cfg: Config,
    *,
    secrets,
    metrics_by_stage,
    step_series,
    plots_dir,
    metrics_dir,
    tokenizer_path,
    export_dir,
    dataset_path,
    dataset_digest,
    model_name,
    register,
) -> int | str | None:
    """Params, headline metrics, dataset input, artifacts and the model of the active run; the
    model version. The detailed figures are artifacts: metrics/*.json and the table figures.json."""
    import mlflow
    from mlflow.data.dataset_source_registry import resolve_dataset_source
    from mlflow.data.meta_dataset import MetaDataset
    from mlflow.entities import Metric, Param

    now = int(time.time() * 1000)
    param_items = [Param(k, redact(str(v), secrets)[:6000]) for k, v in sorted(resolved_params(cfg).items())]
    # one value each, except the names with a step history (the loss curves), logged as the history
    # The histories first, in HEADLINE's order, then the single values: MLflow lists a run's metrics
    # in the order they were first logged, and its compare view charts the first: eval_loss.
    # Single values are logged at the final step, where the histories end, and the model is logged
    # at that step too: MLflow 3 links the metrics of the step a model is logged at to the model,
    # so the Models view shows the trained model's figures (at step 0 it showed the untrained loss).
    # Values are rounded as in metrics.json (headline.DIGITS): the table shows 4.4781, not 4.478112...
    single = mlflow_metrics(metrics_by_stage)
    final_step = max((int(step) for series in step_series.values() for step, _ in series), default=0)
    order = [k for k in HEADLINE if k in step_series] + [k for k in HEADLINE if k in single and k not in step_series]
    metrics = [
        Metric(k, rounded(k, float(v)), now, int(step)) for k in order if k in step_series for step, v in step_series[k]
    ]
    metrics += [Metric(k, rounded(k, single[k]), now, final_step) for k in order if k not in step_series]
    for i in range(0, len(param_items), 100):
        client.log_batch(run_id, params=param_items[i : i + 100])
    for i in range(0, len(metrics), 500):
        client.log_batch(run_id, metrics=metrics[i : i + 500])
    if dataset_path is not None and dataset_digest:
        # MLflow caps digests at 36 characters: a DVC md5 (".dir" included) fits, the manifest's
        # sha256 (the fallback outside DVC) is cut to its first 36 hex digits
        with warnings.catch_warnings():
            # MLflow 3.17 registers its local-file dataset source twice (once per URI scheme of the
            # local artifact repository) and warns that the path "can be interpreted in multiple
            # ways" between the two identical classes: nothing to act on
            warnings.filterwarnings("ignore", message="The specified dataset source can be interpreted")
            source = resolve_dataset_source(str(dataset_path))
        dataset = MetaDataset(source=source, name="tokenized", digest=dataset_digest[:36])
        mlflow.log_input(dataset, context="training")
    if plots_dir is not None and plots_dir.exists():
        mlflow.log_artifacts(str(plots_dir), "plots")
    if metrics_dir is not None and metrics_dir.exists():
        mlflow.log_artifacts(str(metrics_dir), "metrics")
    if metrics_by_stage:
        mlflow.log_table(figures_table(metrics_by_stage), "figures.json")
    if tokenizer_path is not None and tokenizer_path.exists():
        mlflow.log_artifact(str(tokenizer_path), "tokenizer")

    if export_dir is None or not (export_dir / "config.json").exists():
        return None
    return log_export_model(cfg, export_dir, model_name if register else None, final_step)


def log_export_model(cfg: Config, export_dir: Path, registered_name: str | None, step: int = 0) -> int | str | None:
    """Log an export as the active run's pyfunc model (models from code: no pickle) and register it
    under `registered_name` (None: not registered). Returns the new model version."""
    import mlflow
    import pandas as pd
    from mlflow.models import infer_signature

    import laplace
    from laplace.serving.engine import SHAPE_KEYS

    generate = cfg.generate
    example = pd.DataFrame({"prompt": ["The function"]})
    # the serving payload shown by the MLflow UI and used with `mlflow models serve` (serving_input_example.json)
    example_params = {"max_new_tokens": 16, "temperature": 0.0, "top_p": 1.0, "seed": generate.seed}
    signature = infer_signature(
        model_input=example,
        model_output=["text"],
        params={
            "max_new_tokens": generate.max_new_tokens,
            "temperature": 0.0,
            "top_p": 1.0,
            "seed": generate.seed,
        },
    )
    info = mlflow.pyfunc.log_model(
        name="model",
        python_model=str(Path(laplace.__file__).parent / "tracking" / "mlflow_model.py"),  # from code: no pickle
        artifacts={"export": str(export_dir)},
        signature=signature,
        input_example=(example, example_params),
        # the engine's shapes; MLflow also logs model_config as run params, so under the run's own
        # names and values (engine.max_slots ...), not as unprefixed duplicates
        model_config={f"engine.{k}": getattr(cfg.engine, k) for k in SHAPE_KEYS},
        step=step,
        code_paths=[str(Path(laplace.__file__).parent)],
        pip_requirements=["torch>=2.13", "numpy", "safetensors", "tokenizers", "pandas"],
        registered_model_name=registered_name,
    )
    return info.registered_model_version


def version_description(metrics_by_stage: dict[str, dict]) -> str:
    """The registry's model-version text: the trained model's figures, for a person promoting by hand."""
    train = metrics_by_stage.get("train") or {}
    figures = mlflow_metrics(metrics_by_stage)
    parts = [f"trained {train.get('steps')} steps"] if train.get("steps") else []
    for name, label, fmt in (
        ("eval_loss", "validation loss", "{:.4f}"),
        ("train_loss", "training loss", "{:.4f}"),
        ("tps", "training tokens/s", "{:,.0f}"),
        ("srv_tps", "serving tokens/s", "{:,.0f}"),
        ("ttft_p99", "TTFT p99 (s)", "{:.3f}"),
    ):
        if name in figures:
            parts.append(f"{label} {fmt.format(figures[name])}")
    verdicts = gates(metrics_by_stage)
    parts.append("gates " + gates_word(verdicts))
    return "; ".join(parts)


def load_registered_model(root: Path, model_name: str, alias: str = "candidate"):
    """The registered pyfunc by alias (used by tests and by users: models:/name@alias)."""
    import mlflow

    mlflow.set_tracking_uri(tracking_uri(root))
    return mlflow.pyfunc.load_model(f"models:/{model_name}@{alias}")


def read_json(path: Path) -> dict | list | None:
    return json.loads(path.read_text()) if path.exists() else None
