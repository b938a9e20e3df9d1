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
import stat
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from laplace.config import DataSection
from laplace.data.long_records import LongText, NotARecord, members, string_lines, string_pieces
from laplace.data.pydocs import python_docs_documents
from laplace.errors import DataError, Failure, one_line

log = logging.getLogger(__name__)

# One record per line (also gzipped) or a JSON array (.json), Apache Parquet; every other file is text.
RECORD_SUFFIXES = {".jsonl": "jsonl", ".ndjson": "jsonl", ".json": "json", ".parquet": "parquet"}
GZIP_SUFFIXES = {".jsonl.gz": "jsonl-gz", ".ndjson.gz": "jsonl-gz"}
SPLITTABLE = ("text", "jsonl")  # kinds read by byte ranges (a large file is several units)
_BLOCK = 1 << 20  # bytes read at a time when hashing or validating a file
_RECORD_BATCH = 1024  # Parquet / dataset rows read at a time
# A longer JSON line is parsed from its bytes a piece at a time (long_records): json.loads would hold
# it decoded twice beside its bytes (~8x the record with one non-Latin-1 character)
_STREAM_RECORD_BYTES = 1 << 23


class BadInput(Exception):
    """A file or record that is not text (undecodable, binary, unreadable): `where` names it."""

    def __init__(self, where: str, why: str, too_large: bool = False):
        super().__init__(f"{where}: {why}")
        self.where, self.why, self.too_large = where, why, too_large


@dataclass(frozen=True)
class Unit:
    """One piece of input a worker reads whole: a file, a row range of a saved dataset, a hub shard."""

    name: str  # stable and unique: the path relative to data.path, or "rows-00003", "shard-00012"
    kind: str  # text | jsonl | json | parquet | saved | hub | python-docs
    location: str  # the file, the dataset directory, the hub path, or the python-docs index
    part: int = 0  # saved / hub / a large file: which of `parts`
    parts: int = 1
    start: int = 0  # a file's byte range [start, stop), each end moved to the next line start
    stop: int = -1  # -1: to the end


@dataclass
class SliceStats:
    """What a slice's reader saw: documents read and skipped, and the bad input it left out."""

    read: int = 0
    empty: int = 0
    too_short: int = 0
    undecodable: int = 0
    too_large: int = 0  # records over data.max_record_bytes (also named in `bad`)
    bad: list[str] = field(default_factory=list)  # "where: why", one per skipped file or record

    def merge(self, other: SliceStats) -> None:
        self.read += other.read
        self.empty += other.empty
        self.too_short += other.too_short
        self.undecodable += other.undecodable
        self.too_large += other.too_large
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
        _raise_if_network(exc, f"could not load {_hub_where(data)}")
        raise DataError(f"data.hub_path: could not load {_hub_where(data)}: {one_line(exc)}") from exc


class HubUnreachable(Failure):
    """The hub (or the network to it) failed: not the input's fault, so a crash the flow retries."""


# transport errors of the clients under `datasets` (requests, urllib3, httpx, aiohttp), by name so
# that none of them has to be imported here
_NETWORK_ERRORS = {
    "ConnectError", "ConnectTimeout", "ReadTimeout", "WriteTimeout", "PoolTimeout", "RemoteProtocolError",
    "Timeout", "ReadTimeoutError", "MaxRetryError", "NewConnectionError", "ProtocolError", "ClientConnectorError",
    "ServerDisconnectedError", "OfflineModeIsEnabled",
}  # fmt: skip


def _raise_if_network(exc: BaseException, what: str) -> None:
    seen = exc
    while seen is not None:
        names = {k.__name__ for k in type(seen).__mro__}
        if isinstance(seen, (ConnectionError, TimeoutError)) or names & _NETWORK_ERRORS:
            raise HubUnreachable(f"data.hub_path: {what}: the hub is unreachable ({one_line(seen)}); retry") from exc
        seen = seen.__cause__ or seen.__context__


def _hub_units(data: DataSection) -> list[Unit]:
    shards = _load_hub(data).num_shards
    parts = max(1, min(data.slices, shards))
    return [Unit(f"shard-{i:05d}", "hub", data.hub_path, i, parts) for i in range(parts)]


