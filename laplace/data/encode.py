"""The tokenize stage's encode: one slice's documents split train/val by a keyed hash, encoded in
bounded batches by the worker's tokenizer, and written into fixed-size shards
(<split>/<slice>-<part>/{tokens.bin, manifest.json}; laplace.data.shards). Each slice's record
(what the output's manifest keeps of it) is written when the slice is finished, so a rerun adopts
it, or the slice's finished shards, instead of encoding them again."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from laplace import manifest
from laplace.config import DataSection
from laplace.data.readers import slice_documents
from laplace.data.shards import SPLITS, TOKENS, ShardWriter
from laplace.data.units import SliceStats, Unit
from laplace.fileio import atomic_write_json

_ENCODE_BATCH_CHARS = 1 << 18  # documents are encoded in batches of about this much text (memory: ~300 B per char)
# The encoder holds ~300 bytes per character of one input while it pre-tokenizes it: a longer
# document is encoded as pieces of at most this many characters (cut where the byte-level
# pre-tokenizer cuts anyway, so the ids are the same) and its ids joined.
_ENCODE_PIECE_CHARS = 1 << 18
LISTED_BAD = 100  # bad files named in the manifest (all are logged)


def val_score(text: str, seed: int) -> float:
    """A uniform number in [0, 1) fixed by (seed, document text): duplicates land in the same split."""
    key = str(seed).encode()[:64]
    digest = hashlib.blake2b(text.encode("utf-8"), digest_size=8, key=key).digest()
    return int.from_bytes(digest, "little") / 2.0**64


@dataclass
class EncodeJob:
    slice: int
    units: list[Unit]
    problems: dict[str, str]
    data: DataSection
    seed: int
    quota_documents: int
    quota_tokens: int
    tokenizer_json: str
    eos_id: int
    start_ids: list[int]  # what each document starts with (the tokenizer's BOS convention)
    dtype: str
    key: str
    staging: str


def _encoder_pieces(text: str, limit: int) -> Iterator[str]:
    """text in pieces of at most `limit` characters (about), each cut just before a space that
    follows a non-space and precedes one: a byte-level (GPT-2) pre-tokenizer starts a new
    pre-token there, so encoding the pieces gives the ids of the whole. Without such a space
    within the window (no spaces at all), at the limit."""
    pos, n = 0, len(text)
    while n - pos > limit:
        end = pos + limit
        cut = text.rfind(" ", pos + limit // 2, end)
        while cut > pos and (text[cut - 1].isspace() or cut + 1 >= n or text[cut + 1].isspace()):
            cut = text.rfind(" ", pos + limit // 2, cut)
        end = cut if cut > pos else end
        yield text[pos:end]
        pos = end
    yield text[pos:]


def _finished_record(path: Path, staging: Path, key: str) -> dict | None:
    """A slice's record from an interrupted run, when it was made with `key` and every shard it
    lists is there with its size (else None: the slice is encoded again, adopting what is valid)."""
    try:
        record = json.loads(path.read_text())
        if record.get("key") != key:
            return None
        for shards in record["shards"].values():
            for shard in shards:
                tokens = staging / shard["path"] / TOKENS
                if tokens.stat().st_size != shard["bytes"] or not (tokens.parent / manifest.MANIFEST).is_file():
                    return None
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return record


_TOKENIZER: dict[str, object] = {}  # this worker's tokenizer, by its JSON (one entry)


def _worker_tokenizer(tokenizer_json: str):
    """One Tokenizer per worker process, reused by every slice it encodes: the tokenizers library
    does not give a dropped Tokenizer's memory back (a probe that built one per batch took a
    worker from 144 MB to 1.9 GB), so a tokenizer per slice would grow a worker with the slices."""
    from tokenizers import Tokenizer

    if tokenizer_json not in _TOKENIZER:
        _TOKENIZER.clear()
        tokenizer = Tokenizer.from_str(tokenizer_json)
        tokenizer.encode_special_tokens = True
        _TOKENIZER[tokenizer_json] = tokenizer
    return _TOKENIZER[tokenizer_json]


def _encoded(tokenizer, pieces: list[str]) -> Iterator:
    """The encodings of the pieces, in order, the encoder given at most about _ENCODE_BATCH_CHARS
    characters per call: it holds ~300 bytes per character of what it is given (a 1M-character
    document at once took ~300 MB), so a long document's pieces go a few at a time."""
    group: list[str] = []
    size = 0
    for piece in pieces:
        if group and size + len(piece) > _ENCODE_BATCH_CHARS:
            yield from tokenizer.encode_batch_fast(group, add_special_tokens=False)
            group, size = [], 0
        group.append(piece)
        size += len(piece)
    if group:
        yield from tokenizer.encode_batch_fast(group, add_special_tokens=False)


def encode_slice(job: EncodeJob) -> tuple[dict, int]:
    """Encode one slice: its record (what the manifest keeps) and how many of its shards were
    adopted from an interrupted run (a figure of this run, not of the slice)."""

    data = job.data
    record_path = Path(job.staging) / "slices" / f"{job.slice:05d}.json"
    record = _finished_record(record_path, Path(job.staging), job.key)
    if record is not None:  # the slice finished in an interrupted run: all of it is kept
        return record, sum(len(shards) for shards in record["shards"].values())
    tokenizer = _worker_tokenizer(job.tokenizer_json)
    dtype = np.dtype(job.dtype)
    writers = {s: ShardWriter(Path(job.staging), s, job.slice, job.key, data.shard_tokens, dtype) for s in SPLITS}
    resumed = sum(len(w.finished) for w in writers.values())  # adopted from an interrupted run
    stats = SliceStats()
    counts = {s: 0 for s in SPLITS}
    cut = 0
    batch: list[tuple[str, int, int, str]] = []  # (split, doc index, tokens to skip, text)

    def flush() -> None:
        pieces = [list(_encoder_pieces(text, _ENCODE_PIECE_CHARS)) for *_, text in batch]
        encodings = _encoded(tokenizer, [p for ps in pieces for p in ps])
        for (split, index, skip, _), parts in zip(batch, pieces):
            done = [next(encodings).ids for _ in parts]
            count = len(job.start_ids) + sum(map(len, done)) + 1
            ids = np.fromiter((*job.start_ids, *(i for d in done for i in d), job.eos_id), dtype=dtype, count=count)
            writers[split].write(ids, index, skip)
        batch.clear()

    chars = 0
    for text in slice_documents(job.units, job.problems, data, job.quota_documents, stats):
        split = "val" if val_score(text, job.seed) < data.val_fraction else "train"
        writer = writers[split]
        index = counts[split]
        skip = writer.skip(index)
        if split == "train" and job.quota_tokens and skip == 0:  # a document not yet started
            if any(s == "train" for s, *_ in batch):
                flush()  # the cap needs the exact token count so far
                chars = 0
            if writer.tokens >= job.quota_tokens:
                cut += 1
                continue
        counts[split] += 1
        if skip is None:
            continue
        batch.append((split, index, skip, text))
        chars += len(text)
        if chars >= _ENCODE_BATCH_CHARS:
            flush()
            chars = 0
    if batch:
        flush()
    for split, writer in writers.items():
        writer.finish(counts[split])
    stats.bad = stats.bad[:LISTED_BAD]  # all are counted (undecodable); the first are named
    record = {
        "key": job.key,
        "slice": job.slice,
        "stats": asdict(stats),
        "documents": counts,
        "cut_by_max_tokens": cut,
        "shards": {s: w.finished for s, w in writers.items()},
    }
    record_path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(record_path, record)
    return record, resumed
