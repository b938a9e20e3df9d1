"""Typed, validated configuration sections: every knob, with its default, check and doc.

`config_from_dict()` builds frozen dataclasses from a params mapping; any unknown key,
wrong type or impossible value raises `ConfigError` with a one-line message naming the
key. This package knows nothing of stages or tracking, so the library may import it; reading
params.yaml and applying `--set` overrides live in `laplace.pipeline.params`. The one file it
reads is the one a knob names as the model: model.init's config.json (init_model_config: the
architecture of an import, which its weights decide); paths are otherwise checked lexically.

One module per group of sections, named for the room that reads them (data, model, training,
serving, evals, compare, operations: tracking and Prefect), on knobs.py (a knob, its checks);
schema.py puts the sections together as `Config`, build.py builds and checks one from a mapping.
Every name is imported from here (`from laplace.config import EngineSection`).
"""

from __future__ import annotations

from laplace.config.build import RENAMED, check_project_paths, config_from_dict, project_path_knobs
from laplace.config.compare import CompareSection, MqarSection
from laplace.config.data import DataSection, TokenizerSection
from laplace.config.evals import NumericsSection, ProbesSection
from laplace.config.knobs import knob, yaml_key
from laplace.config.model import (
    ModelConfig,
    ModelSection,
    check_attention_windows,
    init_model_config,
    resolve_model_config,
)
from laplace.config.operations import PipelineSection, TrackingSection
from laplace.config.schema import Config, default_params, knob_docs
from laplace.config.serving import EngineSection, GenerateSection, ServeCheckSection, ServerSection, width_ladder
from laplace.config.training import AdamWSection, MuonSection, TrainSection
from laplace.errors import ConfigError

__all__ = [
    "RENAMED",
    "AdamWSection",
    "CompareSection",
    "Config",
    "ConfigError",
    "DataSection",
    "EngineSection",
    "GenerateSection",
    "ModelConfig",
    "ModelSection",
    "MqarSection",
    "MuonSection",
    "NumericsSection",
    "PipelineSection",
    "ProbesSection",
    "ServeCheckSection",
    "ServerSection",
    "TokenizerSection",
    "TrackingSection",
    "TrainSection",
    "check_attention_windows",
    "check_project_paths",
    "config_from_dict",
    "default_params",
    "init_model_config",
    "knob",
    "knob_docs",
    "project_path_knobs",
    "resolve_model_config",
    "width_ladder",
    "yaml_key",
]
