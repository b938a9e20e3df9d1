"""The pipeline around the library: params.yaml, the stages and their file layout, stage
workers, the DVC driver, plots, the summary and the CLI (MLflow lives in laplace.tracking).

Nothing outside this package imports it (tests/test_layout.py keeps the rule), so the
library (model, optim, data, training, serving, evals) can be used without DVC, MLflow,
the stage layout or the CLI. Prefect stays in flows/.
"""
