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
VALIDATION_STAGES = ("serve-check", "numerics", "probes")
# Each gate's name in MLflow (the metric gate_<name>, the tag gate.<name>) and in metrics.json:
# the names runs have always been compared by, so they stay short and unchanged.
GATE_NAMES = {"serve-check": "serve", "numerics": "numerics", "probes": "probes"}

# name -> what it is (docs/pipeline.md shows these). MLflow logs each name but `gates` (a 0/1
# metric per gate instead); DVC's metrics.json holds DVC_DIGITS's. `eval_loss` sorts first, so
# MLflow's compare view opens its chart on it; "srv" is serving.
HEADLINE = {
    "eval_loss": "validation loss after training (nats/token; in MLflow the history over eval steps)",
    "train_loss": "training loss (in MLflow the history over logged steps)",
    "tps": "training tokens per second",
    "srv_tps": "serving output tokens/s, padded policy, headline workload (serve-check)",
    "ttft_p99": "serving time to first token, 99th percentile (s), padded policy",
    "srv_compile": "share of decode time spent compiling under compile-on-first-sight (exact policy)",
    "gates": "serve-check, numerics and probes gates: passed, or failed / missing",
    **{f"gate_{GATE_NAMES[stage]}": f"1 when the {stage} gate passed, 0 when it failed" for stage in VALIDATION_STAGES},
}
# DVC's headline and the digits it keeps: five narrow columns, so that `dvc metrics show` and
# `dvc exp show --only-changed` fit an 80-column terminal.
DVC_DIGITS = {"eval_loss": 4, "tps": 0, "srv_tps": 0, "ttft_p99": 3, "gates": None}


# The digits a headline figure keeps in MLflow's runs table (the exact figures are in the run's
# figures.json and metrics/*.json artifacts): a loss to 1e-4, throughput to a whole token/s.
MLFLOW_DIGITS = {"eval_loss": 4, "train_loss": 4, "tps": 0, "srv_tps": 0, "ttft_p99": 3, "srv_compile": 3}


def rounded(name: str, value: float) -> float:
    """`value` of headline figure `name` with MLFLOW_DIGITS' digits (unchanged for the rest)."""
    digits = MLFLOW_DIGITS.get(name)
    return float(round(value, digits)) if digits is not None else value


def gates(metrics_by_stage: dict[str, dict]) -> dict[str, bool | None]:
    """passed / failed / missing (None) for each validation stage."""
    return {
        stage: None if metrics_by_stage.get(stage) is None else bool(metrics_by_stage[stage].get("passed"))
        for stage in VALIDATION_STAGES
    }


def gates_word(verdicts: dict[str, bool | None]) -> str:
    """One short word for a table cell: passed, failed (a gate failed) or missing (one did not run)."""
    if any(ok is False for ok in verdicts.values()):
        return "failed"
    return "passed" if all(verdicts.values()) else "missing"


def _figures(metrics_by_stage: dict[str, dict]) -> dict:
    """Every headline figure by name, as measured (None when its stage has not run)."""
    train = metrics_by_stage.get("train") or {}
    serve = metrics_by_stage.get("serve-check") or {}
    padded, exact = serve.get("padded") or {}, serve.get("exact") or {}
    verdicts = gates(metrics_by_stage)
    return {
        "eval_loss": train.get("val_loss"),
        "train_loss": train.get("train_loss"),
        "tps": train.get("tokens_per_s"),
        "srv_tps": padded.get("output_tokens_per_s"),
        "ttft_p99": padded.get("ttft_p99_s"),
        "srv_compile": exact.get("compile_time_share"),
        "gates": gates_word(verdicts),
        **{f"gate_{GATE_NAMES[stage]}": None if ok is None else float(ok) for stage, ok in verdicts.items()},
    }


def headline(metrics_by_stage: dict[str, dict]) -> dict:
    """The DVC headline (metrics.json), rounded so the table stays narrow (a whole number with no
    digits: 3031, not 3031.0)."""
    figures = _figures(metrics_by_stage)
    out = {}
    for name, digits in DVC_DIGITS.items():
        value = figures[name]
        if digits is not None and value is not None:
            value = round(float(value)) if digits == 0 else round(float(value), digits)
        out[name] = value
    return out


def mlflow_metrics(metrics_by_stage: dict[str, dict]) -> dict[str, float]:
    """The run's single-value metrics for MLflow (unrounded); the histories are logged beside them."""
    return {
        name: float(value)
        for name, value in _figures(metrics_by_stage).items()
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value == value
    }
