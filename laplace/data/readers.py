"""Reading a corpus into a datasets.Dataset of documents: python-docs, a hub dataset, local files."""

from __future__ import annotations

import glob
import os
import platform
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from tqdm.auto import tqdm

from laplace.config import DataSection
from laplace.data.pydocs import python_docs_documents
from laplace.errors import DataError, one_line

if TYPE_CHECKING:  # datasets is imported lazily: training only needs the shards
    import datasets

TEXT_SUFFIXES = (".txt",)
RECORD_SUFFIXES = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}


@dataclass
class _Corpus:
    dataset: datasets.Dataset
    undecodable: int  # records dropped because they were not valid UTF-8
    description: str


def load_corpus(data: DataSection) -> datasets.Dataset:
    """The corpus as a datasets.Dataset with a "text" column, capped at data.max_documents.

    Records that are not valid UTF-8 (source "files") are left out; tokenize_corpus counts them.
    """
    return _read_corpus(data).dataset


def _read_corpus(data: DataSection) -> _Corpus:
    import datasets

    if data.source == "python-docs":
        texts = python_docs_documents()
        if data.max_documents:
            texts = texts[: data.max_documents]
        return _Corpus(
            datasets.Dataset.from_dict({"text": texts}),
            0,
            f"python-docs: Python {platform.python_version()} language reference topics and stdlib docstrings",
        )
    if data.source == "hub":
        return _read_hub(data)
    if data.source == "files":
        return _read_files(data)
    raise DataError(f"data.source: unknown source {data.source!r} (python-docs, hub or files)")


def _is_text_feature(feature) -> bool:
    import datasets

    return isinstance(feature, datasets.Value) and feature.dtype in ("string", "large_string")


def _read_hub(data: DataSection) -> _Corpus:
    import datasets

    where = f"{data.hub_path!r}" + (f" ({data.hub_name})" if data.hub_name else "") + f" split {data.hub_split!r}"
    if data.hub_streaming and data.max_documents == 0:
        raise DataError(
            "data.hub_streaming is true but data.max_documents is 0: set data.max_documents to the number of "
            "documents to stream (or set data.hub_streaming: false to download the whole dataset)"
        )
    try:
        loaded = datasets.load_dataset(
            data.hub_path, data.hub_name or None, split=data.hub_split, streaming=data.hub_streaming
        )
    except Exception as exc:
        raise DataError(f"data.hub_path: could not load {where}: {one_line(exc)}") from exc

    if data.hub_streaming:
        texts = []
        try:
            rows = loaded.take(data.max_documents)
            for row in tqdm(rows, total=data.max_documents, desc="stream documents", unit="doc"):
                if data.text_field not in row:
                    raise DataError(
                        f"data.text_field: {where} has no field {data.text_field!r} (fields: {', '.join(row)})"
                    )
                texts.append(_checked_text(row[data.text_field], where, data.text_field))
        except DataError:
            raise
        except Exception as exc:
            raise DataError(f"data.hub_path: reading {where} failed: {one_line(exc)}") from exc
        dataset = datasets.Dataset.from_dict(
            {"text": texts}, features=datasets.Features({"text": datasets.Value("string")})
        )
        how = f"streaming, first {data.max_documents} documents"
    else:
        if data.text_field not in loaded.column_names:
            raise DataError(
                f"data.text_field: {where} has no field {data.text_field!r} (fields: {', '.join(loaded.column_names)})"
            )
        if not _is_text_feature(loaded.features[data.text_field]):
            raise DataError(
                f"data.text_field: {where} field {data.text_field!r} is not text ({loaded.features[data.text_field]})"
            )
        dataset = loaded.select_columns([data.text_field])
        if data.text_field != "text":
            dataset = dataset.rename_column(data.text_field, "text")
        if data.max_documents:
            dataset = dataset.select(range(min(data.max_documents, len(dataset))))
        how = f"first {data.max_documents} documents" if data.max_documents else "all documents"
    return _Corpus(dataset, 0, f"hub: {where}, field {data.text_field!r}, {how}")


def _checked_text(value, where: str, field: str) -> str | None:
    if value is None or isinstance(value, str):
        return value
    raise DataError(f"{where}: field {field!r} holds {type(value).__name__}, not text")


def _matched_files(patterns: list[str]) -> list[Path]:
    """Expand data.files (paths or globs, relative to the current directory), keeping order."""
    if not patterns:
        raise DataError("data.files is empty: list .txt/.jsonl/.json/.parquet files or globs (data.source=files)")
    found: dict[Path, None] = {}
    for pattern in patterns:
        matches = sorted(glob.glob(pattern, recursive=True)) if glob.has_magic(pattern) else [pattern]
        matches = [m for m in matches if os.path.exists(m)]
        if not matches:
            raise DataError(f"data.files: {pattern!r} matches no file")
        for match in matches:
            path = Path(match)
            if path.is_dir():
                raise DataError(f"data.files: {match} is a directory (use a glob such as '{match}/*.txt')")
            suffix = path.suffix.lower()
            if suffix not in TEXT_SUFFIXES and suffix not in RECORD_SUFFIXES:
                raise DataError(
                    f"data.files: {match} has unsupported type {suffix or '(none)'!r} "
                    "(use .txt, .jsonl, .json or .parquet)"
                )
            found.setdefault(path, None)
    return list(found)


def _record_texts(path: Path, text_field: str) -> Iterator[bytes | None]:
    """Raw UTF-8 bytes of `text_field` for each record of a .jsonl/.json/.parquet file (None for nulls)."""
    import datasets
    import pyarrow as pa

    builder = RECORD_SUFFIXES[path.suffix.lower()]
    if path.stat().st_size == 0:
        return
    try:
        records = datasets.load_dataset(builder, data_files=[str(path)], split="train")
    except Exception as exc:
        raise DataError(f"{path}: could not read as {builder}: {one_line(exc)}") from exc
    if text_field not in records.column_names:
        fields = ", ".join(records.column_names)
        raise DataError(f"{path}: no field {text_field!r} (data.text_field; fields: {fields})")
    feature = records.features[text_field]
    is_binary = getattr(feature, "dtype", None) in ("binary", "large_binary")
    if not (_is_text_feature(feature) or is_binary):
        raise DataError(f"{path}: field {text_field!r} is not text ({feature})")
    # Read the raw bytes: arrow does not validate UTF-8 in json input, so decode strictly ourselves.
    column = records.data.column(text_field).cast(pa.large_binary())
    for chunk in column.chunks:
        yield from chunk.to_pylist()


def _read_files(data: DataSection) -> _Corpus:
    import datasets

    paths = _matched_files(list(data.files))
    texts: list[str | None] = []
    undecodable = 0
    limit = data.max_documents or None

    def room() -> bool:
        return limit is None or len(texts) + undecodable < limit

    for path in paths:
        if not room():
            break
        if path.suffix.lower() in TEXT_SUFFIXES:
            raw_records: Iterable[bytes | None] = [path.read_bytes()]
        else:
            raw_records = _record_texts(path, data.text_field)
        for raw in raw_records:
            if not room():
                break
            if raw is None:
                texts.append(None)
                continue
            try:
                texts.append(raw.decode("utf-8", errors="strict"))
            except UnicodeDecodeError:
                undecodable += 1
    dataset = datasets.Dataset.from_dict(
        {"text": texts}, features=datasets.Features({"text": datasets.Value("string")})
    )
    names = ", ".join(data.files)
    cap = f", first {data.max_documents} documents" if data.max_documents else ""
    return _Corpus(dataset, undecodable, f"files: {names} ({len(paths)} files{cap})")
