"""A knob: one config field with its default, its value check and its one doc; and the value
checks the sections share."""

from __future__ import annotations

import dataclasses
from dataclasses import field

# A value check returns None for a good value, else why not: the words of the ConfigError naming the key.


def positive(v):
    return None if v > 0 else "must be > 0"


def non_negative(v):
    return None if v >= 0 else "must be >= 0"


def fraction(v):
    return None if 0.0 <= v < 1.0 else "must be in [0, 1)"


def unit_interval(v):
    return None if 0.0 < v <= 1.0 else "must be in (0, 1]"


def knob(default, check=None, doc: str = "", key: str | None = None):
    """A config field with a default, an optional value check and a docstring. `key`: its name in
    params.yaml where that is not a Python identifier (`tokenizer.from`, a keyword)."""
    metadata = {"check": check, "doc": doc, "key": key}
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata=metadata)
    return field(default=default, metadata=metadata)


def yaml_key(f: dataclasses.Field) -> str:
    """A field's key in params.yaml (its Python name unless the knob says otherwise)."""
    return f.metadata.get("key") or f.name


def log_range(v) -> str | None:
    """A [low, high] range of positive numbers (drawn from log-uniformly)."""
    ok = isinstance(v, list) and len(v) == 2 and all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in v)
    return None if ok and 0 < v[0] <= v[1] else f"must be [low, high] with 0 < low <= high, got {v!r}"
