"""The tokenize stage: the corpus -> data/tokenized/ (tokenizer, token shards, manifest)."""

from __future__ import annotations

from laplace.config import Config
from laplace.data.tokenize import tokenize_corpus
from laplace.pipeline.layout import Paths, write_metrics


def run(cfg: Config, paths: Paths) -> dict:
    metrics = tokenize_corpus(cfg.data, cfg.tokenizer, paths.data_dir, cfg.seed)
    return write_metrics(paths, "tokenize", metrics)
