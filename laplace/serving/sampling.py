"""Sampling and single-request generation: prefill the prompt, then decode token by token."""

from __future__ import annotations

import torch
from torch import Tensor

from laplace.model.lm import LaplaceLM


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


@torch.no_grad()
def generate_ids(
    model: LaplaceLM,
    prompt_ids: list[int],
    max_new_tokens: int,
    temperature: float = 0.0,
    top_p: float = 1.0,
    seed: int = 0,
    stop_ids: tuple[int, ...] = (),
) -> list[int]:
    """Generate up to max_new_tokens ids after the prompt (stops early at a stop id, which is kept)."""
    if not prompt_ids:
        raise ValueError("prompt is empty: at least one token is needed")
    if max_new_tokens <= 0:
        raise ValueError(f"max_new_tokens must be > 0, got {max_new_tokens}")
    device = next(model.parameters()).device
    gen = torch.Generator(device=device).manual_seed(seed)
    state = model.allocate_state(1)
    logits = model.prefill(torch.tensor([prompt_ids], device=device), state)
    out: list[int] = []
    for _ in range(max_new_tokens):
        token = sample_next(logits, temperature, top_p, gen)
        out.append(int(token))
        if out[-1] in stop_ids or len(out) == max_new_tokens:
            break
        logits = model.decode_step(token, state)
    return out


def generate_text(model_dir, prompt: str, max_new_tokens: int, temperature: float, top_p: float, seed: int) -> dict:
    """Generate from an export directory: the prompt, the completion, token count and rate."""
    import time

    from laplace.model.export import load_export

    model, tokenizer, config = load_export(model_dir)
    prompt_ids = tokenizer.encode(prompt).ids
    start = time.perf_counter()
    with torch.inference_mode():
        ids = generate_ids(
            model,
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
        "new_tokens": len(ids),
        "tokens_per_s": len(ids) / max(seconds, 1e-9),
    }
