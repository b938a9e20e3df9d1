"""`data:` and `tokenizer:`, the sections of the corpus and tokenize stages (laplace/data)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from laplace.config.knobs import fraction, knob, non_negative, positive


@dataclass(frozen=True)
class DataSection:
    """`data:` the corpus and how it is cut into documents, split and sliced (corpus, tokenize)."""

    source: Literal["python-docs", "files", "hub"] = knob(
        "python-docs",
        doc="python-docs (offline default) | files (data.path) | hub (a Hugging Face dataset, streamed)",
    )
    path: str = knob(
        "data/python-docs",
        lambda v: None if v.strip() else "must name a file or directory",
        (
            "the corpus: a directory (walked, sorted) or one file; tokenize's DVC "
            "dependency (dvc.yaml). python-docs reads it when present (the corpus "
            "stage writes it), else the Python install. Your own: put it in "
            "data/raw, `dvc add data/raw`, set source: files and path: data/raw"
        ),
    )
    hub_path: str = knob(
        "HuggingFaceFW/fineweb-edu", doc="a hub dataset, or a local dataset directory (save_to_disk, JSONL/Parquet)"
    )
    hub_name: str = knob("sample-10BT", doc="the hub dataset's configuration (subset)")
    hub_split: str = knob("train", doc="the split to stream")
    text_field: str = knob("text", doc="the text column of .jsonl/.json/.parquet records and datasets")
    max_documents: int = knob(0, non_negative, "0 = no cap; else shared evenly among the slices")
    max_tokens: int = knob(0, non_negative, "train tokens, 0 = no cap; else shared evenly among the slices")
    min_chars: int = knob(64, positive, "shorter documents are skipped and counted")
    max_document_chars: int = knob(
        1_000_000, positive, "longer text files and records are cut at blank lines (or at this size) into documents"
    )
    max_record_bytes: int = knob(
        512_000_000,
        positive,
        "a longer JSON line (or .json file) is skipped, named and counted; a worker holds about 2x a record",
    )
    split_bytes: int = knob(
        32_000_000, positive, "a larger .jsonl or text file is split by byte ranges (at line starts) over slices"
    )
    val_fraction: float = knob(
        0.05, fraction, doc="share of documents held out for validation (by a seeded hash of the text)"
    )
    on_bad_file: Literal["skip", "error"] = knob(
        "skip", doc="undecodable or binary input: skip (each logged by name) | error"
    )
    slices: int = knob(
        16, positive, "input slices (files hashed by path, hub shards): the unit of parallel work and of reuse"
    )
    shard_tokens: int = knob(100_000_000, positive, "tokens per shard file (the last shard of each slice is shorter)")
    num_proc: int = knob(
        2, positive, "tokenize worker processes: the local pool's, or a LocalCluster's (executor: dask, no address)"
    )
    executor: Literal["local", "dask"] = knob(
        "local",
        doc="where tokenize's slices run (survey, sample, encode): local (a process pool) | dask (a Dask cluster; "
        "every worker must see the project directory)",
    )
    dask_address: str = knob(
        "", doc="executor: dask: a running scheduler (tcp://HOST:8786); empty = a LocalCluster of data.num_proc workers"
    )
    dask_in_flight: int = knob(
        256, positive, "executor: dask: slices submitted to the scheduler at a time (its memory stays bounded)"
    )


@dataclass(frozen=True)
class TokenizerSection:
    """`tokenizer:` the byte-level BPE (tokenize)."""

    vocab_size: int = knob(
        4096,
        lambda v: None if v >= 260 else "must be >= 260 (256 bytes + specials)",
        doc="a size the sample cannot reach is an error naming the size it reached",
    )
    min_frequency: int = knob(2, positive, doc="BPE merges seen fewer times are dropped")
    sample_bytes: int = knob(
        100_000_000, positive, "the BPE trains on a seeded sample of at most this many bytes of train documents"
    )
    from_: str = knob(
        "",
        doc="a given tokenizer: a tokenizer.json, or a directory holding one (a `laplace import` or an export), "
        "used as is with its BOS/EOS conventions; empty = train a byte-level BPE",
        key="from",
    )
