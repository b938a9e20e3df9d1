"""`Config`: every section, as params.yaml lays them out, and what the whole says of itself: its
dict, its flat knobs, its digest, every knob's doc and the defaults."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import typing
from dataclasses import dataclass, field
from typing import Any

from laplace.config.compare import CompareSection, MqarSection
from laplace.config.data import DataSection, TokenizerSection
from laplace.config.evals import NumericsSection, ProbesSection
from laplace.config.knobs import knob, yaml_key
from laplace.config.model import ModelConfig, ModelSection, resolve_model_config
from laplace.config.operations import PipelineSection, TrackingSection
from laplace.config.serving import EngineSection, GenerateSection, ServeCheckSection, ServerSection
from laplace.config.training import AdamWSection, MuonSection, TrainSection


@dataclass(frozen=True)
class Config:
    seed: int = knob(1234, doc="seeds the tokenizer sample, the validation split, the model init and the data order")
    data: DataSection = field(default_factory=DataSection)
    tokenizer: TokenizerSection = field(default_factory=TokenizerSection)
    model: ModelSection = field(default_factory=ModelSection)
    train: TrainSection = field(default_factory=TrainSection)
    adamw: AdamWSection = field(default_factory=AdamWSection)
    muon: MuonSection = field(default_factory=MuonSection)
    generate: GenerateSection = field(default_factory=GenerateSection)
    engine: EngineSection = field(default_factory=EngineSection)
    server: ServerSection = field(default_factory=ServerSection)
    serve_check: ServeCheckSection = field(default_factory=ServeCheckSection)
    numerics: NumericsSection = field(default_factory=NumericsSection)
    probes: ProbesSection = field(default_factory=ProbesSection)
    tracking: TrackingSection = field(default_factory=TrackingSection)
    pipeline: PipelineSection = field(default_factory=PipelineSection)
    compare: CompareSection = field(default_factory=CompareSection)
    mqar: MqarSection = field(default_factory=MqarSection)

    def model_config(self, vocab_size: int | None = None) -> ModelConfig:
        """The resolved architecture: preset, then params overrides, then the tokenizer's vocab size."""
        return resolve_model_config(self.model, vocab_size or self.tokenizer.vocab_size)

    def to_dict(self) -> dict:
        """The config as params.yaml lays it out (keys as written there: `tokenizer.from`)."""

        def plain(obj):
            if dataclasses.is_dataclass(obj):
                return {yaml_key(f): plain(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
            return [plain(v) for v in obj] if isinstance(obj, list) else obj

        return plain(self)

    def flat(self, without: tuple[str, ...] = ()) -> dict[str, Any]:
        """Every effective knob as `section.key: value` (for tracking), less the sections and
        `section.key`s named in `without`."""
        out: dict[str, Any] = {}

        def walk(prefix, value):
            if prefix in without:
                return
            if isinstance(value, dict):
                for k, v in value.items():
                    walk(f"{prefix}.{k}" if prefix else k, v)
            else:
                out[prefix] = value

        walk("", self.to_dict())
        return out

    def digest(self, without: tuple[str, ...] = ()) -> str:
        """A stable hash of every effective knob (less those named in `without`, as flat)."""
        blob = json.dumps(self.flat(without), sort_keys=True, default=str).encode()
        return hashlib.sha256(blob).hexdigest()[:16]


def knob_docs(cls: type = None, prefix: str = "") -> dict[str, str]:
    """`section.key: doc` of every knob, and `section: doc` of every section (its docstring's first
    paragraph, less the leading `name:`): the one place a knob is documented (params.yaml's
    comments are written from it)."""
    cls = cls or Config
    out: dict[str, str] = {}
    for f in dataclasses.fields(cls):
        key = f"{prefix}.{yaml_key(f)}" if prefix else yaml_key(f)
        tp = typing.get_type_hints(cls)[f.name]
        if dataclasses.is_dataclass(tp):
            first = (tp.__doc__ or "").strip().split("\n\n")[0]
            out[key] = " ".join(first.removeprefix(f"`{f.name}:`").split()).rstrip(".")
            out.update(knob_docs(tp, key))
        else:
            out[key] = f.metadata.get("doc", "")
    return out


def default_params() -> dict:
    """The defaults in code, as a params.yaml mapping (tests compare it with the file)."""
    return Config().to_dict()
