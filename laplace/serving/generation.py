"""Generation through the decode engine: one prompt in, its completion out (laplace generate,
the MLflow model, the numerics check); greedy continuations of a batch of prompts on slots
leased by hand (the recall probes); and decode steps timed after prompts of several lengths (the
serve-check's decode cost and the architecture comparison). It sits above the engine, which
sits above sampling."""

from __future__ import annotations

import time
from collections.abc import Hashable
from typing import Any

import torch

from laplace.serving.engine import ONE_SLOT, DecodeEngine
from laplace.serving.model_runner import ModelRunner
from laplace.serving.scheduler import Rejected, Request


def generate_ids(
    model_or_engine,
    prompt_ids: list[int],
    max_new_tokens: int,
    temperature: float = 0.0,
    top_p: float = 1.0,
    seed: int = 0,
    stop_ids: tuple[int, ...] = (),
) -> list[int]:
    """Generate up to max_new_tokens ids after the prompt (stops early at a stop id, which is kept),
    through a DecodeEngine: the one given, or a one-slot eager engine around a bare model. A request
    the engine rejects raises Rejected (an InputError) with the reason."""
    engine = (
        model_or_engine
        if isinstance(model_or_engine, DecodeEngine)
        else DecodeEngine(model_or_engine, ONE_SLOT, "eager")
    )
    request = Request(0, list(prompt_ids), max_new_tokens, temperature, top_p, tuple(stop_ids), seed)
    (done,) = engine.complete([request])
    if done.status != "done":
        raise Rejected(done.reason)
    return done.output_ids


def generate_text(
    model_dir,
    prompt: str,
    max_new_tokens: int,
    temperature: float,
    top_p: float,
    seed: int,
    engine=None,
    policy: str = "eager",
) -> dict:
    """Generate from an export directory through the decode engine of `policy` built from the
    `engine:` params (default: one eager slot): the prompt, the completion, its ids and the rate."""
    decoder, tokenizer, config = DecodeEngine.from_export(model_dir, ONE_SLOT if engine is None else engine, policy)
    prompt_ids = tokenizer.encode(prompt).ids
    start = time.perf_counter()
    ids = generate_ids(
        decoder,
        prompt_ids,
        max_new_tokens,
        temperature,
        top_p,
        seed,
        stop_ids=(config["eos_id"],) if config.get("eos_id") is not None else (),
    )
    seconds = time.perf_counter() - start
    return {
        "prompt": prompt,
        "completion": tokenizer.decode(ids),
        "prompt_ids": prompt_ids,
        "ids": ids,
        "new_tokens": len(ids),
        "tokens_per_s": len(ids) / max(seconds, 1e-9),
    }


@torch.inference_mode()
def greedy_batch(engine: DecodeEngine, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    """Greedy continuations of `prompts`, max_slots at a time: each prefilled into a slot leased
    from the engine's cache manager, then decoded together by its model runner at the smallest
    decode width that holds them."""
    cache, runner = engine.cache, engine.runner
    outputs: list[list[int]] = []
    for first in range(0, len(prompts), cache.max_slots):
        group = prompts[first : first + cache.max_slots]
        with cache.leased(range(len(group))) as slots:
            out = [[int(runner.prefill(slot, p)[0].argmax())] for slot, p in zip(slots, group)]
            for _ in range(new_tokens - 1):
                logits = runner.decode_rows(slots, [o[-1] for o in out])
                for o, row in zip(out, logits):
                    o.append(int(row.argmax()))
        outputs.extend(out)
    return outputs


@torch.inference_mode()
def decode_step_times(sequences: dict[Hashable, tuple[ModelRunner, int, Any]], steps: int, warm: int = 4) -> dict:
    """{key: seconds of each of `steps` greedy one-row decode steps} of each sequence (a runner, a
    slot leased from its cache manager, the prompt ids prefilled into it first). The sequences step
    in turn, in an order that flips every round: on a loaded machine the second of two
    back-to-back steps is the one more often preempted, which must not bias any of them. The first
    `warm` rounds (caches warming) are not timed."""
    tokens = {key: runner.prefill(slot, prompt).argmax(-1) for key, (runner, slot, prompt) in sequences.items()}
    keys = list(sequences)
    times: dict[Hashable, list[float]] = {key: [] for key in keys}
    for i in range(steps + warm):
        for key in keys if i % 2 == 0 else keys[::-1]:
            runner, slot, _ = sequences[key]
            start = time.perf_counter()
            tokens[key] = runner.decode_rows([slot], tokens[key]).argmax(-1)
            if i >= warm:
                times[key].append(time.perf_counter() - start)
    return times
