"""The headline figures of a pipeline run: the few numbers that answer "which run is better".

One definition for both places a person compares runs:
- MLflow: `track` logs these names as the run's only metrics (the loss curves as step
  histories), so the runs table shows them as columns and the compare view charts them;
  every detailed figure goes into artifacts (the metrics/*.json files and one table).
- DVC: `track` writes `metrics.json` (the `metrics:` of dvc.yaml), five of them, so that
  `dvc metrics show`, `dvc metrics diff` and `dvc exp show` fit an 80-column terminal; the
  detailed metrics/*.json files are plain outputs, out of the default view.
"""

from __future__ import annotations

# Stages whose metrics carry a `passed` gate; all must pass before a version may be champion.
VALIDATION_STAGES = ("serve", "numerics", "probes")

# name -> what it is (docs/pipeline.md shows these). MLflow logs each name but `gates` (with a
# 0/1 metric per gate instead); DVC's metrics.json holds DVC_KEYS. `eval_loss` sorts first, so
# MLflow's compare view opens its chart on it.
HEADLINE = {
    "eval_loss": "validation loss after training (nats/token; in MLflow the history over eval steps)",
    "train_loss": "training loss (in MLflow the history over logged steps)",
    "tok_s": "training tokens per second",
    "serve_tok_s": "serving output tokens/s, padded policy, headline workload (serve-check)",
    "ttft_p99": "serving time to first token, 99th percentile (s), padded policy",
    "serve_compile": "share of decode time spent compiling under compile-on-first-sight (exact policy)",
    "gates": "serve-check, numerics and probes gates: passed, or failed / missing",
    **{f"gate_{stage}": f"1 when the {stage} gate passed, 0 when it failed" for stage in VALIDATION_STAGES},
}
# The DVC headline: five columns, so `dvc metrics show` fits an 80-column terminal.
DVC_KEYS = ("eval_loss", "tok_s", "serve_tok_s", "ttft_p99", "gates")


def gates(metrics_by_stage: dict[str, dict]) -> dict[str, bool | None]:
    """passed / failed / missing (None) for each validation stage."""
    return {
        stage: None if metrics_by_stage.get(stage) is None else bool(metrics_by_stage[stage].get("passed"))
        for stage in VALIDATION_STAGES
    }


def gates_word(verdicts: dict[str, bool | None]) -> str:
    """One short word for a table cell: passed, or the gates that failed or are missing."""
    failed = [stage for stage, ok in verdicts.items() if ok is False]
    missing = [stage for stage, ok in verdicts.items() if ok is None]
    if not failed and not missing:
        return "passed"
    return "failed" if failed else "missing"


def _rounded(value, digits: int):
    return None if value is None else round(float(value), digits)


def headline(metrics_by_stage: dict[str, dict]) -> dict:
    """The DVC headline (metrics.json): DVC_KEYS, rounded so the table stays narrow."""
    train = metrics_by_stage.get("train") or {}
    padded = (metrics_by_stage.get("serve") or {}).get("padded") or {}
    return {
        "eval_loss": _rounded(train.get("val_loss"), 4),
        "tok_s": _rounded(train.get("tokens_per_s"), 0),
        "serve_tok_s": _rounded(padded.get("output_tokens_per_s"), 0),
        "ttft_p99": _rounded(padded.get("ttft_p99_s"), 3),
        "gates": gates_word(gates(metrics_by_stage)),
    }


def mlflow_metrics(metrics_by_stage: dict[str, dict]) -> dict[str, float]:
    """The run's single-value metrics for MLflow (unrounded); the histories are logged beside them."""
    train = metrics_by_stage.get("train") or {}
    serve = metrics_by_stage.get("serve") or {}
    padded, exact = serve.get("padded") or {}, serve.get("exact") or {}
    values = {
        "eval_loss": train.get("val_loss"),
        "train_loss": train.get("train_loss"),
        "tok_s": train.get("tokens_per_s"),
        "serve_tok_s": padded.get("output_tokens_per_s"),
        "ttft_p99": padded.get("ttft_p99_s"),
        "serve_compile": exact.get("compile_time_share"),
        **{f"gate_{stage}": None if ok is None else float(ok) for stage, ok in gates(metrics_by_stage).items()},
    }
    return {k: float(v) for k, v in values.items() if isinstance(v, (int, float)) and v == v}
