"""Reading a corpus lazily, one slice at a time: the units of input (files, rows of a saved
dataset, shards of a hub dataset), their assignment to slices, and the documents of a unit.

Nothing here holds more than one document (or one batch of records) in memory: a worker
owns a slice and streams it. A slice is the unit of parallel work and of reuse: local files
go to slice `hash(relative path) % data.slices`, so adding or changing a file changes only
its own slice's shards; a saved dataset is cut into row ranges and a hub dataset into its
own file shards (`datasets`' sharded streaming).
"""

from __future__ import annotations

import codecs
import hashlib
import json
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from laplace.config import DataSection
from laplace.data.pydocs import python_docs_documents
from laplace.errors import DataError, one_line

log = logging.getLogger(__name__)

# One record per line or a JSON array (.json), Apache Parquet; every other file is read as text.
RECORD_SUFFIXES = {".jsonl": "jsonl", ".json": "json", ".parquet": "parquet"}
_BLOCK = 1 << 20  # bytes read at a time when hashing or validating a file
_RECORD_BATCH = 1024  # Parquet / dataset rows read at a time


class BadInput(Exception):
    """A file or record that is not text (undecodable, binary, unreadable): `where` names it."""

    def __init__(self, where: str, why: str):
        super().__init__(f"{where}: {why}")
        self.where, self.why = where, why


@dataclass(frozen=True)
class Unit:
    """One piece of input a worker reads whole: a file, a row range of a saved dataset, a hub shard."""

    name: str  # stable and unique: the path relative to data.path, or "rows-00003", "shard-00012"
    kind: str  # text | jsonl | json | parquet | saved | hub | python-docs
    location: str  # the file, the dataset directory, the hub path, or the python-docs index
    part: int = 0  # saved / hub: which of `parts`
    parts: int = 1


@dataclass
class SliceStats:
    """What a slice's reader saw: documents read and skipped, and the bad input it left out."""

    read: int = 0
    empty: int = 0
    too_short: int = 0
    undecodable: int = 0
    bad: list[str] = field(default_factory=list)  # "where: why", one per skipped file or record

    def merge(self, other: SliceStats) -> None:
        self.read += other.read
        self.empty += other.empty
        self.too_short += other.too_short
        self.undecodable += other.undecodable
        self.bad.extend(other.bad)


# --------------------------------------------------------------------------- units and slices


def stable_hash(*parts: str | bytes, size: int = 8) -> int:
    h = hashlib.blake2b(digest_size=size)
    for part in parts:
        h.update(part if isinstance(part, bytes) else part.encode("utf-8"))
        h.update(b"\0")
    return int.from_bytes(h.digest(), "little")


def is_saved_dataset(path: Path) -> bool:
    """A `datasets` save_to_disk directory (a Dataset or a DatasetDict)."""
    return (path / "state.json").is_file() or (path / "dataset_dict.json").is_file()


def corpus_units(data: DataSection) -> list[Unit]:
    """Every unit of the corpus, in a fixed order (see the module docstring)."""
    if data.source == "hub":
        return _hub_units(data)
    root = Path(data.path)
    if data.source == "python-docs" and not root.exists():
        # The corpus stage writes these same documents to data.path as 00000.txt, 00001.txt, ...
        # (`write_python_docs`); reading them straight from the install gives identical shards.
        return [Unit(_python_docs_name(i), "python-docs", str(i)) for i in range(len(python_docs_documents()))]
    if not root.exists():
        raise DataError(f"data.path: {root} does not exist (a corpus directory or file)")
    if root.is_dir() and is_saved_dataset(root):
        return [Unit(f"rows-{i:05d}", "saved", str(root), i, data.slices) for i in range(data.slices)]
    if root.is_file():
        files = [(root.name, root)]
    else:
        files = []
        for dirpath, dirnames, filenames in os.walk(root, followlinks=True):
            dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
            for name in filenames:
                if not name.startswith("."):  # .gitignore, .DS_Store, editor swap files
                    path = Path(dirpath, name)
                    files.append((path.relative_to(root).as_posix(), path))
        files.sort()
    if not files:
        raise DataError(f"data.path: {root} holds no files")
    return [Unit(name, RECORD_SUFFIXES.get(path.suffix.lower(), "text"), str(path)) for name, path in files]


