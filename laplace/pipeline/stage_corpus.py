"""The corpus stage: the default python-docs corpus -> data/python-docs/ (one document per file),
so that the tokenize stage depends on a corpus directory DVC tracks, as it does on a user's own.

Processes: all of it runs in the `laplace corpus` process."""

from __future__ import annotations

from laplace.config import Config
from laplace.data.readers import write_python_docs
from laplace.pipeline.layout import Paths, write_metrics


def run(cfg: Config, paths: Paths) -> dict:
    documents = write_python_docs(paths.python_docs_dir)
    return write_metrics(paths, "corpus", {"python_docs_documents": documents})
