"""The tokenize stage: the corpus -> data/tokenized/ (tokenizer, token shards, manifest).

Processes: the stage runs in the `laplace tokenize` process; laplace.data.pool surveys and
encodes the slices in data.num_proc worker processes (tokenizing is CPU-bound Python: one
process per core) and trains the tokenizer in a child of its own (killable at once); they run
library code only, not this module."""

from __future__ import annotations

import logging

from laplace.config import Config
from laplace.data.tokenize import tokenize_corpus
from laplace.pipeline.layout import Paths, write_metrics

log = logging.getLogger(__name__)


def run(cfg: Config, paths: Paths) -> dict:
    paths.warn_if_untracked("tokenizer.from", cfg.tokenizer.from_, log)
    metrics = tokenize_corpus(cfg.data, cfg.tokenizer, paths.data_dir, cfg.seed)
    return write_metrics(paths, "tokenize", metrics)