def slice_of(unit: Unit, slices: int) -> int:
    if unit.kind in ("saved", "hub"):
        return unit.part % slices
    return stable_hash(unit.name) % slices


def plan_slices(units: list[Unit], slices: int) -> list[list[Unit]]:
    """units grouped by slice, each slice in name order (some may be empty)."""
    grouped: list[list[Unit]] = [[] for _ in range(slices)]
    for unit in units:
        grouped[slice_of(unit, slices)].append(unit)
    return [sorted(g, key=lambda u: u.name) for g in grouped]


def _python_docs_name(index: int) -> str:
    return f"{index:05d}.txt"


def write_python_docs(directory: Path) -> int:
    """The python-docs corpus as files (one document each), as `data.source: files` reads them."""
    documents = python_docs_documents()
    directory.mkdir(parents=True, exist_ok=True)
    wanted = {_python_docs_name(i) for i in range(len(documents))}
    for stale in directory.iterdir():
        if stale.name not in wanted:
            stale.unlink()
    for i, text in enumerate(documents):
        path = directory / _python_docs_name(i)
        raw = text.encode("utf-8")
        if not path.is_file() or path.read_bytes() != raw:  # unchanged files keep their mtime (DVC's state)
            path.write_bytes(raw)  # no fsync per file: a killed write is redone by the next run
    return len(documents)


# --------------------------------------------------------------------------- hub and saved datasets


def _hub_where(data: DataSection) -> str:
    return f"{data.hub_path!r}" + (f" ({data.hub_name})" if data.hub_name else "") + f" split {data.hub_split!r}"


def _load_hub(data: DataSection):
    """The hub dataset (or a local dataset directory) as a streaming IterableDataset."""
    import datasets

    local = os.path.isdir(data.hub_path)
    if local and is_saved_dataset(Path(data.hub_path)):
        loaded = datasets.load_from_disk(data.hub_path)
        if isinstance(loaded, datasets.DatasetDict):
            if data.hub_split not in loaded:
                raise DataError(
                    f"data.hub_split: {data.hub_path} has no split {data.hub_split!r} ({', '.join(loaded)})"
                )
            loaded = loaded[data.hub_split]
        return loaded.to_iterable_dataset(num_shards=max(1, min(data.slices, len(loaded))))
    try:
        return datasets.load_dataset(data.hub_path, data.hub_name or None, split=data.hub_split, streaming=True)
    except Exception as exc:
        if local and data.hub_name:
            # A local folder of JSONL/Parquet files has no configurations: the default hub_name is
            # ignored for it (a local copy of a hub repository with configurations still uses it).
            try:
                return datasets.load_dataset(data.hub_path, None, split=data.hub_split, streaming=True)
            except Exception:
                pass
        raise DataError(f"data.hub_path: could not load {_hub_where(data)}: {one_line(exc)}") from exc


def _hub_units(data: DataSection) -> list[Unit]:
    shards = _load_hub(data).num_shards
    parts = max(1, min(data.slices, shards))
    return [Unit(f"shard-{i:05d}", "hub", data.hub_path, i, parts) for i in range(parts)]


def _checked_record(value, where: str, field_name: str) -> str | None:
    if value is None or isinstance(value, str):
        return value
    raise DataError(f"{where}: field {field_name!r} holds {type(value).__name__}, not text (data.text_field)")


def _hub_texts(unit: Unit, data: DataSection) -> Iterator[str | None]:
    stream = _load_hub(data).shard(num_shards=unit.parts, index=unit.part)
    where = f"{_hub_where(data)} {unit.name}"
    try:
        for row in stream:
            if data.text_field not in row:
                raise DataError(f"data.text_field: {where} has no field {data.text_field!r} (fields: {', '.join(row)})")
            yield _checked_record(row[data.text_field], where, data.text_field)
    except DataError:
        raise
    except Exception as exc:
        raise DataError(f"data.hub_path: reading {where} failed: {one_line(exc)}") from exc


