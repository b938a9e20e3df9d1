"""Passkey retrieval: a 5-digit number hidden at some depth of real text, asked for at the end,
read back greedily through the serving engine (long prompts prefilled in bucket pieces)."""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from laplace.errors import ConfigError
from laplace.progress import progress_bar
from laplace.serving.engine import DecodeEngine
from laplace.serving.generation import greedy_batch


def prefill_long(engine: DecodeEngine, prompt_ids, slot: int) -> Tensor:
    """Prefill a prompt of any length into a clean `slot`; returns the last token's logits [1, V].

    The model runner's prefill runs it in pieces through the warmed-up bucket graphs only, whatever
    the context length, and the result equals one prefill of the whole prompt."""
    engine.cache.state.zero_(torch.tensor([slot], device=engine.cache.device))
    return engine.runner.prefill(slot, prompt_ids)


# --------------------------------------------------------------------------- passkey

PASSKEY_NEEDLE = " The pass key is {key}. Remember it. {key} is the pass key."
PASSKEY_QUESTION = " What is the pass key? The pass key is"


def haystack_filler(haystack, n: int, rng: np.random.Generator) -> list[int]:
    """n filler ids from a random offset of the haystack, repeated when it is shorter than n."""
    start = int(rng.integers(0, max(1, len(haystack) - n)))
    return np.resize(np.asarray(haystack[start : start + n], dtype=np.int64), n).tolist()


def passkey_prompt(
    tokenizer,
    haystack: np.ndarray,
    context: int,
    depth: float,
    key: int,
    rng: np.random.Generator,
    bos_id: int | None = None,
) -> list[int]:
    """About `context` tokens: real text with the needle sentence inserted at `depth` (a
    fraction of the filler), then the question. The filler is a random window of the haystack
    (repeated if the haystack is shorter). Fragments are encoded without special tokens (a
    Llama tokenizer would put BOS in front of each); the model's BOS, if it has one, starts the prompt."""
    needle = tokenizer.encode(PASSKEY_NEEDLE.format(key=key), add_special_tokens=False).ids
    question = tokenizer.encode(PASSKEY_QUESTION, add_special_tokens=False).ids
    head = [] if bos_id is None else [bos_id]
    filler_len = context - len(head) - len(needle) - len(question)
    if filler_len < 0:
        raise ConfigError(
            f"probes.passkey_contexts: passkey context {context} is shorter than the needle and question "
            f"({len(needle) + len(question)} tokens)"
        )
    filler = haystack_filler(haystack, filler_len, rng)
    at = int(round(depth * filler_len))
    return head + filler[:at] + needle + filler[at:] + question


def passkey_found(text: str, key: int) -> bool:
    """The key's digits appear in the generated text (spaces between digit tokens ignored)."""
    return str(key) in text.replace(" ", "")


def passkey_probe(
    engine: DecodeEngine,
    tokenizer,
    haystack_tokens,
    contexts: list[int],
    depths: list[float],
    samples: int,
    seed: int,
    new_tokens: int = 8,
    progress: bool = True,
    bos_id: int | None = None,
) -> dict:
    """Greedy passkey retrieval through the engine: found when the 5 digits appear in the
    first `new_tokens` generated tokens. Each prompt gets a pool slot, is prefilled through the
    bucket graphs (in pieces when longer than the largest bucket, so a 4,096-token context needs
    no new shape) and decoded at the smallest ladder width (generation.greedy_batch, one prompt).
    Returns accuracy per context, per depth, per (context, depth), overall, and the table."""
    rng = np.random.default_rng(seed)
    haystack = np.asarray(haystack_tokens)
    if len(haystack) == 0:
        raise ValueError("passkey haystack is empty")
    rows = []
    cells = [(c, d, s) for c in contexts for d in depths for s in range(samples)]
    for ctx, depth, _ in progress_bar(cells, desc="passkey", unit="prompt", enabled=progress):
        key = int(rng.integers(10000, 100000))
        prompt = passkey_prompt(tokenizer, haystack, ctx, depth, key, rng, bos_id)
        (output,) = greedy_batch(engine, [prompt], new_tokens)
        text = tokenizer.decode(output)
        rows.append(
            {
                "context": ctx,
                "depth": depth,
                "key": key,
                "prompt_tokens": len(prompt),
                "found": passkey_found(text, key),
                "output": text,
            }
        )

    def share(select):
        hits = [r["found"] for r in rows if select(r)]
        return sum(hits) / len(hits) if hits else float("nan")

    return {
        "accuracy": {c: share(lambda r, c=c: r["context"] == c) for c in contexts},
        "accuracy_by_depth": {d: share(lambda r, d=d: r["depth"] == d) for d in depths},
        "accuracy_grid": {
            c: {d: share(lambda r, c=c, d=d: (r["context"], r["depth"]) == (c, d)) for d in depths} for c in contexts
        },
        "accuracy_overall": share(lambda r: True),
        "table": rows,
    }
