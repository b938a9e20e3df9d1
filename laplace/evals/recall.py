"""The recall suite: what the served model retrieves from its context, per context length, against chance.

Tasks (RULER-style needle-in-a-haystack, plus passkey and MQAR from their own modules):
- niah_single: one "special magic number" for one key hidden in real text; asked for at the end.
- niah_multikey: several needles with distinct keys; asked for one of them (the others distract).
- niah_multivalue: one key with several numbers; asked for all (the share of them found counts).
Every prompt is built from the model's own tokenizer (text fragments encoded without special
tokens, the model's BOS first where it has one), filled with real validation text, and read back
greedily through the serving engine: every prompt of a length is prefilled into its own slot and
they decode together at the engine's padded ladder widths.

Chance: a 7-digit number guessed at random is found with probability 1e-7 (passkey's 5 digits:
1e-5), MQAR's is 1/|values|. A task is "above chance" at a length when its accuracy exceeds chance
by two binomial standard errors of the samples (at least one hit when chance is ~0).
"""

from __future__ import annotations

import math

import numpy as np

from laplace.errors import ConfigError
from laplace.evals.passkey import haystack_filler
from laplace.serving.engine import DecodeEngine
from laplace.serving.generation import greedy_batch

KEYS = ["apple", "river", "copper", "violet", "falcon", "marble", "harbor", "lantern", "meadow", "cobalt"]
NEEDLE = " One of the special magic numbers for {key} is: {value}."
QUESTION = (
    " What is the special magic number for {key} mentioned in the provided text? The special magic number for {key} is:"
)
QUESTION_ALL = " What are all the special magic numbers for {key} mentioned in the provided text? They are:"
DIGITS = 7
NIAH_TASKS = ("niah_single", "niah_multikey", "niah_multivalue")
NIAH_NEEDLES = 4  # needles of the multi-key and multi-value tasks


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False).ids


def niah_prompt(
    task: str, tokenizer, haystack: np.ndarray, context: int, rng: np.random.Generator, bos_id: int | None = None
) -> tuple[list[int], list[str]]:
    """(prompt ids of about `context` tokens, the numbers to recall) for one NIAH task."""
    keys = list(rng.choice(KEYS, size=NIAH_NEEDLES, replace=False))
    number = lambda: str(int(rng.integers(10 ** (DIGITS - 1), 10**DIGITS)))  # noqa: E731
    if task == "niah_single":
        needles = [(keys[0], number())]
        wanted, question = needles, QUESTION.format(key=keys[0])
    elif task == "niah_multikey":
        needles = [(k, number()) for k in keys]
        wanted = [needles[int(rng.integers(0, len(needles)))]]
        question = QUESTION.format(key=wanted[0][0])
    elif task == "niah_multivalue":
        needles = [(keys[0], number()) for _ in range(NIAH_NEEDLES)]
        wanted, question = needles, QUESTION_ALL.format(key=keys[0])
    else:
        raise ValueError(f"unknown NIAH task {task!r}")
    pieces = [encode(tokenizer, NEEDLE.format(key=k, value=v)) for k, v in needles]
    q = encode(tokenizer, question)
    head = [] if bos_id is None else [bos_id]
    filler_len = context - len(head) - len(q) - sum(map(len, pieces))
    if filler_len < 0:
        raise ConfigError(
            f"probes.recall_contexts: {task} context {context} is shorter than its needles and question "
            f"({context - filler_len} tokens)"
        )
    filler = haystack_filler(haystack, filler_len, rng)
    cuts = sorted(int(c) for c in rng.integers(0, filler_len + 1, size=len(pieces)))
    prompt, last = list(head), 0
    for cut, piece in zip(cuts, pieces):
        prompt += filler[last:cut] + piece
        last = cut
    return prompt + filler[last:] + q, [v for _, v in wanted]


def found_share(text: str, wanted: list[str]) -> float:
    """Share of the wanted numbers that appear in the generated text (spaces ignored)."""
    flat = text.replace(" ", "")
    return sum(v in flat for v in wanted) / len(wanted)


def niah_suite(
    engine: DecodeEngine,
    tokenizer,
    haystack,
    contexts: list[int],
    samples: int,
    seed: int,
    bos_id: int | None = None,
    tasks=NIAH_TASKS,
) -> dict:
    """{task: {context: accuracy}} of the NIAH tasks through the engine."""
    rng = np.random.default_rng(seed)
    haystack = np.asarray(haystack)
    new_tokens = {t: (DIGITS + 2) * (NIAH_NEEDLES if t == "niah_multivalue" else 1) for t in tasks}
    out: dict = {}
    for task in tasks:
        out[task] = {}
        for ctx in contexts:
            built = [niah_prompt(task, tokenizer, haystack, ctx, rng, bos_id) for _ in range(samples)]
            outputs = greedy_batch(engine, [p for p, _ in built], new_tokens[task])
            shares = [found_share(tokenizer.decode(o), w) for o, (_, w) in zip(outputs, built)]
            out[task][ctx] = sum(shares) / len(shares)
    return out


def above_chance(accuracy: float, chance: float, samples: int) -> bool:
    """Accuracy beyond chance by two binomial standard errors (at least one hit when chance ~ 0)."""
    if accuracy != accuracy:  # NaN: not measured
        return False
    margin = 2 * math.sqrt(max(chance * (1 - chance), 0.0) / max(samples, 1))
    return accuracy > chance + margin and accuracy > 0


def verdicts(recall: dict, chance: dict, samples: dict) -> dict:
    """{context: plain verdict} over every task measured at that length, e.g.
    "recall above chance: passkey, niah_single" or "recall: none above chance"."""
    lengths = sorted({int(c) for grid in recall.values() for c in grid})
    out = {}
    for ctx in lengths:
        hits = [
            task
            for task, grid in recall.items()
            if ctx in {int(c) for c in grid} and above_chance(_at(grid, ctx), chance[task], samples[task])
        ]
        out[ctx] = f"recall above chance: {', '.join(hits)}" if hits else "recall: none above chance"
    return out


def overall_verdict(by_length: dict) -> str:
    good = [str(c) for c, v in sorted(by_length.items(), key=lambda kv: int(kv[0])) if "none" not in v]
    if not good:
        return "recall: none above chance at any length"
    return f"recall above chance at {', '.join(good)} tokens"


def _at(grid: dict, ctx: int) -> float:
    for c, v in grid.items():
        if int(c) == ctx:
            return v
    return float("nan")
