"""lm-evaluation-harness on a Laplace export: the `laplace` model of lm-eval, and `laplace eval`.

`LaplaceHarnessLM` (registered with lm-eval as `laplace`) answers lm-eval's three request types
through the serving engine (laplace.serving.engine), so an evaluation measures the model as it
is served: padded ladder widths, bucketed prefill, the same state slots.

- loglikelihood(context, continuation): encoded as lm-eval's own HF models encode it (`encode_pair`:
  the context's trailing spaces moved to the continuation, context+continuation encoded together and
  split after the context's tokens, the tokenizer's own special tokens, an empty context replaced by
  the prefix token), so the numbers are comparable with lm-eval's HFLM on the same checkpoint. The
  context is prefilled into a slot, then the continuation (all but its last token) runs through the
  model's chunked (parallel) form from that state, scored from the logits at every position: one
  forward per continuation, however long, up to max_slots (a model_arg) requests in it together.
  With max_length, the context is left-truncated as HFLM truncates it (the last max_length + 1
  tokens of context + continuation are kept).
- loglikelihood_rolling(text), two ways (model_arg `rolling`):
  `windows` (the default when max_length is given): lm-eval's own get_rolling_token_windows +
  make_disjoint_window over the text as HFLM encodes it, windows of max_length tokens each scored
  given only the window's context, as HFLM computes it (lm-eval's local-completions against `laplace
  serve` computes the same windows at its max_length = this max_length + 2: TemplateAPI keeps one
  token for generation and one for the context); `document` (the default without max_length): the
  whole text after the model's own start token (BOS where the model has one, else the end-of-text
  token that separates Laplace's training documents), one pass, so it equals the model's loss on
  that token sequence. A fixed state has no context window, so nothing is forgotten at a window's
  edge: for a trained model the document's perplexity is typically lower than the windows' wherever
  later text depends on earlier text more than max_length tokens back.
- generate_until(context, {until, max_gen_toks}): greedy through the engine's scheduler
  (DecodeEngine.complete), cut at the first stop string; with max_length, the context is
  left-truncated to max_length - max_gen_toks tokens, as HFLM does.

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

import lm_eval.models  # noqa: F401  lm-eval's own models first: its get_model loads them only into an empty registry
import torch
import torch.nn.functional as F
from lm_eval.api.model import LM
from lm_eval.api.registry import register_model
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

from laplace.config import EngineSection
from laplace.errors import ConfigError, InputError
from laplace.serving.engine import DecodeEngine
from laplace.serving.scheduler import Request

log = logging.getLogger(__name__)


def _truthy(value) -> bool:
    return value if isinstance(value, bool) else str(value).lower() in ("1", "true", "yes")


def _optional_int(name: str, value) -> int | None:
    if value is None or value == "":
        return None
    try:
        number = int(value)
    except (TypeError, ValueError):
        raise ConfigError(f"lm-eval --model laplace: {name}={value!r} is not an integer") from None
    if number < 1:
        raise ConfigError(f"lm-eval --model laplace: {name}={value!r} must be >= 1")
    return number


DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
ROLLING = ("windows", "document")
# logits (rows x positions x vocab) one scoring forward holds at most (1 GiB in fp32): two 4,094-token
# windows of a 32k vocabulary in one forward
SCORE_LOGITS = 2**28
LOGPROB_ROWS = 1024  # positions whose fp64 log-probs are computed at once


def slots_of(max_slots, batch_size, max_batch_size) -> int:
    """The rows scored together: max_slots (this model's name), else lm-eval's batch_size (an int;
    "auto" picks nothing here: the default 8, at most max_batch_size)."""
    slots = _optional_int("max_slots", max_slots)
    auto = batch_size is None or str(batch_size).startswith("auto")
    batch = None if auto else _optional_int("batch_size", batch_size)
    if slots is not None and batch is not None and slots != batch:
        raise ConfigError(
            f"lm-eval --model laplace: max_slots={slots} and batch_size={batch} disagree (they are the same "
            "thing here: the rows scored together); give one"
        )
    if slots or batch:
        return slots or batch
    return min(8, _optional_int("max_batch_size", max_batch_size) or 8)


def torch_device(device: str | None) -> torch.device:
    """lm-eval's device argument as a torch device."""
    from laplace.runtime import resolve_device

    device = str(device or "auto")
    if device.startswith("cuda") and not torch.cuda.is_available():
        # lm-eval's own default is cuda:0 whether or not the user asked: run where we can, and say so
        log.warning("lm-eval asked for device %s but CUDA is not available: evaluating on %s", device, "cpu")
        device = "cpu"
    return torch.device(device) if ":" in device else resolve_device(device)


@register_model("laplace")
class LaplaceHarnessLM(LM):
    """model_args: export=PATH (required), device=auto (cpu, cuda, cuda:N), kernel=auto, max_slots=8
    (lm-eval's batch_size means the same: the rows scored together), compile=true (the prefill
    buckets and generate_until's decode widths compiled; false: the same shapes, eager; the
    continuations' scoring forward is eager either way), max_gen_toks=256, max_context (models with
    attention layers: the tokens a sequence may reach, as engine.max_context; default 2048, or
    max_length + 1 where that is more, so every window fits; a scored context + continuation longer
    is refused), max_length (HFLM's: the tokens one
    forward sees; none by default: a fixed state needs no limit), rolling=windows|document (see
    the module docstring), add_bos_token (HFLM's: None = the tokenizer's own special tokens,
    true / false = add_special_tokens), dtype=float32|bfloat16|float16 (default: the export's),
    truncation=false (HFLM's tokenizer-side truncation; max_length's left-truncation is applied
    as HFLM applies it). Any other argument is refused, by name."""

    def __init__(
        self,
        export: str | None = None,
        device: str | None = "auto",
        kernel: str = "auto",
        max_slots: int | str | None = None,
        compile: bool | str = True,
        max_gen_toks: int | str = 256,
        max_context: int | str | None = None,
        max_length: int | str | None = None,
        rolling: str | None = None,
        add_bos_token: bool | str | None = None,
        dtype: str | None = None,
        truncation: bool | str = False,
        batch_size: int | str | None = None,
        max_batch_size: int | str | None = None,
        **unknown,
    ):
        super().__init__()
        if unknown:
            raise ConfigError(
                f"lm-eval --model laplace: unknown model_args {', '.join(sorted(unknown))} (the laplace "
                "model takes export, device, kernel, max_slots, compile, max_gen_toks, max_context, max_length, "
                "rolling, add_bos_token, dtype, truncation, batch_size, max_batch_size)"
            )
        if not export:
            raise ConfigError("lm-eval --model laplace: give --model_args export=PATH (an export directory)")
        if _truthy(truncation):
            raise ConfigError(
                "lm-eval --model laplace: truncation=true is HFLM's tokenizer-side truncation at the tokenizer's "
                "model_max_length, which a Laplace export does not have; give max_length (inputs are then "
                "left-truncated as HFLM truncates them)"
            )
        self.max_length = _optional_int("max_length", max_length)
        self.rolling = rolling or ("windows" if self.max_length else "document")
        if self.rolling not in ROLLING:
            raise ConfigError(f"lm-eval --model laplace: rolling={rolling!r} (choose windows or document)")
        if self.rolling == "windows" and not self.max_length:
            raise ConfigError("lm-eval --model laplace: rolling=windows needs max_length (the window's tokens)")
        if dtype not in (None, "", "auto") and dtype not in DTYPES:
            raise ConfigError(f"lm-eval --model laplace: dtype={dtype!r} (choose auto, {', '.join(DTYPES)})")
        self.add_special_tokens = None if add_bos_token in (None, "") else _truthy(add_bos_token)
        if max_context in (None, ""):  # room for a whole window (max_length tokens scored, one of context)
            max_context = max(EngineSection().max_context, (self.max_length or 0) + 1)
        self.engine, self.tokenizer, self.config = DecodeEngine.from_export(
            export,
            self._engine_params(slots_of(max_slots, batch_size, max_batch_size), max_context),
            "padded",
            device=torch_device(device),
            dtype=DTYPES.get(dtype),
            kernel=kernel,
            compiled=_truthy(compile),
        )
        self.model = self.engine.model
        self.max_gen_toks = int(max_gen_toks)
        self.bos_id, self.eos_id = self.config.get("bos_id"), self.config.get("eos_id")
        start = self.bos_id if self.bos_id is not None else self.eos_id
        if start is None:
            raise ConfigError(f"{export}: the export names neither a bos_id nor an eos_id to start a text with")
        self.start_id = start  # lm-eval's prefix_token_id: the tokenizer's BOS, else its EOS
        self.start_text = self.tokenizer.decode([start], skip_special_tokens=False)

    @staticmethod
    def _engine_params(max_slots: int, max_context) -> EngineSection:
        """The default `engine:` shapes at max_slots, any prompt length (lm-eval's contexts are long)."""
        return dataclasses.replace(
            EngineSection(),
            max_slots=max_slots,
            widths=[],
            max_prompt_tokens=2**62,
            prefix_cache_bytes=0,
            max_context=int(max_context),
        )

    # -- tokens: as lm-eval's HFLM (lm_eval/models/huggingface.py tok_encode, api/model.py) -------------

    def encode(self, text: str) -> list[int]:
        """Text as the model reads it inside a document: no special tokens (BOS is the start's)."""
        return self.tokenizer.encode(text, add_special_tokens=False).ids if text else []

    def tok_encode(self, text: str) -> list[int]:
        """HFLM.tok_encode: the tokenizer's own special tokens (its post-processor puts <s> first in
        Llama layouts) or as add_bos_token says, none where the text already starts with the prefix
        token's text."""
        special = self.add_special_tokens if self.add_special_tokens is not None else True
        return self.tokenizer.encode(text, add_special_tokens=special and not text.startswith(self.start_text)).ids

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
        (prompt ids, continuation ids): max_slots pairs at a time, the longest continuations together
        (as HFLM orders its batches), each through `score_rows`."""
        order = sorted(range(len(pairs)), key=lambda i: -len(pairs[i][1]))
        out: list[tuple[float, bool]] = [(0.0, True)] * len(pairs)
        rows = self.engine.cache.max_slots
        for first in range(0, len(pairs), rows):
            group = order[first : first + rows]
            for i, result in zip(group, self.score_rows([pairs[i] for i in group])):
                out[i] = result
        return out

    def score_rows(self, group: list[tuple[list[int], list[int]]]) -> list[tuple[float, bool]]:
        """`score` of up to max_slots pairs, one slot each: every prompt prefilled into its slot through
        the bucket graphs (its last logits predict the continuation's first token), then every
        continuation but its last token run together, right-padded, through the model's chunked
        (parallel) form continuing the slots, and scored from the logits at every position; a window
        of n tokens costs one forward of n - 1 (in pieces only where the rows' logits would pass
        SCORE_LOGITS). Attention layers: a pair must fit the slot's K/V cache (max_context)."""
        cache, runner = self.engine.cache, self.engine.runner
        totals, greedy = [0.0] * len(group), [True] * len(group)

        def add(row: int, logits: torch.Tensor, targets: list[int]) -> None:
            for start in range(0, len(targets), LOGPROB_ROWS):  # fp64 log-probs, a block of positions at a time
                block = logits[start : start + LOGPROB_ROWS]
                target = torch.as_tensor(targets[start : start + LOGPROB_ROWS], device=block.device)
                logp = F.log_softmax(block.double(), -1).gather(-1, target.view(-1, 1))
                totals[row] += float(logp.sum())
                greedy[row] = greedy[row] and bool((block.argmax(-1) == target).all())

        with cache.leased(range(len(group))) as slots:
            for slot, (prompt, cont) in zip(slots, group):
                self._check_room(slot, len(prompt) + len(cont) - 1)
            for row, (slot, (prompt, cont)) in enumerate(zip(slots, group)):
                last = runner.prefill(slot, prompt)
                add(row, last, cont[:1])
            inputs = [cont[:-1] for _, cont in group]
            piece = max(1, SCORE_LOGITS // (len(group) * self.model.cfg.vocab_size))
            for start in range(0, max(map(len, inputs), default=0), piece):
                live = [row for row, ids in enumerate(inputs) if len(ids) > start]
                ids = [inputs[row][start : start + piece] for row in live]
                logits = self.all_logits([slots[row] for row in live], ids)
                for b, row in enumerate(live):
                    add(row, logits[b, : len(ids[b])], group[row][1][start + 1 : start + 1 + len(ids[b])])
        return list(zip(totals, greedy))

    def all_logits(self, slots: list[int], ids: list[list[int]]) -> torch.Tensor:
        """The model's chunked form over `ids` (one row per slot, right-padded), continuing the slots'
        states (and K/V), eagerly (as the server's echo: no graph is compiled for this). Returns the
        logits at every position [rows, longest, V]."""
        runner = self.engine.runner
        longest = max(map(len, ids))
        tokens = torch.full((len(ids), longest), runner.pad_id, dtype=torch.long)
        for b, row in enumerate(ids):
            tokens[b, : len(row)] = torch.as_tensor(row)
        device = runner.device
        lengths = None if all(len(row) == longest for row in ids) else torch.tensor(list(map(len, ids)), device=device)
        with torch.compiler.set_stance("force_eager"):
            rows = torch.tensor(slots, device=device)
            return self.model.prefill(tokens.to(device), runner.graphs.state(), rows, lengths, all_logits=True)

    def _check_room(self, slot: int, tokens: int) -> None:
        try:
            self.engine.cache.check_room(slot, tokens)
        except InputError as e:
            raise ConfigError(
                f"lm-eval --model laplace: a request of {tokens} tokens does not fit max_context="
                f"{self.engine.cache.max_context} (the attention layers' K/V cache): give a larger max_context, "
                "or a max_length below it"
            ) from e

    def truncated(self, prompt: list[int], continuation: list[int]) -> tuple[list[int], list[int]]:
        """HFLM's left-truncation at max_length: the last max_length + 1 tokens of prompt +
        continuation (the last one is only predicted) are kept; nothing without max_length."""
        keep = self.max_length and self.max_length + 1 - len(continuation)
        if not keep:
            return prompt, continuation
        if keep < 1:
            raise ConfigError(
                f"lm-eval --model laplace: a continuation of {len(continuation)} tokens does not fit "
                f"max_length={self.max_length}"
            )
        return prompt[-keep:], continuation

    def loglikelihood(self, requests) -> list[tuple[float, bool]]:
        return self.score([self.truncated(*self.encode_pair(*req.args)) for req in requests])

    def rolling_pairs(self, text: str) -> list[tuple[list[int], list[int]]]:
        """The (context, continuation) pairs whose scores sum to one text's rolling log-likelihood:
        lm-eval's own windows over the text as HFLM encodes it (rolling=windows), or the whole text
        after the start token (rolling=document)."""
        if self.rolling == "document":
            return [([self.start_id], self.encode(text))]
        windows = get_rolling_token_windows(
            token_list=self.tok_encode(text), prefix_token=self.start_id, max_seq_len=self.max_length, context_len=1
        )
        return [make_disjoint_window(window) for window in windows]

    def loglikelihood_rolling(self, requests) -> list[float]:
        per_text = [self.rolling_pairs(req.args[0]) for req in requests]
        scores = iter(total for total, _ in self.score([pair for pairs in per_text for pair in pairs]))
        return [sum(next(scores) for _ in pairs) for pairs in per_text]

    def generate_until(self, requests) -> list[str]:
        batch, stops = [], []
        for n, req in enumerate(requests):
            context, kwargs = req.args
            until = kwargs.get("until") or []
            until = [until] if isinstance(until, str) else list(until)
            stops.append(until)
            max_gen = int(kwargs.get("max_gen_toks", self.max_gen_toks))
            prompt = self.prompt_ids(context)
            if self.max_length:  # HFLM's left-truncation: room for max_gen_toks within max_length
                prompt = prompt[-max(1, self.max_length - max_gen) :]
            batch.append(
                Request(
                    n,
                    prompt,
                    max_gen,
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
    include_defaults: bool = True,
) -> dict:
    """lm-eval's simple_evaluate on the export (tasks from lm-eval, or task YAMLs in include_path).
    metadata: lm-eval's task metadata (RULER's max_seq_lengths and tokenizer). include_defaults=False:
    only include_path's tasks are indexed (lm-eval's ~14,700 take ~6-12 s to index on 2 cores)."""
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    lm = LaplaceHarnessLM(export=str(export), **(model_args or {}))
    # the metadata goes to the TaskManager: simple_evaluate reads it only when it builds the manager itself
    manager = TaskManager(include_path=include_path, include_defaults=include_defaults, metadata=metadata)
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
