"""The architecture comparison in MLflow: one parent run holding the table, its plots and the pick, and
one child run per arm with that arm's figures, params and exported model.

Each arm's export is registered under `<compare.registry_prefix>-<family>` (gla, hybrid, softmax), so
the registry holds one champion per architecture family: the comparison's pick within the family
(laplace.pipeline.compare_table.pick) takes the `champion` alias there, every arm `candidate`; the
reason is the version's `registered_reason` tag. The parent's tags name the overall pick and the
headline sentence."""

from __future__ import annotations

import json
from pathlib import Path

from laplace.config import Config
from laplace.tracking.redact import redact, secret_values
from laplace.tracking.store import tracking_uri


def arm_metrics(row: dict) -> dict[str, float]:
    """The table row's figures as MLflow metric names (recall_1024, bytes_per_sequence_8192, ...)."""
    out = {}
    for key in ("val_loss", "perplexity", "parameters", "output_tokens_per_s", "ttft_p99_s", "compiles_while_serving"):
        if row.get(key) is not None:
            out[key] = float(row[key])
    for key in ("recall", "ruler", "bytes_per_sequence", "decode_ms_per_token"):
        for length, value in (row.get(key) or {}).items():
            if value is not None:
                out[f"{key}_{length}"] = float(value)
    for model in (row.get("mqar") or {}).values():  # the MQAR protocol: mqar_w64_16p_64 and its _se
        for ctx, by_pairs in model["accuracy"].items():
            for pairs, e in by_pairs.items():
                out[f"mqar_w{model['width']}_{pairs}p_{ctx}"] = float(e["mean"])
                out[f"mqar_w{model['width']}_{pairs}p_{ctx}_se"] = float(e["se"])
    for task, by_length in (row.get("ruler_tasks") or {}).items():
        for length, value in (by_length or {}).items():
            out[f"ruler_{task}_{length}"] = float(value)
    return out


def log_comparison(
    cfg: Config, root: Path, table: dict, plots_dir: Path, arm_dirs: dict[str, tuple[Path, Path]]
) -> dict:
    """Log the comparison (`arm_dirs`: each arm's metrics and export directories): returns
    {experiment, parent_run_id, children: {arm: run_id}, registered}."""
    import mlflow
    from mlflow import MlflowClient

    from laplace.tracking.runs import log_export_model

    uri = tracking_uri(root)
    client = MlflowClient(uri)
    mlflow.set_tracking_uri(uri)
    experiment = f"{cfg.tracking.experiment}-compare"
    mlflow.set_experiment(experiment)
    secrets = secret_values()
    rows, picks = table["arms"], table["family_picks"]
    children, registered = {}, {}
    with mlflow.start_run(run_name=f"compare {' vs '.join(rows)}") as parent:
        mlflow.log_params(
            {
                "compare.arms": redact(json.dumps(cfg.compare.arms, sort_keys=True), secrets)[:6000],
                "compare.overrides": redact(json.dumps(cfg.compare.overrides, sort_keys=True), secrets)[:6000],
                "seed": cfg.seed,
                **{f"mqar.{k}": json.dumps(v) for k, v in cfg.to_dict()["mqar"].items()},
            }
        )
        mlflow.log_metrics({f"{arm}.{k}": v for arm, row in rows.items() for k, v in arm_metrics(row).items()})
        mlflow.set_tags(
            {
                "headline": table["headline"][:5000],
                "pick": table["pick"]["arm"] or "none",
                "pick_reason": table["pick"]["reason"][:5000],
                "mqar_gate": "passed" if table["mqar"]["gate"]["passed"] else "failed",
                "mqar_gate_reason": table["mqar"]["gate"]["reason"][:5000] or "-",
            }
        )
        mlflow.log_dict(table, "compare.json")
        if plots_dir.exists():
            mlflow.log_artifacts(str(plots_dir), "plots")
        for arm, row in rows.items():
            metrics_dir, export_dir = arm_dirs[arm]
            with mlflow.start_run(run_name=arm, nested=True) as child:
                mlflow.log_params(
                    {
                        "arm": arm,
                        "family": row["family"],
                        "attn_layers": json.dumps(row["attn_layers"]),
                        **{f"model.{k}": json.dumps(v) for k, v in cfg.compare.arms[arm].items()},
                    }
                )
                mlflow.log_metrics(arm_metrics(row))
                if metrics_dir.exists():
                    mlflow.log_artifacts(str(metrics_dir), "metrics")
                name = f"{cfg.compare.registry_prefix}-{row['family']}"
                version = log_export_model(cfg, export_dir, name if cfg.tracking.register else None)
                children[arm] = child.info.run_id
            if version is not None:
                family_pick = picks.get(row["family"]) or {}
                take = family_pick.get("arm") == arm
                reason = family_pick.get("reason") or ""
                client.set_registered_model_alias(name, "candidate", str(version))
                client.set_model_version_tag(name, str(version), "registered_reason", reason[:5000])
                if take:
                    client.set_registered_model_alias(name, "champion", str(version))
                registered[arm] = {"model": name, "version": int(version), "champion": take}
        parent_id = parent.info.run_id
    return {"experiment": experiment, "parent_run_id": parent_id, "children": children, "registered": registered}
