"""What the corpus readers share: the unit of input a worker reads whole, bad input (skipped and
named), what a slice's reader saw, a record's text checked, and how much is read at a time."""

from __future__ import annotations

from dataclasses import dataclass, field

from laplace.errors import DataError

BLOCK = 1 << 20  # bytes read at a time when hashing or validating a file
RECORD_BATCH = 1024  # Parquet / dataset rows read at a time


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


def valid_text(value) -> bool:
    """False for a string that is not valid Unicode text (a lone surrogate, as JSON's "\\ud800" gives)."""
    if not isinstance(value, str) or value.isascii():
        return True
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def checked_record(value, where: str, field_name: str) -> str | None | BadInput:
    if value is None:
        return value
    if isinstance(value, str):
        if not valid_text(value):
            return BadInput(where, "not valid Unicode text (a lone surrogate such as \\ud800)")
        return value
    raise DataError(f"{where}: field {field_name!r} holds {type(value).__name__}, not text (data.text_field)")
