"""lm-evaluation-harness on a Laplace export: the `laplace` model of lm-eval, and `laplace eval`.

`LaplaceHarnessLM` (registered with lm-eval as `laplace`) answers lm-eval's three request types
through the serving engine (laplace.serving.engine), so an evaluation measures the model as it
is served: padded ladder widths, bucketed prefill, the same state slots.

- loglikelihood(context, continuation): encoded as lm-eval's own HF models encode it (`encode_pair`:
  the context's trailing spaces moved to the continuation, context+continuation encoded together and
  split after the context's tokens, the tokenizer's own special tokens, an empty context replaced by
  the prefix token), so the numbers are comparable with lm-eval's HFLM on the same checkpoint. The
  context is prefilled into a slot, then the continuation is fed one token per decode step; up
  to max_slots (a model_arg) requests decode together at the smallest ladder width that holds them.
- loglikelihood_rolling(text): the same with the model's own start token as the only context
  (BOS where the model has one, Llama's convention; else the end-of-text token that separates
  Laplace's training documents), so it equals the model's loss on that token sequence: GLA has no
  context window, so no rolling windows are needed.
- generate_until(context, {until, max_gen_toks}): greedy through the engine's scheduler
  (DecodeEngine.complete), cut at the first stop string.

lm-eval (pip install 'laplace[eval]') finds models only among those registered in its process,
and 0.4 has no plugin discovery: the .pth that `make setup` writes (laplace/evals/lm_eval_plugin.py)
registers this model lazily, so `lm_eval --model laplace --model_args export=PATH --tasks ...`
works unchanged; `python -m laplace.evals.harness ARGS` is the same command line without the .pth,
and `laplace eval` runs lm-eval's simple_evaluate on the export.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from lm_eval.api.model import LM
from lm_eval.api.registry import register_model

from laplace.config import EngineSection
from laplace.errors import ConfigError
from laplace.serving.engine import DecodeEngine
from laplace.serving.scheduler import Request

log = logging.getLogger(__name__)


def _truthy(value) -> bool:
    return value if isinstance(value, bool) else str(value).lower() in ("1", "true", "yes")


@register_model("laplace")
class LaplaceHarnessLM(LM):
    """model_args: export=PATH (required), device=auto (cpu, cuda, cuda:N), kernel=auto, max_slots=8, compile=true
    (false: the same ladder widths, eager), max_gen_toks=256, max_context=2048 (models with attention
    layers: the tokens a sequence may reach, as engine.max_context)."""

    def __init__(
        self,
        export: str | None = None,
        device: str | None = "auto",
        kernel: str = "auto",
        max_slots: int | str = 8,
        compile: bool | str = True,
        max_gen_toks: int | str = 256,
        max_context: int | str = EngineSection().max_context,
        batch_size=None,  # lm-eval passes its --batch_size; the engine batches at its ladder widths instead
        **_ignored,
    ):
        super().__init__()
        if not export:
            raise ConfigError("lm-eval --model laplace: give --model_args export=PATH (an export directory)")
        from laplace.runtime import resolve_device

        device = str(device or "auto")
        if device.startswith("cuda") and not torch.cuda.is_available():
            # lm-eval's own default is cuda:0 whether or not the user asked: run where we can, and say so
            log.warning("lm-eval asked for device %s but CUDA is not available: evaluating on %s", device, "cpu")
            device = "cpu"
        device = torch.device(device) if ":" in device else resolve_device(device)
        # the default `engine:` shapes at max_slots, any prompt length (lm-eval's contexts are long)
        params = dataclasses.replace(
            EngineSection(),
            max_slots=int(max_slots),
            widths=[],
            max_prompt_tokens=2**62,
            prefix_cache_bytes=0,
            max_context=int(max_context),
        )
        self.engine, self.tokenizer, self.config = DecodeEngine.from_export(
            export, params, "padded", device=device, kernel=kernel, compiled=_truthy(compile)
        )
        self.model = self.engine.model
        self.max_gen_toks = int(max_gen_toks)
        self.bos_id, self.eos_id = self.config.get("bos_id"), self.config.get("eos_id")
        start = self.bos_id if self.bos_id is not None else self.eos_id
        if start is None:
            raise ConfigError(f"{export}: the export names neither a bos_id nor an eos_id to start a text with")
        self.start_id = start  # lm-eval's prefix_token_id: the tokenizer's BOS, else its EOS
        self.start_text = self.tokenizer.decode([start], skip_special_tokens=False)

    # -- tokens: as lm-eval's HFLM (lm_eval/models/huggingface.py tok_encode, api/model.py) -------------

    def encode(self, text: str) -> list[int]:
        """Text as the model reads it inside a document: no special tokens (BOS is the start's)."""
        return self.tokenizer.encode(text, add_special_tokens=False).ids if text else []

    def tok_encode(self, text: str) -> list[int]:
        """HFLM.tok_encode: the tokenizer's own special tokens (its post-processor puts <s> first in
        Llama layouts), none where the text already starts with the prefix token's text."""
        return self.tokenizer.encode(text, add_special_tokens=not text.startswith(self.start_text)).ids

    def prompt_ids(self, context: str) -> list[int]:
        """A generation prompt as HFLM encodes it; the prefix token alone for an empty context."""
        return (self.tok_encode(context) if context else []) or [self.start_id]

    def encode_pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        """(context ids, continuation ids) as lm-eval's loglikelihood and _encode_pair make them.
        Encoding the continuation alone instead would add a word-start token (Llama's Prepend ▁
        normaliser) and score tokens lm-eval's models never see."""
        if context == "":
            cont = self.encode(continuation)
            return (cont[:1], cont[1:]) if cont and cont[0] == self.start_id else ([self.start_id], cont)
        spaces = len(context) - len(context.rstrip())
        if spaces:
            context, continuation = context[:-spaces], context[-spaces:] + continuation
        whole, ctx = self.tok_encode(context + continuation), self.tok_encode(context)
        # a context of spaces only with a tokenizer that adds nothing: the prefix token conditions it
        return ctx or [self.start_id], whole[len(ctx) :]

    # -- scoring through the engine -------------------------------------------------------------

    @torch.inference_mode()
    def score(self, pairs: list[tuple[list[int], list[int]]]) -> list[tuple[float, bool]]:
        """(sum of log p(continuation | prompt), every continuation token the argmax) for each
        (prompt ids, continuation ids), max_slots at a time, decoded at the ladder widths."""
        out: list[tuple[float, bool]] = []
        cache, runner = self.engine.cache, self.engine.runner
        for first in range(0, len(pairs), cache.max_slots):
            group = pairs[first : first + cache.max_slots]
            totals, greedy = [0.0] * len(group), [True] * len(group)
            with cache.leased(range(len(group))) as slots:
                last = [runner.prefill(slot, prompt)[0] for slot, (prompt, _) in zip(slots, group)]
                for t in range(max(len(cont) for _, cont in group)):
                    live = [i for i, (_, cont) in enumerate(group) if t < len(cont)]
                    for i in live:
                        target = group[i][1][t]
                        logp = F.log_softmax(last[i].double(), -1)
                        totals[i] += float(logp[target])
                        greedy[i] = greedy[i] and int(last[i].argmax()) == target
                    more = [i for i in live if t + 1 < len(group[i][1])]
                    if more:
                        logits = runner.decode_rows([slots[i] for i in more], [group[i][1][t] for i in more])
                        for row, i in enumerate(more):
                            last[i] = logits[row]
            out.extend(zip(totals, greedy))
        return out

    def loglikelihood(self, requests) -> list[tuple[float, bool]]:
        return self.score([self.encode_pair(*req.args) for req in requests])

    def loglikelihood_rolling(self, requests) -> list[float]:
        pairs = [([self.start_id], self.encode(req.args[0])) for req in requests]
        return [total for total, _ in self.score(pairs)]

    def generate_until(self, requests) -> list[str]:
        batch, stops = [], []
        for n, req in enumerate(requests):
            context, kwargs = req.args
            until = kwargs.get("until") or []
            until = [until] if isinstance(until, str) else list(until)
            stops.append(until)
            batch.append(
                Request(
                    n,
                    self.prompt_ids(context),
                    int(kwargs.get("max_gen_toks", self.max_gen_toks)),
                    temperature=0.0,
                    stop_ids=() if self.eos_id is None else (self.eos_id,),
                )
            )
        self.engine.reset()
        texts = []
        for completion, until in zip(self.engine.complete(batch), stops):
            text = self.tokenizer.decode(completion.output_ids)
            cut = min((text.find(s) for s in until if s and s in text), default=-1)
            texts.append(text[:cut] if cut >= 0 else text)
        return texts


def evaluate(
    export: Path,
    tasks: list[str],
    include_path: str | None = None,
    limit: int | None = None,
    model_args: dict | None = None,
    log_samples: bool = False,
    metadata: dict | None = None,
) -> dict:
    """lm-eval's simple_evaluate on the export (tasks from lm-eval, or task YAMLs in include_path).
    metadata: lm-eval's task metadata (RULER's max_seq_lengths and tokenizer)."""
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    lm = LaplaceHarnessLM(export=str(export), **(model_args or {}))
    # the metadata goes to the TaskManager: simple_evaluate reads it only when it builds the manager itself
    manager = TaskManager(include_path=include_path, metadata=metadata)
    unknown = [t for t in tasks if t not in manager.all_tasks]
    if unknown:
        raise ConfigError(
            f"laplace eval: unknown lm-eval task {unknown[0]!r} (see `lm_eval ls tasks`, or --include-path)"
        )
    return simple_evaluate(
        model=lm, tasks=tasks, task_manager=manager, limit=limit, log_samples=log_samples, metadata=metadata
    )


def main() -> None:
    """lm-eval's command line with the `laplace` model registered (see the module docstring)."""
    from lm_eval.__main__ import cli_evaluate

    sys.argv[0] = "lm_eval"
    cli_evaluate()


def results_json(results: dict) -> str:
    return json.dumps({k: results[k] for k in ("results", "versions", "n-shot") if k in results}, default=str)


if __name__ == "__main__":
    main()
