"""A params mapping -> a checked `Config`: any unknown key, wrong type or impossible value is a
`ConfigError` with a one-line message naming the key; then the checks that span sections (the
ranks that share a batch, the decode widths, the paths a knob names, attention windows)."""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import types
import typing
from typing import Any, Literal

from laplace.config.knobs import yaml_key
from laplace.config.model import check_attention_windows
from laplace.config.schema import Config
from laplace.config.serving import width_ladder
from laplace.errors import ConfigError

# knobs that were renamed: the old key's error names the new one
RENAMED = {"tokenizer.path": "tokenizer.from"}


def _type_name(tp) -> str:
    return getattr(tp, "__name__", str(tp)).replace("typing.", "")


def _coerce(value, tp, key: str):
    """Check `value` against the annotation `tp`; ints are accepted for floats."""
    if tp is Any:  # a structured knob (model.attn) that its own validator checks
        return value
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, key)
            except ConfigError:
                continue
        names = " or ".join(_type_name(a) for a in args if a is not type(None))
        raise ConfigError(f"{key}: expected {names}, got {type(value).__name__} {value!r}")
    if origin is Literal:
        choices = typing.get_args(tp)
        if value not in choices:
            raise ConfigError(f"{key}: must be one of {', '.join(map(str, choices))}, got {value!r}")
        return value
    if origin is list:
        (item_tp,) = typing.get_args(tp)
        if not isinstance(value, list):
            raise ConfigError(f"{key}: expected a list, got {type(value).__name__} {value!r}")
        return [_coerce(v, item_tp, f"{key}[{i}]") for i, v in enumerate(value)]
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{key}: expected true or false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key}: expected an integer, got {type(value).__name__} {value!r}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{key}: expected a number, got {type(value).__name__} {value!r}")
        if not math.isfinite(value):
            raise ConfigError(f"{key}: must be finite, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{key}: expected a string, got {type(value).__name__} {value!r}")
        return value
    raise TypeError(f"unsupported annotation {tp!r} for {key}")


def _build(cls, raw: Any, prefix: str):
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{prefix or 'params'}: expected a mapping, got {type(raw).__name__}")
    hints = typing.get_type_hints(cls)
    fields = {yaml_key(f): f for f in dataclasses.fields(cls)}
    for key in raw:
        if key not in fields:
            where = f"{prefix}.{key}" if prefix else str(key)
            if where in RENAMED:
                raise ConfigError(f"'{where}' is now '{RENAMED[where]}': rename the key (same value)")
            close = difflib.get_close_matches(str(key), list(fields), n=1)
            hint = f" (did you mean '{close[0]}'?)" if close else ""
            raise ConfigError(f"unknown key '{where}'{hint}")
    values = {}
    for name, f in fields.items():
        key = f"{prefix}.{name}" if prefix else name
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            values[f.name] = _build(tp, raw.get(name), key)
            continue
        if name not in raw:
            continue
        value = _coerce(raw[name], tp, key)
        check = f.metadata.get("check")
        if check is not None and value is not None:
            why = check(value)
            if why:
                raise ConfigError(f"{key}: {why}, got {value!r}")
        values[f.name] = value
    return cls(**values)


def config_from_dict(raw: dict) -> Config:
    cfg = _build(Config, raw, "")
    cfg.model_config()  # validates preset and architecture overrides now, not at first use
    t = cfg.train
    if t.nnodes > 1 and not t.rdzv_endpoint:
        raise ConfigError("train.rdzv_endpoint: required (host:port) when train.nnodes > 1")
    if t.node_rank >= t.nnodes:
        raise ConfigError(f"train.node_rank: must be < train.nnodes={t.nnodes}, got {t.node_rank}")
    if t.batch_size % (t.nproc_per_node * t.nnodes):
        raise ConfigError(
            f"train.batch_size: {t.batch_size} is not divisible by the "
            f"{t.nproc_per_node * t.nnodes} ranks (nproc_per_node x nnodes)"
        )
    width_ladder(cfg.engine.max_slots, cfg.engine.widths)  # refused now, not when an engine is built
    check_project_paths(cfg)
    check_attention_windows(cfg.model_config(), cfg.engine.max_context)
    return cfg


def project_path_knobs(cfg: Config) -> list[tuple[str, str]]:
    """(key, value) of every knob naming a file or directory to read. data.hub_path is a hub
    id or a local directory; hub ids never contain a '..' component, so the check is safe for both."""
    return [("data.path", cfg.data.path)] + [
        ("tokenizer.from", cfg.tokenizer.from_),
        ("model.init", cfg.model.init),
        ("data.hub_path", cfg.data.hub_path),
    ]


def check_project_paths(cfg: Config) -> None:
    """Relative paths (and globs) are read from the project directory and must stay inside it:
    one that climbs out with '..' is a ConfigError naming the key. Absolute paths are the
    explicit way to read elsewhere. The check is lexical (symlinks inside the project are
    the project owner's), so it gives the same answer whatever the current directory."""
    for key, value in project_path_knobs(cfg):
        if not value or os.path.isabs(value):
            continue
        parts = os.path.normpath(value).split(os.sep)
        if parts[0] == os.pardir:
            levels = next((i for i, part in enumerate(parts) if part != os.pardir), len(parts))
            raise ConfigError(
                f"{key}: {value!r} resolves outside the project ({levels} level(s) above the project "
                "directory, where relative paths are read); give an absolute path to read outside it"
            )
