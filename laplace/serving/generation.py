"""Generation through the decode engine: one prompt in, its completion out (laplace generate,
the MLflow model, the numerics check). It sits above the engine, which sits above sampling."""

from __future__ import annotations

import time

from laplace.serving.engine import ONE_SLOT, DecodeEngine, Rejected, Request


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