def _valid_text(value) -> bool:
    """False for a string that is not valid Unicode text (a lone surrogate, as JSON's "\\ud800" gives)."""
    if not isinstance(value, str) or value.isascii():
        return True
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _checked_record(value, where: str, field_name: str) -> str | None | BadInput:
    if value is None:
        return value
    if isinstance(value, str):
        if not _valid_text(value):
            return BadInput(where, "not valid Unicode text (a lone surrogate such as \\ud800)")
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
        _raise_if_network(exc, f"reading {where} failed")
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


def _line_start(f, pos: int, size: int) -> int:
    """The first line start at or after byte `pos` (0 and the end are their own)."""
    if pos <= 0 or pos >= size:
        return max(0, min(pos, size))
    f.seek(pos - 1)
    offset = pos - 1
    while block := f.read(_BLOCK):
        if (newline := block.find(b"\n")) >= 0:
            return offset + newline + 1
        offset += len(block)
    return size


def byte_range(unit: Unit, f) -> tuple[int, int]:
    """The unit's bytes in its file: [start, stop) moved to line starts, so that a line belongs to
    exactly one of a file's parts (the part where it starts)."""
    size = os.fstat(f.fileno()).st_size
    if unit.parts <= 1:
        return 0, size
    stop = size if unit.stop < 0 else unit.stop
    return _line_start(f, unit.start, size), _line_start(f, stop, size)


def _range_blocks(unit: Unit) -> Iterator[bytes]:
    with open(unit.location, "rb") as f:
        start, stop = byte_range(unit, f)
        f.seek(start)
        while start < stop and (block := f.read(min(_BLOCK, stop - start))):
            start += len(block)
            yield block


def file_problem(unit: Unit) -> str:
    """ "" for UTF-8 text, else why not (binary or undecodable, with the byte offset in the file)."""
    decoder = codecs.getincrementaldecoder("utf-8")("strict")
    offset = unit.start if unit.parts > 1 else 0  # approximate for a part: its nominal start
    try:
        for block in _range_blocks(unit):
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


def file_digest(unit: Unit) -> str:
    """The digest of the unit's bytes (its range of the file): a change elsewhere leaves it alone."""
    h = hashlib.blake2b(digest_size=16)
    for block in _range_blocks(unit):
        h.update(block)
    return h.hexdigest()


def _lines(unit: Unit, limit: int) -> Iterator[bytes]:
    """The unit's lines as bytes, each at most `limit` bytes (a longer line comes in pieces)."""
    with open(unit.location, "rb") as f:
        start, stop = byte_range(unit, f)
        f.seek(start)
        while start < stop and (line := f.readline(min(limit, stop - start))):
            start += len(line)
            yield line


