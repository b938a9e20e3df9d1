"""The engine's static shapes: the decode width ladder and the prefill pieces of a prompt.

A static-shape compiler (torch.compile(dynamic=False), Neuron) sees only these: the scheduler
picks a ladder width for each decode step, the model runner compiles one graph per width and per
prefill bucket."""

from __future__ import annotations

from laplace.errors import ConfigError


def width_ladder(max_slots: int, widths: list[int] | None = None) -> list[int]:
    """The decode widths: `widths` sorted, or powers of two up to max_slots (max_slots included)."""
    if widths:
        ladder = sorted(set(widths))
        if ladder[0] < 1:
            raise ConfigError(f"engine.widths: widths must be >= 1, got {ladder}")
        if ladder[-1] < max_slots:
            raise ConfigError(f"engine.widths: the largest width {ladder[-1]} cannot hold max_slots={max_slots}")
        return ladder
    ladder = [1 << i for i in range(max_slots.bit_length()) if (1 << i) < max_slots]
    return ladder + [max_slots]


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
