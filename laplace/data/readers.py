"""Reading a corpus lazily, one slice at a time: the units of input (files, rows of a saved
dataset, shards of a hub dataset), their assignment to slices, and the documents of a unit.

Nothing here holds more than one document (or one batch of records) in memory: a worker
owns a slice and streams it. A slice is the unit of parallel work and of reuse: local files
go to slice `hash(relative path) % data.slices`, so adding or changing a file changes only
its own slice's shards; a saved dataset is cut into row ranges and a hub dataset into its
own file shards (`datasets`' sharded streaming). Each kind of input has its reader: text files
(laplace.data.text_files), record files (record_files), `datasets` corpora (hub).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import stat
from collections.abc import Iterator
from pathlib import Path

from laplace.config import DataSection
from laplace.data.hub import hub_texts, hub_units, is_saved_dataset, saved_texts
from laplace.data.long_records import LongText, string_lines
from laplace.data.pydocs import python_docs_documents
from laplace.data.record_files import json_texts, jsonl_texts, parquet_texts
from laplace.data.text_files import file_digest, file_problem, lines_as_documents, record_pieces, text_documents
from laplace.data.units import BadInput, SliceStats, Unit
from laplace.errors import DataError, one_line

log = logging.getLogger(__name__)

# One record per line (also gzipped) or a JSON array (.json), Apache Parquet; every other file is text.
RECORD_SUFFIXES = {".jsonl": "jsonl", ".ndjson": "jsonl", ".json": "json", ".parquet": "parquet"}
GZIP_SUFFIXES = {".jsonl.gz": "jsonl-gz", ".ndjson.gz": "jsonl-gz"}
SPLITTABLE = ("text", "jsonl")  # kinds read by byte ranges (a large file is several units)


# --------------------------------------------------------------------------- units and slices


def stable_hash(*parts: str | bytes, size: int = 8) -> int:
    h = hashlib.blake2b(digest_size=size)
    for part in parts:
        h.update(part if isinstance(part, bytes) else part.encode("utf-8"))
        h.update(b"\0")
    return int.from_bytes(h.digest(), "little")


def corpus_units(data: DataSection) -> list[Unit]:
    """Every unit of the corpus, in a fixed order (see the module docstring)."""
    if data.source == "hub":
        return hub_units(data)
    root = Path(data.path)
    if data.source == "python-docs" and not root.exists():
        # The corpus stage writes these same documents to data.path as 00000.txt, 00001.txt, ...
        # (`write_python_docs`); reading them straight from the install gives identical shards.
        return [Unit(_python_docs_name(i), "python-docs", str(i)) for i in range(len(python_docs_documents()))]
    if not root.exists():
        raise DataError(f"data.path: {root} does not exist (a corpus directory or file)")
    if root.is_dir() and is_saved_dataset(root):
        return [Unit(f"rows-{i:05d}", "saved", str(root), i, data.slices) for i in range(data.slices)]
    files = [(root.name, root)] if root.is_file() else sorted(_walk(root))
    files = [(name, path) for name, path in files if _regular(path)]
    if not files:
        raise DataError(f"data.path: {root} holds no files")
    units = []
    for name, path in files:
        kind = file_kind(path)
        size = path.stat().st_size
        parts = min(data.slices, -(-size // data.split_bytes)) if kind in SPLITTABLE else 1
        if parts <= 1:
            units.append(Unit(name, kind, str(path)))
            continue
        for part in range(parts):  # the ranges depend on the size and the knobs only, never num_proc
            start, stop = size * part // parts, size * (part + 1) // parts
            units.append(Unit(f"{name}#{part:04d}", kind, str(path), part, parts, start, stop))
    return units


def file_kind(path: Path) -> str:
    name = path.name.lower()
    for suffix, kind in GZIP_SUFFIXES.items():
        if name.endswith(suffix):
            return kind
    return RECORD_SUFFIXES.get(path.suffix.lower(), "text")


def _walk(root: Path) -> Iterator[tuple[str, Path]]:
    """(relative name, path) of every file under root, symlinks followed once: a directory link that
    leads back to a directory above it is a loop, an error naming it (os.walk would go round it)."""

    def visit(directory: Path, ancestors: frozenset) -> Iterator[tuple[str, Path]]:
        try:
            entries = sorted(os.scandir(directory), key=lambda e: e.name)
        except OSError as exc:
            log.warning("skipped %s: unreadable directory (%s)", directory, one_line(exc))
            return
        for entry in entries:
            if entry.name.startswith("."):  # .gitignore, .DS_Store, editor swap files, .dvc
                continue
            path = Path(entry.path)
            if entry.is_dir(follow_symlinks=True):
                real = os.path.realpath(path)
                if real in ancestors:
                    raise DataError(f"data.path: {path} is a symlink loop (it leads back to {real})")
                yield from visit(path, ancestors | {real})
            else:
                yield path.relative_to(root).as_posix(), path

    yield from visit(root, frozenset({os.path.realpath(root)}))


def _regular(path: Path) -> bool:
    """A regular file (after links); a FIFO, socket or device is skipped with a warning (reading a
    FIFO would block the stage), and so is a dangling link."""
    try:
        mode = path.stat().st_mode
    except OSError as exc:
        log.warning("skipped %s: %s", path, one_line(exc))
        return False
    if not stat.S_ISREG(mode):
        log.warning("skipped %s: not a regular file (a FIFO, socket or device)", path)
        return False
    return True


def slice_of(unit: Unit, slices: int) -> int:
    if unit.kind in ("saved", "hub"):
        return unit.part % slices
    if unit.parts > 1:  # a large file's parts go to consecutive slices: every worker gets some
        return (stable_hash(unit.name.rsplit("#", 1)[0]) + unit.part) % slices
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


# --------------------------------------------------------------------------- a unit's fingerprint and documents


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
    try:
        digest = file_digest(unit)
    except OSError as exc:
        return "unreadable", f"unreadable ({one_line(exc)})"
    return digest, file_problem(unit) if unit.kind == "text" else ""


def _records(unit: Unit, data: DataSection) -> Iterator[str | None | BadInput]:
    if unit.kind == "hub":
        yield from hub_texts(unit, data)
    elif unit.kind == "saved":
        yield from saved_texts(unit, data)
    elif unit.kind in ("jsonl", "jsonl-gz"):
        yield from jsonl_texts(unit, data.text_field, data.max_record_bytes)
    elif unit.kind == "json":
        yield from json_texts(Path(unit.location), data.text_field, data.max_record_bytes)
    elif unit.kind == "parquet":
        yield from parquet_texts(Path(unit.location), data.text_field)
    else:
        raise ValueError(f"unknown unit kind {unit.kind!r}")


def unit_texts(unit: Unit, data: DataSection, problem: str = "") -> Iterator[str | None | BadInput]:
    """The documents of one unit, in order: text, None (a null record) or BadInput (skipped).
    A record longer than data.max_document_chars comes as several documents (record_pieces)."""
    if unit.kind == "python-docs":
        yield python_docs_documents()[int(unit.location)]
    elif unit.kind == "text":
        if problem:
            yield BadInput(unit.location, problem)
        else:
            yield from text_documents(unit, data.max_document_chars)
    elif problem:  # unreadable (the survey could not hash it)
        yield BadInput(unit.location, problem)
    else:
        try:
            for record in _records(unit, data):
                if isinstance(record, LongText):  # the same documents as record_pieces of the whole text
                    if record.chars <= data.max_document_chars:
                        yield "".join(record.pieces())
                    else:
                        yield from lines_as_documents(
                            string_lines(record.pieces(), data.max_document_chars), data.max_document_chars
                        )
                elif isinstance(record, str) and len(record) > data.max_document_chars:
                    yield from record_pieces(record, data.max_document_chars)
                else:
                    yield record
        except (PermissionError, IsADirectoryError, FileNotFoundError) as exc:  # gone or closed since the survey
            yield BadInput(unit.location, f"unreadable ({one_line(exc)})")


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
                if text.too_large:
                    stats.too_large += 1
                else:
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