def _cut(lines: Iterator[str], max_chars: int) -> Iterator[str]:
    """Lines of at most max_chars as documents of at most max_chars, cut at blank lines (a
    paragraph longer than that at line ends)."""
    pending: list[str] = []
    size = 0
    for line in lines:
        blank = not line.strip()
        if size + len(line) > max_chars or (blank and size >= max_chars // 2):
            if pending:
                yield "".join(pending)
            pending, size = [], 0
        pending.append(line)
        size += len(line)
    if pending:
        yield "".join(pending)


def _text_documents(unit: Unit, max_chars: int) -> Iterator[str]:
    """A text file (or a part of one) as documents: whole when it is short, else cut at blank lines
    into pieces of at most max_chars (a paragraph longer than that at line ends, a line longer than
    that anywhere). No newline translation: the bytes as they are."""
    with open(unit.location, "rb") as f:
        start, stop = byte_range(unit, f)
        if stop - start <= max_chars:  # bytes >= characters
            f.seek(start)
            yield f.read(stop - start).decode("utf-8")
            return
    decoder = codecs.getincrementaldecoder("utf-8")("strict")

    def lines() -> Iterator[str]:
        for raw in _lines(unit, max_chars):  # bytes >= characters: each piece is short enough
            if text := decoder.decode(raw):
                yield text
        if tail := decoder.decode(b"", final=True):
            yield tail

    yield from _cut(lines(), max_chars)


def _string_lines(text: str, max_chars: int) -> Iterator[str]:
    """text's lines, a line longer than max_chars cut at its last space within the limit (else at it)."""
    pos, n = 0, len(text)
    while pos < n:
        newline = text.find("\n", pos, pos + max_chars)
        if newline >= 0:
            end = newline + 1
        elif n - pos <= max_chars:
            end = n
        else:
            end = pos + max_chars
            space = text.rfind(" ", pos + max_chars // 2, end)
            end = space + 1 if space > pos else end
        yield text[pos:end]
        pos = end


def record_pieces(text: str, max_chars: int) -> Iterator[str]:
    """A record's text as documents of at most max_chars, cut as text files are (so a 200 MB record
    is encoded a bounded piece at a time, never whole)."""
    if len(text) <= max_chars:
        yield text
    else:
        yield from _cut(_string_lines(text, max_chars), max_chars)


def _read_line(f, max_bytes: int, limit: int = 1 << 20) -> tuple[bytearray, int]:
    """One line, grown in place (BufferedReader.readline joins the pieces of a long line: 2x its
    size), and its size; a line over max_bytes is read to its end but not kept (empty)."""
    line, size = bytearray(), 0
    while piece := f.readline(limit):
        size += len(piece)
        if size <= max_bytes:
            line += piece
        elif line:
            line = bytearray()  # let go: the record is skipped
        if piece.endswith(b"\n"):
            break
    return line, size


def _too_large(where: str, size: int, max_bytes: int) -> BadInput:
    return BadInput(where, f"a record of {size:,} bytes, over data.max_record_bytes={max_bytes:,}", too_large=True)


def _long_record(raw: bytearray, where: str, text_field: str):
    """A long JSON line (see _STREAM_RECORD_BYTES): its text as a LongText checked piece by piece,
    None, or a BadInput; the same verdicts json.loads would give."""
    try:
        found = members(raw)
        others = [(key, start, end) for key, start, end in found if key != text_field]
        for _, start, end in others:  # the other members parsed alone (small), as json.loads would
            json.loads(bytes(raw[start:end]))
    except UnicodeDecodeError as exc:
        return BadInput(where, f"not valid UTF-8 ({exc.reason})")
    except (NotARecord, ValueError) as exc:
        return BadInput(where, f"not a JSON record ({one_line(exc)})")
    except RecursionError:
        return BadInput(where, "not a JSON record (nested too deeply to parse)")
    text = [(start, end) for key, start, end in found if key == text_field]
    if not text:
        fields = ", ".join(key for key, *_ in found)
        raise DataError(f"{where}: no field {text_field!r} (data.text_field; fields: {fields})")
    start, end = text[-1]  # the last one wins, as in json.loads
    if raw[start] != ord('"'):
        return _checked_record(json.loads(bytes(raw[start:end])), where, text_field)
    chars = 0
    try:
        for piece in string_pieces(raw, start, end):  # checked whole before any of it is used
            if not _valid_text(piece):
                return BadInput(where, "not valid Unicode text (a lone surrogate such as \\ud800)")
            chars += len(piece)
    except UnicodeDecodeError as exc:
        return BadInput(where, f"not valid UTF-8 ({exc.reason})")
    except ValueError as exc:
        return BadInput(where, f"not a JSON record ({one_line(exc)})")
    return LongText(raw, start, end, chars)


class _Where:
    """file:line of a record in a part of a file: the lines before the part are counted only when
    a record needs naming (rare), not for every part."""

    def __init__(self, unit: Unit, start: int):
        self.unit, self.start, self._before = unit, start, None

    def __call__(self, number: int) -> str:
        if self._before is None:
            self._before = 0
            if self.start:
                with open(self.unit.location, "rb") as f:
                    left = self.start
                    while left and (block := f.read(min(_BLOCK, left))):
                        self._before += block.count(b"\n")
                        left -= len(block)
        return f"{self.unit.location}:{self._before + number}"


def _gzip_problem(exc: BaseException) -> str:
    if isinstance(exc, EOFError):
        return f"a truncated gzip file ({one_line(exc)}); the records before the cut are kept"
    return f"not a valid gzip file ({one_line(exc)})"


def _parse_record(raw: bytes | bytearray, where: str):
    """A JSON line -> the parsed value, or a BadInput saying why not (not UTF-8, not JSON, too deep)."""
    try:
        line = raw.decode("utf-8")  # strict; then the bytes are let go (a record may be huge)
        raw = None
        return json.loads(line)
    except UnicodeDecodeError as exc:
        return BadInput(where, f"not valid UTF-8 ({exc.reason} at byte {exc.start})")
    except ValueError as exc:
        return BadInput(where, f"not a JSON record ({one_line(exc)})")
    except RecursionError:  # json's C scanner recurses per nesting level (a line nested 100,000 deep)
        return BadInput(where, "not a JSON record (nested too deeply to parse)")


def _jsonl_texts(unit: Unit, text_field: str, max_bytes: int) -> Iterator[str | None | BadInput | LongText]:
    if unit.kind == "jsonl-gz":
        import gzip
        import zlib

        opened, start, stop = gzip.open(unit.location, "rb"), 0, None
        broken: tuple = (EOFError, gzip.BadGzipFile, zlib.error)
    else:
        opened = open(unit.location, "rb")
        start, stop = byte_range(unit, opened)
        opened.seek(start)
        broken = ()
    where = _Where(unit, start)
    number, pos = 0, start
    with opened as f:
        while stop is None or pos < stop:
            try:
                raw, size = _read_line(f, max_bytes)
            except broken as exc:
                yield BadInput(unit.location, _gzip_problem(exc))
                return
            if not size:
                break
            if pos == 0 and raw.startswith(codecs.BOM_UTF8):  # a UTF-8 byte order mark is not part of the record
                del raw[:3]
                pos, size = pos + 3, size - 3
            pos += size
            number += 1
            if size > max_bytes:
                yield _too_large(where(number), size, max_bytes)
                continue
            if raw.isspace():  # (not raw.strip(): a copy of the line)
                continue
            if len(raw) > _STREAM_RECORD_BYTES:
                yield _long_record(raw, where(number), text_field)
                raw = None
                continue
            record = _parse_record(raw, where(number))
            raw = None
            if isinstance(record, BadInput):
                yield record
                continue
            if not isinstance(record, dict):
                yield BadInput(where(number), f"a JSON {type(record).__name__}, not an object")
                continue
            if text_field not in record:
                fields = ", ".join(record)
                raise DataError(f"{where(number)}: no field {text_field!r} (data.text_field; fields: {fields})")
            value = record.pop(text_field)
            record = None
            if isinstance(value, str) and _valid_text(value):
                yield value
            else:
                yield _checked_record(value, where(number), text_field)


def _json_texts(path: Path, text_field: str, max_bytes: int) -> Iterator[str | None | BadInput | LongText]:
    with open(path, "rb") as f:
        head = f.read(64).removeprefix(codecs.BOM_UTF8).lstrip()
    if not head.startswith(b"["):
        yield from _jsonl_texts(Unit(path.name, "jsonl", str(path)), text_field, max_bytes)
        return
    if (size := path.stat().st_size) > max_bytes:
        yield _too_large(str(path), size, max_bytes)
        return
    # a JSON array is parsed whole: keep large corpora in JSON Lines or Parquet
    records = _parse_record(path.read_bytes().removeprefix(codecs.BOM_UTF8), str(path))
    if isinstance(records, BadInput):
        yield BadInput(str(path), records.why.replace("not a JSON record", "not valid JSON"))
        return
    if not isinstance(records, list):
        yield BadInput(str(path), f"a JSON {type(records).__name__}, not an array of records")
        return
    for i, record in enumerate(records):
        where = f"{path}[{i}]"
        if not isinstance(record, dict):  # skipped and named, as the same line in JSON Lines is
            yield BadInput(where, f"a JSON {type(record).__name__}, not an object")
            continue
        if text_field not in record:
            raise DataError(f"{where}: no field {text_field!r} (data.text_field; fields: {', '.join(record)})")
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
    try:
        digest = file_digest(unit)
    except OSError as exc:
        return "unreadable", f"unreadable ({one_line(exc)})"
    return digest, file_problem(unit) if unit.kind == "text" else ""


def _records(unit: Unit, data: DataSection) -> Iterator[str | None | BadInput]:
    if unit.kind == "hub":
        yield from _hub_texts(unit, data)
    elif unit.kind == "saved":
        yield from _saved_texts(unit, data)
    elif unit.kind in ("jsonl", "jsonl-gz"):
        yield from _jsonl_texts(unit, data.text_field, data.max_record_bytes)
    elif unit.kind == "json":
        yield from _json_texts(Path(unit.location), data.text_field, data.max_record_bytes)
    elif unit.kind == "parquet":
        yield from _parquet_texts(Path(unit.location), data.text_field)
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
            yield from _text_documents(unit, data.max_document_chars)
    elif problem:  # unreadable (the survey could not hash it)
        yield BadInput(unit.location, problem)
    else:
        try:
            for record in _records(unit, data):
                if isinstance(record, LongText):  # the same documents as record_pieces of the whole text
                    if record.chars <= data.max_document_chars:
                        yield "".join(record.pieces())
                    else:
                        yield from _cut(string_lines(record.pieces(), data.max_document_chars), data.max_document_chars)
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
