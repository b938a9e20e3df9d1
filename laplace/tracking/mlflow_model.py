"""The MLflow pyfunc model, logged "from code": MLflow executes this file to build the model,
so the logged model holds no pickled Python object (its weights are the safetensors export).

It predicts through the serving engine (laplace.serving.engine.DecodeEngine): a batch of
prompts is admitted into the engine's slots and decoded together at the ladder widths of the
run's `engine:` params (without a compiler: `mlflow models serve` has no warmup cache), so the
`champion` alias certifies the code that `mlflow models serve -m models:/laplace-gla@champion`
runs. A request the engine cannot serve (an empty prompt, max_new_tokens <= 0, ...) is an
MLflow INVALID_PARAMETER_VALUE error with the reason: HTTP 400 with a message, no stack trace.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import mlflow.models
import mlflow.pyfunc
import numpy as np

from laplace.config import EngineSection, GenerateSection


class LaplaceGenerator(mlflow.pyfunc.PythonModel):
    """Text generation from an exported Laplace model (safetensors; nothing unpickled).

    Input: a DataFrame with a `prompt` column, a list of prompts or one prompt.
    Params: max_new_tokens, temperature, top_p, seed. Output: one completion per prompt.
    No type hints on predict: with them MLflow would drop the runtime params.
    """

    # No type-hint validation wrapper either (MLflow's own models opt out the same way): for a
    # predict without hints it validates nothing and warns on every import, i.e. on every
    # `laplace track`, burying the stage's one line of outcome.
    _skip_type_hint_validation = True

    def load_context(self, context):
        import threading

        from laplace.serving.engine import SHAPE_KEYS, DecodeEngine

        # the run's engine: shapes (its model_config), else the defaults (keys `engine.<shape>` as the
        # run's params name them; bare names from models logged before)
        given = {k.rpartition(".")[2]: v for k, v in (context.model_config or {}).items()}
        shapes = {k: v for k, v in given.items() if k in SHAPE_KEYS}
        params = dataclasses.replace(EngineSection(), **shapes, prefix_cache_bytes=0)
        # the padded ladder, as served, eagerly
        self.engine, self.tokenizer, self.config = DecodeEngine.from_export(
            context.artifacts["export"], params, "padded", compiled=False
        )
        self.model = self.engine.model
        self.lock = threading.Lock()  # the scoring server may call predict from several threads

    def predict(self, context, model_input, params=None):
        from mlflow.exceptions import MlflowException

        from laplace.serving.scheduler import Rejected, Request

        prompts = _prompts(model_input)
        params = params or {}
        # MLflow fills missing params from the signature's defaults (the run's generate: section);
        # a direct call without params gets the typed defaults
        defaults = GenerateSection()
        eos = self.config.get("eos_id")
        try:
            max_new = int(params.get("max_new_tokens", defaults.max_new_tokens))
            temperature = float(params.get("temperature", 0.0))
            top_p = float(params.get("top_p", 1.0))
            seed = int(params.get("seed", defaults.seed))
        except (TypeError, ValueError) as exc:
            raise MlflowException.invalid_parameter_value(f"params: {exc}") from None
        requests = [
            Request(
                i, self.tokenizer.encode(p).ids, max_new, temperature, top_p, (eos,) if eos is not None else (), seed
            )
            for i, p in enumerate(prompts)
        ]
        with self.lock:
            for r in requests:
                try:
                    self.engine.scheduler.check(r)
                except Rejected as exc:
                    where = f"prompt {r.id}" if len(requests) > 1 else "prompt"
                    raise MlflowException.invalid_parameter_value(f"{where} {prompts[r.id]!r}: {exc}") from None
            done = self.engine.complete(requests)
            self.engine.reset()  # drops the step records of this batch; compiled nothing, keeps nothing
        failed = [c for c in done if c.status != "done"]
        if failed:
            raise MlflowException(f"generation failed: {failed[0].reason}")
        return [self.tokenizer.decode(c.output_ids) for c in done]


def _prompts(model_input) -> list[str]:
    if hasattr(model_input, "columns"):
        column = "prompt" if "prompt" in model_input.columns else model_input.columns[0]
        out = []
        for cell in model_input[column].tolist():
            # {"prompt": ["a", "b"]} reaches predict as one row holding the list (MLflow's schema
            # enforcement): a batch all the same
            out += [str(p) for p in cell] if isinstance(cell, (list, tuple, np.ndarray)) else [str(cell)]
        return out
    if isinstance(model_input, str):
        return [model_input]
    if isinstance(model_input, dict):
        prompt = model_input.get("prompt", "")
        return [prompt] if isinstance(prompt, str) else [str(p) for p in prompt]
    return [str(p) for p in model_input]


def download_export(model_uri: str, tracking_uri: str, dest: Path) -> Path:
    """The export directory inside a logged model (models:/name@alias, runs:/id/model), downloaded
    from the tracking store into `dest`."""
    import mlflow.artifacts
    from mlflow.exceptions import MlflowException

    from laplace.errors import InputError, one_line
    from laplace.tracking.redact import redact, secret_values

    mlflow.set_tracking_uri(tracking_uri)
    try:
        local = Path(mlflow.artifacts.download_artifacts(artifact_uri=model_uri, dst_path=str(dest)))
    except MlflowException as exc:
        where = redact(tracking_uri, secret_values())
        raise InputError(f"--model {model_uri}: {one_line(exc)} (tracking store {where})") from None
    export = local / "artifacts" / "export"
    if not (export / "config.json").is_file():
        raise InputError(f"--model {model_uri}: not a Laplace model (no artifacts/export/config.json in it)")
    return export


mlflow.models.set_model(LaplaceGenerator())
