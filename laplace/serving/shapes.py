"""The engine's static shapes: fitting rows to the decode width ladder (whose one rule,
laplace.config.width_ladder, lives with the engine.widths knob) and the prefill pieces of a prompt.

A static-shape compiler (torch.compile(dynamic=False), Neuron) sees only these: the scheduler
picks a ladder width for each decode step, the model runner compiles one graph per width and per
prefill bucket."""

from __future__ import annotations


def fit(n: int, ladder: list[int]) -> int:
    """Smallest ladder entry >= n."""
    for w in ladder:
        if w >= n:
            return w
    raise ValueError(f"{n} rows do not fit the largest width {ladder[-1]}")


def prefill_pieces(n: int, buckets: list[int]) -> list[tuple[int, int]]:
    """(real tokens, bucket) of each piece a prompt of n tokens is prefilled in: full pieces of
    the largest bucket, then the rest right-padded to the smallest bucket that holds it."""
    largest = buckets[-1]
    return [(min(largest, n - start), fit(min(largest, n - start), buckets)) for start in range(0, n, largest)]
