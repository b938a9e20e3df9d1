"""`model:`, the architecture: one knob per ModelConfig field, built from ModelConfig itself (so a
new field is a knob at once), and how the section resolves to a ModelConfig: a preset with its
overrides, or model.init's export. The one module of laplace.config that imports the model room:
laplace/model/config.py, which imports nothing above the base (tests/test_layout.py UPWARD_ALLOWED)."""

from __future__ import annotations

import dataclasses
import json
import typing
from pathlib import Path
from typing import Any

from laplace.config.knobs import knob
from laplace.errors import ConfigError
from laplace.model.config import PRESETS, RUNTIME_FIELDS, ModelConfig, preset_model_config, validate_model_config


def _model_section() -> type:
    """`model:` in params.yaml: a preset plus one knob per ModelConfig field, built from ModelConfig's
    own fields and docs (so a new field is a knob at once). An architecture knob left empty (null)
    takes the preset's value; a runtime field (RUNTIME_FIELDS: kernel) defaults to ModelConfig's."""
    hints = typing.get_type_hints(ModelConfig)
    fields: list[tuple[str, Any, Any]] = [
        (
            "preset",
            str,
            knob("tiny", doc=" | ".join(PRESETS) + "; the keys below override the preset (empty = the preset's)"),
        ),
        (
            "init",
            str,
            knob(
                "",
                doc="an export or `laplace import` directory to fine-tune from (its architecture and weights; "
                "the keys below must then agree with it or stay empty); empty: a random init",
            ),
        ),
    ]
    for f in dataclasses.fields(ModelConfig):
        doc = f.metadata.get("doc", "")
        if f.name in RUNTIME_FIELDS:
            fields.append((f.name, hints[f.name], knob(f.default, doc=doc)))
        else:
            fields.append((f.name, hints[f.name] | None, knob(None, doc=doc)))
    section = dataclasses.make_dataclass("ModelSection", fields, frozen=True)
    section.__module__ = __name__
    section.__doc__ = "`model:` the architecture: a preset, and one key per ModelConfig field (overrides of the preset)"
    return section


ModelSection = _model_section()


def resolve_model_config(model: ModelSection, vocab_size: int) -> ModelConfig:
    """The architecture the section describes: model.init's when it names an export, else the
    preset with the section's overrides, and `vocab_size` (the tokenizer's) where neither the
    preset nor the section gives one."""
    overrides = {f.name: getattr(model, f.name) for f in dataclasses.fields(ModelSection)}
    preset = overrides.pop("preset")
    if overrides.pop("init"):
        return init_model_config(model)
    if overrides["vocab_size"] is None and not PRESETS.get(preset, {}).get("vocab_size"):
        overrides["vocab_size"] = vocab_size
    return preset_model_config(preset, **overrides)


def init_model_config(model: ModelSection) -> ModelConfig:
    """The architecture of model.init's export (the weights decide it); a model.* override that
    disagrees with it is a ConfigError naming the key (model.kernel is the process's choice)."""
    # config.json read here, not through laplace.model.export: every stage reads this module
    path = Path(model.init) / "config.json"
    try:
        found = json.loads(path.read_text(encoding="utf-8"))
        assert isinstance(found, dict) and isinstance(found.get("model"), dict)
    except (OSError, ValueError, AssertionError):
        raise ConfigError(
            f"model.init: {path} is missing or not an export's config (run `laplace import` first)"
        ) from None
    arch = dict(found["model"])
    for name, value in dataclasses.asdict(model).items():
        if name in ("preset", "init", "kernel") or value is None:
            continue
        if arch.get(name) != value:
            raise ConfigError(
                f"model.{name}: {value!r} disagrees with model.init {model.init} ({arch.get(name)!r}); "
                "leave it empty to take the init's"
            )
    return validate_model_config(ModelConfig(**{**arch, "kernel": model.kernel}), "model.init")


def check_attention_windows(model: ModelConfig, max_context: int) -> None:
    """A sliding window wider than the longest context a slot holds never slides: refused by name."""
    for spec in model.attn_specs:
        window = spec["window_size"]
        if window is not None and window > max_context:
            raise ConfigError(
                f"model.attn: window_size={window} of layers {spec['layers']} is larger than the context, "
                f"engine.max_context={max_context}"
            )
