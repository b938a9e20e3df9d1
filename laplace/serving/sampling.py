"""Sampling, and generation through the decode engine (laplace generate, the MLflow model)."""

from __future__ import annotations

import torch
from torch import Tensor


def sample_next(
    logits: Tensor,
    temperature: float | Tensor = 0.0,
    top_p: float | Tensor = 1.0,
    generator: torch.Generator | None = None,
) -> Tensor:
    """Next token per row of logits [B, V]: greedy where temperature == 0, else nucleus sampling."""
    logits = logits.float()
    B = logits.shape[0]
    temperature = torch.as_tensor(temperature, dtype=torch.float32, device=logits.device).expand(B)
    top_p = torch.as_tensor(top_p, dtype=torch.float32, device=logits.device).expand(B)
    greedy = logits.argmax(-1)
    if bool((temperature <= 0).all()):
        return greedy
    probs = torch.softmax(logits / temperature.clamp(min=1e-6).unsqueeze(-1), dim=-1)
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    before = sorted_probs.cumsum(-1) - sorted_probs  # mass strictly before each candidate
    sorted_probs = sorted_probs.masked_fill(before >= top_p.unsqueeze(-1), 0.0)  # always keeps the top token
    choice = torch.multinomial(sorted_probs, 1, generator=generator).squeeze(-1)
    sampled = order.gather(-1, choice.unsqueeze(-1)).squeeze(-1)
    return torch.where(temperature > 0, sampled, greedy)


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
    from laplace.serving.engine import DecodeEngine, Rejected, Request

    engine = model_or_engine if isinstance(model_or_engine, DecodeEngine) else DecodeEngine.single(model_or_engine)
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
    serve=None,
    policy: str = "eager",
) -> dict:
    """Generate from an export directory through the decode engine of `policy` built from the
    `serve:` params (default: one eager slot): the prompt, the completion, its ids and the rate."""
    import time

    from laplace.model.export import load_export
    from laplace.serving.engine import DecodeEngine

    model, tokenizer, config = load_export(model_dir)
    engine = DecodeEngine.single(model) if serve is None else DecodeEngine.for_policy(model, serve, policy)
    prompt_ids = tokenizer.encode(prompt).ids
    start = time.perf_counter()
    ids = generate_ids(
        engine,
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
