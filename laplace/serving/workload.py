"""Seeded serving workloads: arrival processes and request lengths.

- batch:   every request arrives at t = 0 (a fixed batch)
- poisson: exponential gaps with mean 1/rate
- bursty:  Gamma-distributed gaps with the same mean and a coefficient of variation of
           burst_cv (> 1 clusters arrivals into bursts separated by lulls)
- shared_prefix: Poisson arrivals whose prompts all start with one system prompt of
           serve_check.shared_prefix_tokens tokens, each followed by its own user text (what the
           state prefix cache is for: serving/prefix_cache.py)

Prompts are windows of real validation text, so the model decodes plausible tokens.
"""

from __future__ import annotations

import numpy as np

from laplace.config import ServeCheckSection
from laplace.errors import ConfigError
from laplace.serving.scheduler import Request

ARRIVALS = ("batch", "poisson", "bursty")
SHARED_PREFIX = "shared_prefix"
WORKLOADS = (*ARRIVALS, SHARED_PREFIX)


def arrival_times(kind: str, n: int, rate: float, burst_cv: float, rng: np.random.Generator) -> np.ndarray:
    if kind == "batch":
        return np.zeros(n)
    if kind == "poisson":
        gaps = rng.exponential(1.0 / rate, size=n)
    elif kind == "bursty":
        shape = 1.0 / burst_cv**2
        gaps = rng.gamma(shape, 1.0 / (rate * shape), size=n)
    else:
        raise ConfigError(
            f"serve_check.workloads: unknown arrival process {kind!r} (choose from {', '.join(ARRIVALS)})"
        )
    gaps[0] = 0.0
    return np.cumsum(gaps)


def log_uniform(lo: int, hi: int, n: int, rng: np.random.Generator) -> np.ndarray:
    if not 1 <= lo <= hi:
        raise ConfigError(
            f"serve_check.prompt_tokens/output_tokens: length range must satisfy 1 <= min <= max, got [{lo}, {hi}]"
        )
    return np.floor(np.exp(rng.uniform(np.log(lo), np.log(hi + 1), size=n))).astype(int).clip(lo, hi)


def build_requests(
    kind: str, serve_check: ServeCheckSection, text_tokens: np.ndarray, seed: int, max_prompt_tokens: int | None = None
) -> list[Request]:
    """The seeded workload `kind` of serve_check.requests requests over windows of `text_tokens`.
    shared_prefix prompts (system prompt + user text) are capped at `max_prompt_tokens`
    (engine.max_prompt_tokens; default: system prompt + the longest user text)."""
    rng = np.random.default_rng([seed, WORKLOADS.index(kind) if kind in WORKLOADS else 99])
    n = serve_check.requests
    system: list[int] = []
    if kind == SHARED_PREFIX:
        shared = serve_check.shared_prefix_tokens
        limit = max_prompt_tokens or shared + max(serve_check.prompt_tokens)
        if limit - shared < 1:
            raise ConfigError(
                f"serve_check.shared_prefix_tokens: {shared} leaves no room for user text "
                f"within engine.max_prompt_tokens={limit}"
            )
        start = int(rng.integers(0, len(text_tokens) - shared))
        system = [int(t) for t in text_tokens[start : start + shared]]
    kind_of_arrivals = "poisson" if kind == SHARED_PREFIX else kind
    arrivals = arrival_times(kind_of_arrivals, n, serve_check.rate, serve_check.burst_cv, rng)
    prompt_lens = log_uniform(*serve_check.prompt_tokens, n, rng)
    if system:  # the user text after the system prompt
        prompt_lens = prompt_lens.clip(1, limit - len(system))
    output_lens = log_uniform(*serve_check.output_tokens, n, rng)
    starts = rng.integers(0, len(text_tokens) - int(prompt_lens.max()) - 1, size=n)
    return [
        Request(
            id=i,
            prompt_ids=system + [int(t) for t in text_tokens[s : s + p]],
            max_new_tokens=int(o),
            temperature=serve_check.temperature,
            top_p=serve_check.top_p,
            seed=seed * 100003 + i,
            arrival_s=float(a),
        )
        for i, (a, p, o, s) in enumerate(zip(arrivals, prompt_lens, output_lens, starts))
    ]
