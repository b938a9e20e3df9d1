"""The MLflow "model from code" entry: MLflow executes this file to build the pyfunc, so the
logged model holds no pickled Python object (its weights are the safetensors export)."""

import mlflow.models

from laplace.pipeline.tracking import LaplaceGenerator

mlflow.models.set_model(LaplaceGenerator())
