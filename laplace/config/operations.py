"""`tracking:` and `pipeline:`, how a pipeline run is recorded (MLflow, laplace/tracking) and how its
stages are retried (Prefect, flows/pipeline.py)."""

from __future__ import annotations

from dataclasses import dataclass

from laplace.config.knobs import knob, non_negative, positive, unit_interval


@dataclass(frozen=True)
class TrackingSection:
    """`tracking:` MLflow: where the run is logged and how the model is registered (track)."""

    experiment: str = knob(
        "laplace", doc="MLflow experiment (store: sqlite mlflow.db in the project, or MLFLOW_TRACKING_URI)"
    )
    model_name: str = knob(
        "laplace-gla", doc="registered model: alias candidate; champion when the gates pass and it is no worse"
    )
    champion_tolerance: float = knob(
        0.0,
        non_negative,
        (
            "a new version takes the champion alias only if its val_loss is at most"
            " the current champion's plus this (nats/token), on the same validation"
            " windows and tokenizer"
        ),
    )
    champion_recall_tolerance: float = knob(
        0.05,
        unit_interval,
        "nor if its recall (probes' recall suite) at any length both measured falls below the champion's by more "
        "(and by more than two binomial standard errors of the difference, from each side's recall_samples)",
    )
    register: bool = knob(True, doc="register the exported model (alias candidate; champion when it earns it)")
    retry_seconds: float = knob(
        60.0,
        non_negative,
        (
            "track waits this long, with backoff, for an unreachable tracking "
            "server (0 = one try), then fails with one line; nothing is lost: rerun"
            " `laplace track` / `dvc repro` to log the run"
        ),
    )


@dataclass(frozen=True)
class PipelineSection:
    """`pipeline:` Prefect task settings (flows/pipeline.py)."""

    retries: int = knob(1, non_negative, "retries after a transient failure; bad params are never retried")
    retry_delay_s: float = knob(10.0, non_negative, doc="seconds between Prefect retries")
    stage_timeout_s: float = knob(7200.0, positive, "Prefect timeout of one stage")
