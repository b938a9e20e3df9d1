"""A JSON record too long to parse whole: its text field read from the line's bytes a piece at a time.

`json.loads` of a 200 MB line holds the line decoded (up to 4 bytes a character: one non-Latin-1
character makes CPython store the whole string at 2), then the field's value again, beside the
bytes: about 8x the record at its peak. Here the line stays bytes; the top-level members are found
by a scan of the bytes (strings skipped by their closing quote, nesting by brackets), the other
members are parsed alone, and the text field's string literal is decoded by `json` itself in
pieces of about a megabyte, each cut where no escape, UTF-8 character or surrogate pair is split.
A first pass checks every piece (so a record is either read whole or skipped whole, as before) and
counts its characters; the second yields the pieces. A worker then holds the line's bytes once
plus a piece. (Our own scanner: the standard library has no incremental JSON reader and none of
the streaming ones, ijson or json-stream, is a dependency; the decoding itself stays json's.)
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator

_PIECE_BYTES = 1 << 20
_WHITESPACE = b" \t\n\r"
_BACKSLASH, _QUOTE = 0x5C, 0x22
_STRUCTURE = re.compile(rb'["\[\]{}]')
_LITERAL_END = re.compile(rb"[\s,\]}]")


class NotARecord(ValueError):
    """The line is not one JSON object (the message says where)."""


def _skip_ws(raw, pos: int) -> int:
    n = len(raw)
    while pos < n and raw[pos] in _WHITESPACE:
        pos += 1
    return pos


def _escaped(raw, pos: int) -> bool:
    """Whether the byte at pos follows an odd run of backslashes."""
    k = pos
    while k > 0 and raw[k - 1] == _BACKSLASH:
        k -= 1
    return (pos - k) % 2 == 1


def _string_end(raw, start: int) -> int:
    """raw[start] opens a string: the index just after its closing quote."""
    pos = start + 1
    while True:
        quote = raw.find(b'"', pos)
        if quote < 0:
            raise NotARecord(f"unterminated string starting at byte {start}")
        if not _escaped(raw, quote):
            return quote + 1
        pos = quote + 1


def _value_end(raw, pos: int) -> int:
    if pos >= len(raw):
        raise NotARecord("a value expected at the end of the line")
    first = raw[pos]
    if first == _QUOTE:
        return _string_end(raw, pos)
    if first in b"[{":
        depth = 0
        while True:
            found = _STRUCTURE.search(raw, pos)
            if found is None:
                raise NotARecord(f"unclosed {chr(first)} at byte {pos}")
            at = found.start()
            mark = raw[at]
            if mark == _QUOTE:
                pos = _string_end(raw, at)
                continue
            depth += 1 if mark in b"[{" else -1
            pos = at + 1
            if depth == 0:
                return pos
    found = _LITERAL_END.search(raw, pos)
    return found.start() if found else len(raw)


def members(raw) -> list[tuple[str, int, int]]:
    """The top-level object's members: (key, value start, value end) in order."""
    pos = _skip_ws(raw, 0)
    if pos >= len(raw) or raw[pos] != ord("{"):
        raise NotARecord("not a JSON object")
    out: list[tuple[str, int, int]] = []
    pos = _skip_ws(raw, pos + 1)
    if pos < len(raw) and raw[pos] == ord("}"):
        pos += 1
    else:
        while True:
            if pos >= len(raw) or raw[pos] != _QUOTE:
                raise NotARecord(f"a key expected at byte {pos}")
            key_end = _string_end(raw, pos)
            key = json.loads(bytes(raw[pos:key_end]))
            pos = _skip_ws(raw, key_end)
            if pos >= len(raw) or raw[pos] != ord(":"):
                raise NotARecord(f"':' expected at byte {pos}")
            start = _skip_ws(raw, pos + 1)
            end = _value_end(raw, start)
            out.append((key, start, end))
            pos = _skip_ws(raw, end)
            if pos < len(raw) and raw[pos] == ord(","):
                pos = _skip_ws(raw, pos + 1)
                continue
            if pos < len(raw) and raw[pos] == ord("}"):
                pos += 1
                break
            raise NotARecord(f"',' or '}}' expected at byte {pos}")
    if _skip_ws(raw, pos) != len(raw):
        raise NotARecord(f"extra data at byte {pos}")
    return out


def _inside_escape(raw, pos: int) -> bool:
    """Whether byte pos lies inside an escape sequence (\\n, \\uXXXX) that starts before it."""
    for j in range(pos - 1, max(pos - 6, -1), -1):
        if raw[j] == _BACKSLASH and not _escaped(raw, j):
            length = 6 if j + 1 < len(raw) and raw[j + 1] == ord("u") else 2
            return j + length > pos
    return False


def _low_surrogate_escape(raw, pos: int) -> bool:
    head = bytes(raw[pos : pos + 4]).lower()
    return len(head) == 4 and head[:3] == b"\\ud" and head[3:] in (b"c", b"d", b"e", b"f")


def _clean(raw, pos: int) -> bool:
    byte = raw[pos]
    return not (0x80 <= byte < 0xC0 or _inside_escape(raw, pos) or _low_surrogate_escape(raw, pos))


def _clean_cut(raw, low: int, cut: int, stop: int) -> int:
    """The nearest position before cut (else after it, else stop) where a piece may end: not
    inside a UTF-8 character or an escape, nor between the two escapes of a surrogate pair."""
    for pos in range(cut, low, -1):
        if _clean(raw, pos):
            return pos
    for pos in range(cut + 1, stop):
        if _clean(raw, pos):
            return pos
    return stop


def string_pieces(raw, start: int, end: int) -> Iterator[str]:
    """The string literal raw[start:end] (quotes included) decoded by json, a piece at a time.
    ValueError / UnicodeDecodeError as json.loads would raise them for the whole literal."""
    pos, stop = start + 1, end - 1
    while pos < stop:
        cut = min(stop, pos + _PIECE_BYTES)
        if cut < stop:
            cut = _clean_cut(raw, pos, cut, stop)
        yield json.loads(b'"' + raw[pos:cut] + b'"')
        pos = cut


def string_lines(pieces: Iterator[str], max_chars: int) -> Iterator[str]:
    """text_files._string_lines over a text given in pieces: the same lines, holding at most about
    max_chars plus a piece (a decision at a position needs max_chars characters after it)."""
    buf, pos, done = "", 0, False
    while True:
        while not done and len(buf) - pos <= max_chars:
            piece = next(pieces, None)
            if piece is None:
                done = True
            else:
                buf, pos = buf[pos:] + piece, 0
        if pos >= len(buf):
            return
        newline = buf.find("\n", pos, pos + max_chars)
        if newline >= 0:
            end = newline + 1
        elif len(buf) - pos <= max_chars:
            end = len(buf)
        else:
            end = pos + max_chars
            space = buf.rfind(" ", pos + max_chars // 2, end)
            end = space + 1 if space > pos else end
        yield buf[pos:end]
        pos = end


class LongText:
    """A record's text field, checked and counted, read again a piece at a time on demand."""

    def __init__(self, raw, start: int, end: int, chars: int):
        self.raw, self.start, self.end, self.chars = raw, start, end, chars

    def pieces(self) -> Iterator[str]:
        return string_pieces(self.raw, self.start, self.end)
