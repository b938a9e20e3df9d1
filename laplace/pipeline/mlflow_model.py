"""The MLflow pyfunc model, logged "from code": MLflow executes this file to build the model,
so the logged model holds no pickled Python object (its weights are the safetensors export)."""

from __future__ import annotations

import mlflow.models
import mlflow.pyfunc

from laplace.config import GenerateSection


class LaplaceGenerator(mlflow.pyfunc.PythonModel):
    """Text generation from an exported Laplace model (safetensors; nothing unpickled).

    Input: a DataFrame with a `prompt` column, a list of prompts or one prompt.
    Params: max_new_tokens, temperature, top_p, seed. Output: the completions.
    No type hints on predict: with them MLflow would drop the runtime params.
    """

    # No type-hint validation wrapper either (MLflow's own models opt out the same way): for a
    # predict without hints it validates nothing and warns on every import, i.e. on every
    # `laplace track`, burying the stage's one line of outcome.
    _skip_type_hint_validation = True

    def load_context(self, context):
        from laplace.model.export import load_export

        self.model, self.tokenizer, self.config = load_export(context.artifacts["export"])

    def predict(self, context, model_input, params=None):
        import torch

        from laplace.serving.sampling import generate_ids

        params = params or {}
        if hasattr(model_input, "columns"):
            column = "prompt" if "prompt" in model_input.columns else model_input.columns[0]
            prompts = [str(p) for p in model_input[column].tolist()]
        elif isinstance(model_input, str):
            prompts = [model_input]
        elif isinstance(model_input, dict):
            prompts = (
                list(model_input["prompt"]) if not isinstance(model_input["prompt"], str) else [model_input["prompt"]]
            )
        else:
            prompts = [str(p) for p in model_input]
        # MLflow fills missing params from the signature's defaults (the run's generate: section);
        # a direct call without params gets the typed defaults
        defaults = GenerateSection()
        eos = self.config.get("eos_id")
        out = []
        with torch.inference_mode():
            for prompt in prompts:
                ids = generate_ids(
                    self.model,
                    self.tokenizer.encode(prompt).ids,
                    int(params.get("max_new_tokens", defaults.max_new_tokens)),
                    float(params.get("temperature", 0.0)),
                    float(params.get("top_p", 1.0)),
                    int(params.get("seed", defaults.seed)),
                    stop_ids=(eos,) if eos is not None else (),
                )
                out.append(self.tokenizer.decode(ids))
        return out


mlflow.models.set_model(LaplaceGenerator())
