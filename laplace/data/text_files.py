"""Text files read by byte ranges: a large file's parts (each end moved to a line start), their
digest and their validation (UTF-8, no NUL byte), and text cut into documents of at most
data.max_document_chars (at blank lines, then line ends, then spaces), for files and records alike."""

from __future__ import annotations

import codecs
import hashlib
import os
from collections.abc import Iterator

from laplace.data.units import BLOCK, Unit
from laplace.errors import one_line


def _line_start(f, pos: int, size: int) -> int:
    """The first line start at or after byte `pos` (0 and the end are their own)."""
    if pos <= 0 or pos >= size:
        return max(0, min(pos, size))
    f.seek(pos - 1)
    offset = pos - 1
    while block := f.read(BLOCK):
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
        while start < stop and (block := f.read(min(BLOCK, stop - start))):
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


def lines_as_documents(lines: Iterator[str], max_chars: int) -> Iterator[str]:
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


def text_documents(unit: Unit, max_chars: int) -> Iterator[str]:
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

    yield from lines_as_documents(lines(), max_chars)


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
        yield from lines_as_documents(_string_lines(text, max_chars), max_chars)