def _saved_texts(unit: Unit, data: DataSection) -> Iterator[str | None]:
    import datasets

    loaded = datasets.load_from_disk(unit.location)  # memory-mapped Arrow: nothing is copied
    if isinstance(loaded, datasets.DatasetDict):
        if data.hub_split not in loaded:
            raise DataError(f"data.hub_split: {unit.location} has no split {data.hub_split!r} ({', '.join(loaded)})")
        loaded = loaded[data.hub_split]
    if data.text_field not in loaded.column_names:
        fields = ", ".join(loaded.column_names)
        raise DataError(f"{unit.location}: no field {data.text_field!r} (data.text_field; fields: {fields})")
    start, stop = len(loaded) * unit.part // unit.parts, len(loaded) * (unit.part + 1) // unit.parts
    column = loaded.select_columns([data.text_field])
    for begin in range(start, stop, _RECORD_BATCH):
        rows = column[begin : min(begin + _RECORD_BATCH, stop)][data.text_field]
        for value in rows:
            yield _checked_record(value, unit.location, data.text_field)


# --------------------------------------------------------------------------- files


def file_problem(path: Path) -> str:
    """ "" for a UTF-8 text file, else why not (binary or undecodable, with the byte offset)."""
    decoder = codecs.getincrementaldecoder("utf-8")("strict")
    offset = 0
    try:
        with open(path, "rb") as f:
            while block := f.read(_BLOCK):
                if (nul := block.find(b"\0")) >= 0:
                    return f"binary (a NUL byte at offset {offset + nul})"
                try:
                    decoder.decode(block)
                except UnicodeDecodeError as exc:
                    return f"not valid UTF-8 (byte {offset + exc.start})"
                offset += len(block)
            decoder.decode(b"", final=True)
    except UnicodeDecodeError as exc:
        return f"not valid UTF-8 (truncated character at byte {offset + exc.start})"
    except OSError as exc:
        return f"unreadable ({one_line(exc)})"
    return ""


def file_digest(path: Path) -> str:
    h = hashlib.blake2b(digest_size=16)
    with open(path, "rb") as f:
        while block := f.read(_BLOCK):
            h.update(block)
    return h.hexdigest()


