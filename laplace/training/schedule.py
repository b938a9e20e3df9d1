"""The learning-rate schedule: a multiplier on the base learning rates, per step."""

from __future__ import annotations

import math

from laplace.config import TrainSection


def lr_scale(step: int, t: TrainSection) -> float:
    """Multiplier on the base learning rates: linear warmup, then cosine, WSD or constant."""
    if t.warmup_steps and step < t.warmup_steps:
        return (step + 1) / t.warmup_steps
    if t.schedule == "constant":
        return 1.0
    if t.schedule == "cosine":
        span = max(1, t.steps - t.warmup_steps)
        progress = min(1.0, (step - t.warmup_steps) / span)
        return t.min_lr_ratio + (1 - t.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
    # wsd: warmup, stable, then a linear decay over the last decay_fraction of the steps
    decay_steps = max(1, int(round(t.steps * t.decay_fraction)))
    decay_start = t.steps - decay_steps
    if step < decay_start:
        return 1.0
    return 1.0 - (1 - t.min_lr_ratio) * min(1.0, (step - decay_start + 1) / decay_steps)
