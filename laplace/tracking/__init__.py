"""MLflow tracking: one MLflow run per pipeline run (runs), the registry's champion rule
(champion), how a run reads in the UI (views, headline), where each stage's figures came from
(provenance), reaching the tracking store (store), secrets kept out of it (redact) and the
pyfunc model logged from code (mlflow_model).

The only room that imports mlflow (tests/test_layout.py keeps the rule). It sits above evals
and below the pipeline: it takes a Config and the files the stages wrote, and never imports
laplace.pipeline.
"""