def _text_documents(path: Path, max_chars: int) -> Iterator[str]:
    """A text file as documents: whole when it is short, else cut at blank lines into pieces of
    at most max_chars (a paragraph longer than that at line ends, a line longer than that anywhere)."""
    if path.stat().st_size <= max_chars:  # bytes >= characters
        yield path.read_bytes().decode("utf-8")  # no newline translation: the bytes as they are
        return
    pending: list[str] = []
    size = 0
    with open(path, encoding="utf-8", errors="strict", newline="") as f:
        while line := f.readline(max_chars):
            blank = not line.strip()
            if size + len(line) > max_chars or (blank and size >= max_chars // 2):
                if pending:
                    yield "".join(pending)
                pending, size = [], 0
            pending.append(line)
            size += len(line)
    if pending:
        yield "".join(pending)


def _jsonl_texts(path: Path, text_field: str) -> Iterator[str | None | BadInput]:
    with open(path, "rb") as f:
        for number, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            where = f"{path}:{number}"
            try:
                record = json.loads(raw)  # bytes: decoded as strict UTF-8
            except UnicodeDecodeError as exc:
                yield BadInput(where, f"not valid UTF-8 ({exc.reason} at byte {exc.start})")
                continue
            except ValueError as exc:
                yield BadInput(where, f"not a JSON record ({one_line(exc)})")
                continue
            if not isinstance(record, dict):
                yield BadInput(where, f"a JSON {type(record).__name__}, not an object")
                continue
            if text_field not in record:
                raise DataError(f"{where}: no field {text_field!r} (data.text_field; fields: {', '.join(record)})")
            yield _checked_record(record[text_field], where, text_field)


def _json_texts(path: Path, text_field: str) -> Iterator[str | None | BadInput]:
    with open(path, "rb") as f:
        head = f.read(64).lstrip()
    if not head.startswith(b"["):
        yield from _jsonl_texts(path, text_field)
        return
    try:  # a JSON array is parsed whole: keep large corpora in JSON Lines or Parquet
        records = json.loads(path.read_bytes())
    except (UnicodeDecodeError, ValueError) as exc:
        yield BadInput(str(path), f"not valid JSON ({one_line(exc)})")
        return
    for i, record in enumerate(records):
        where = f"{path}[{i}]"
        if not isinstance(record, dict) or text_field not in record:
            raise DataError(f"{where}: no field {text_field!r} (data.text_field)")
        yield _checked_record(record[text_field], where, text_field)


def _parquet_texts(path: Path, text_field: str) -> Iterator[str | None | BadInput]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        parquet = pq.ParquetFile(path)
    except Exception as exc:
        yield BadInput(str(path), f"not a Parquet file ({one_line(exc)})")
        return
    names = parquet.schema_arrow.names
    if text_field not in names:
        raise DataError(f"{path}: no field {text_field!r} (data.text_field; fields: {', '.join(names)})")
    kind = parquet.schema_arrow.field(text_field).type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
        raise DataError(f"{path}: field {text_field!r} is not text ({kind})")
    for batch in parquet.iter_batches(batch_size=_RECORD_BATCH, columns=[text_field]):
        yield from batch.column(0).to_pylist()


def unit_fingerprint(unit: Unit, data: DataSection) -> tuple[str, str]:
    """(content digest, problem): what identifies the unit's input, and why a text file is bad ("" if not)."""
    if unit.kind == "python-docs":
        return hashlib.blake2b(python_docs_documents()[int(unit.location)].encode(), digest_size=16).hexdigest(), ""
    if unit.kind == "hub":
        # A hub dataset is named, not hashed: pin a revision in hub_path to make it immutable.
        return f"{data.hub_path}|{data.hub_name}|{data.hub_split}|{unit.part}/{unit.parts}", ""
    if unit.kind == "saved":
        state = json.loads((Path(unit.location) / "state.json").read_text()) if unit.location else {}
        return f"{state.get('_fingerprint', unit.location)}|{unit.part}/{unit.parts}", ""
    path = Path(unit.location)
    try:
        digest = file_digest(path)
    except OSError as exc:
        return "unreadable", f"unreadable ({one_line(exc)})"
    return digest, file_problem(path) if unit.kind == "text" else ""


def unit_texts(unit: Unit, data: DataSection, problem: str = "") -> Iterator[str | None | BadInput]:
    """The documents of one unit, in order: text, None (a null record) or BadInput (skipped)."""
    if unit.kind == "python-docs":
        yield python_docs_documents()[int(unit.location)]
    elif unit.kind == "hub":
        yield from _hub_texts(unit, data)
    elif unit.kind == "saved":
        yield from _saved_texts(unit, data)
    elif unit.kind == "text":
        if problem:
            yield BadInput(unit.location, problem)
        else:
            yield from _text_documents(Path(unit.location), data.max_document_chars)
    elif unit.kind == "jsonl":
        yield from _jsonl_texts(Path(unit.location), data.text_field)
    elif unit.kind == "json":
        yield from _json_texts(Path(unit.location), data.text_field)
    elif unit.kind == "parquet":
        yield from _parquet_texts(Path(unit.location), data.text_field)
    else:
        raise ValueError(f"unknown unit kind {unit.kind!r}")


def slice_documents(
    units: list[Unit], problems: dict[str, str], data: DataSection, quota: int, stats: SliceStats
) -> Iterator[str]:
    """The usable documents of a slice in order (at most `quota` read when quota > 0), counting
    what is skipped in `stats`. Bad input is skipped and listed, or a DataError (data.on_bad_file)."""
    for unit in units:
        for text in unit_texts(unit, data, problems.get(unit.name, "")):
            if isinstance(text, BadInput):
                if data.on_bad_file == "error":
                    raise DataError(f"{text} (data.on_bad_file: error; set it to skip to leave such input out)")
                stats.undecodable += 1
                stats.bad.append(str(text))
                continue
            if quota and stats.read >= quota:
                return
            stats.read += 1
            stripped = len(text.strip()) if text else 0
            if stripped == 0:
                stats.empty += 1
            elif stripped < data.min_chars:
                stats.too_short += 1
            else:
                yield text


def iter_documents(data: DataSection) -> Iterator[str]:
    """Every usable document of the corpus, slice by slice, in one process (for inspection and tests)."""
    for units in plan_slices(corpus_units(data), data.slices):
        problems = {u.name: unit_fingerprint(u, data)[1] for u in units}
        yield from slice_documents(units, problems, data, 0, SliceStats())
