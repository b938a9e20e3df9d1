"""Record files read one record at a time: JSON Lines (also gzipped, and a large file in byte
ranges), a JSON array, Apache Parquet. A record that is not JSON, not an object, or whose text is
not valid Unicode is bad input (skipped and named by file:line); one over data.max_record_bytes is
skipped unread; a very long line is parsed from its bytes a piece at a time (long_records)."""

from __future__ import annotations

import codecs
import json
from collections.abc import Iterator
from pathlib import Path

from laplace.data.long_records import LongText, NotARecord, members, string_pieces
from laplace.data.text_files import byte_range
from laplace.data.units import BLOCK, RECORD_BATCH, BadInput, Unit, checked_record, valid_text
from laplace.errors import DataError, one_line

# A longer JSON line is parsed from its bytes a piece at a time (long_records): json.loads would hold
# it decoded twice beside its bytes (~8x the record with one non-Latin-1 character)
_STREAM_RECORD_BYTES = 1 << 23


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
        return checked_record(json.loads(bytes(raw[start:end])), where, text_field)
    chars = 0
    try:
        for piece in string_pieces(raw, start, end):  # checked whole before any of it is used
            if not valid_text(piece):
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
                    while left and (block := f.read(min(BLOCK, left))):
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


def jsonl_texts(unit: Unit, text_field: str, max_bytes: int) -> Iterator[str | None | BadInput | LongText]:
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
            if isinstance(value, str) and valid_text(value):
                yield value
            else:
                yield checked_record(value, where(number), text_field)


def json_texts(path: Path, text_field: str, max_bytes: int) -> Iterator[str | None | BadInput | LongText]:
    with open(path, "rb") as f:
        head = f.read(64).removeprefix(codecs.BOM_UTF8).lstrip()
    if not head.startswith(b"["):
        yield from jsonl_texts(Unit(path.name, "jsonl", str(path)), text_field, max_bytes)
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
        yield checked_record(record[text_field], where, text_field)


def parquet_texts(path: Path, text_field: str) -> Iterator[str | None | BadInput]:
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
    for batch in parquet.iter_batches(batch_size=RECORD_BATCH, columns=[text_field]):
        yield from batch.column(0).to_pylist()
