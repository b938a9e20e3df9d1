"""Corpus loading, tokenizer training, token shards and the training sampler.

The tokenize stage (`tokenize_corpus`) turns a text corpus into a directory the
trainer reads without ever touching text again:

    tokenizer.json   byte-level BPE (trained on the train split, or copied from tokenizer.path)
    train.bin        flat little-endian token ids, every document followed by <|endoftext|>
    val.bin          the same for the held-out documents
    manifest.json    counts, dtype, checksums; written last, so its presence means "complete"

Training then memory-maps the shards (`open_split`) and draws windows with
`sample_batch`, whose batch depends only on (seed, step): resuming needs no
sampler state and every rank agrees on the global batch.

Corpora (`data.source` in params.yaml):

* ``python-docs`` (default, offline): the Python Language Reference topics and
  the standard library's docstrings, about 1.7 MB of English that ships with
  every Python install.
* ``hub``: any Hugging Face dataset. For FineWeb-Edu::

      data:
        source: hub
        hub_path: HuggingFaceFW/fineweb-edu
        hub_name: sample-10BT
        hub_split: train
        hub_streaming: true
        max_documents: 200000   # required when streaming: how many documents to pull

  Streaming reads only the first ``max_documents`` documents and holds them in
  memory; ``hub_streaming: false`` downloads the whole config into the
  datasets cache and stays disk-backed. ``hub_path`` may also be a local
  directory of .jsonl/.parquet files (works offline).
* ``files``: local .txt (one document per file), .jsonl/.json/.parquet (one
  document per record, column ``data.text_field``) files or globs.
"""

from __future__ import annotations

import ast
import contextlib
import functools
import glob
import hashlib
import json
import logging
import os
import platform
import re
import sys
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Iterable, Iterator

import numpy as np
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from tqdm.auto import tqdm

from laplace.config import DataSection, TokenizerSection
from laplace.fileio import atomic_open, atomic_write_bytes, json_bytes, sha256_file

if TYPE_CHECKING:  # datasets is imported lazily: training only needs open_split/sample_batch
    import datasets

log = logging.getLogger(__name__)

EOS_TOKEN = "<|endoftext|>"
MANIFEST_FORMAT = 1
MANIFEST_NAME = "manifest.json"
TOKENIZER_NAME = "tokenizer.json"
SPLITS = ("train", "val")
TEXT_SUFFIXES = (".txt",)
RECORD_SUFFIXES = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}

# Documents tokenized per datasets.map call: bounds memory (results are kept in
# memory, not in the datasets cache) and lets data.max_tokens stop early.
DOCS_PER_ROUND = 20_000


class DataError(ValueError):
    """Bad data input; the one-line message names the file, field or knob at fault."""


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__


# --------------------------------------------------------------------------- python-docs corpus

# A reST-style underline: a run of one punctuation character under a heading.
_UNDERLINE = re.compile(r"^([*=\-~^\"#+])\1{2,}\s*$")
_MIN_DOC_CHARS = 300  # shorter topic sections are merged into the next one
_MAX_DOC_CHARS = 4000  # longer ones are cut into paragraph groups
_MIN_DOCSTRING_CHARS = 200
_SKIPPED_STDLIB_DIRS = {"test", "tests", "idlelib", "lib2to3", "turtledemo", "site-packages", "__pycache__"}


def _topic_sections(text: str) -> list[str]:
    """Split a reference topic at its headings (a line followed by an underline of the same length)."""
    lines = text.splitlines()
    sections: list[list[str]] = [[]]
    for i, line in enumerate(lines):
        following = lines[i + 1] if i + 1 < len(lines) else ""
        is_heading = (
            line.strip() and _UNDERLINE.match(following) and len(following.strip()) == len(line.rstrip())
        )
        if is_heading and any(s.strip() for s in sections[-1]):
            sections.append([])
        sections[-1].append(line)
    texts = ("\n".join(section).strip() for section in sections)
    return [text for text in texts if text]


def _pack_paragraphs(text: str, max_chars: int) -> list[str]:
    """Cut a long text at blank lines into groups of at most ~max_chars."""
    groups, current, size = [], [], 0
    for paragraph in re.split(r"\n\s*\n", text):
        if current and size + len(paragraph) > max_chars:
            groups.append("\n\n".join(current))
            current, size = [], 0
        current.append(paragraph)
        size += len(paragraph) + 2
    if current:
        groups.append("\n\n".join(current))
    return groups


def _reference_documents() -> list[str]:
    from pydoc_data.topics import topics

    documents = []
    for name in sorted(topics):
        pending = ""  # short sections wait to be glued to the next one
        for section in _topic_sections(topics[name]):
            section = f"{pending}\n\n{section}" if pending else section
            if len(section) < _MIN_DOC_CHARS:
                pending = section
                continue
            pending = ""
            documents.extend(_pack_paragraphs(section, _MAX_DOC_CHARS))
        if pending:
            if documents and len(pending) < _MIN_DOC_CHARS:
                documents[-1] = f"{documents[-1]}\n\n{pending}"
            else:
                documents.append(pending)
    return documents


def _stdlib_sources() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    paths = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in _SKIPPED_STDLIB_DIRS]
        paths.extend(Path(dirpath, f) for f in filenames if f.endswith(".py"))
    return sorted(paths)


def _docstrings(path: Path) -> list[str]:
    """Module, class and function docstrings of one source file, in source order (never imported)."""
    try:
        tree = ast.parse(path.read_bytes(), filename=str(path))
    except (SyntaxError, ValueError, RecursionError, OSError):
        return []
    nodes = [n for n in ast.walk(tree) if isinstance(n, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))]
    nodes.sort(key=lambda n: (n.lineno, n.col_offset))
    found = []
    for node in [tree, *nodes]:
        doc = ast.get_docstring(node)
        if doc and len(doc) >= _MIN_DOCSTRING_CHARS:
            found.append(doc)
    return found


@functools.lru_cache(maxsize=1)
def _python_docs_cached() -> tuple[str, ...]:
    documents = _reference_documents()
    for path in _stdlib_sources():
        documents.extend(_docstrings(path))
    # Exact duplicates (re-exported docstrings) would leak between train and val.
    return tuple(dict.fromkeys(documents))


def python_docs_documents() -> list[str]:
    """The offline default corpus: Language Reference topics plus stdlib docstrings, in a fixed order."""
    return list(_python_docs_cached())


# --------------------------------------------------------------------------- corpus


@dataclass
class _Corpus:
    dataset: "datasets.Dataset"
    undecodable: int  # records dropped because they were not valid UTF-8
    description: str


def load_corpus(data: DataSection) -> "datasets.Dataset":
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
        raise DataError(f"data.hub_path: could not load {where}: {_one_line(exc)}") from exc

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
            raise DataError(f"data.hub_path: reading {where} failed: {_one_line(exc)}") from exc
        dataset = datasets.Dataset.from_dict(
            {"text": texts}, features=datasets.Features({"text": datasets.Value("string")})
        )
        how = f"streaming, first {data.max_documents} documents"
    else:
        if data.text_field not in loaded.column_names:
            raise DataError(
                f"data.text_field: {where} has no field {data.text_field!r} "
                f"(fields: {', '.join(loaded.column_names)})"
            )
        if not _is_text_feature(loaded.features[data.text_field]):
            raise DataError(f"data.text_field: {where} field {data.text_field!r} is not text "
                            f"({loaded.features[data.text_field]})")
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
                raise DataError(f"data.files: {match} has unsupported type {suffix or '(none)'!r} "
                                "(use .txt, .jsonl, .json or .parquet)")
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
        raise DataError(f"{path}: could not read as {builder}: {_one_line(exc)}") from exc
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


# --------------------------------------------------------------------------- tokenizer


def train_tokenizer(texts: Iterable[str], vocab_size: int, min_frequency: int) -> Tokenizer:
    """Train a deterministic byte-level BPE whose only special token is <|endoftext|> (id 0).

    `texts` may also yield lists of strings (batches). Every byte is in the base vocabulary, so
    any string encodes, and decode(encode(s).ids) == s.
    """
    if vocab_size < 257:
        raise DataError(f"tokenizer.vocab_size: must be >= 257 (256 bytes + {EOS_TOKEN}), got {vocab_size}")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[EOS_TOKEN],
        show_progress=sys.stdout.isatty(),  # its bars print blank lines when stdout is a pipe
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    tokenizer.encode_special_tokens = True
    return tokenizer


def load_tokenizer(path: str | Path) -> Tokenizer:
    """A tokenizer.json. Text is never encoded as special tokens: a literal "<|endoftext|>" in a
    document stays text (this runtime flag is not saved in tokenizer.json, so it is set here)."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: tokenizer file not found")
    try:
        tokenizer = Tokenizer.from_file(str(path))
    except Exception as exc:
        raise DataError(f"{path}: not a valid tokenizer.json ({_one_line(exc)})") from exc
    tokenizer.encode_special_tokens = True
    return tokenizer


def tokenizer_sha256(tok: Tokenizer) -> str:
    """sha256 of the tokenizer's canonical JSON (sorted keys), independent of file formatting."""
    canonical = json.dumps(json.loads(tok.to_str()), sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()


class _DocumentEncoder:
    """datasets.map function: the token ids of each text followed by EOS.

    Holds the tokenizer as JSON so worker processes rebuild it with encode_special_tokens set
    (that flag does not survive pickling).
    """

    def __init__(self, tokenizer_json: str, eos_id: int):
        self.tokenizer_json = tokenizer_json
        self.eos_id = eos_id
        self._tokenizer: Tokenizer | None = None

    def __getstate__(self):
        return {"tokenizer_json": self.tokenizer_json, "eos_id": self.eos_id, "_tokenizer": None}

    def __call__(self, batch: dict) -> dict:
        if self._tokenizer is None:
            self._tokenizer = Tokenizer.from_str(self.tokenizer_json)
            self._tokenizer.encode_special_tokens = True
        encodings = self._tokenizer.encode_batch_fast(batch["text"], add_special_tokens=False)
        return {"ids": [encoding.ids + [self.eos_id] for encoding in encodings]}


@contextlib.contextmanager
def _quiet_forked_tokenizers(num_proc: int):
    """Forked map workers must not use tokenizers' thread pool (it may deadlock after a fork);
    saying so up front also silences tokenizers' fork warning. The parent keeps its threads."""
    if num_proc <= 1 or "TOKENIZERS_PARALLELISM" in os.environ:
        yield
        return
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    try:
        yield
    finally:
        os.environ.pop("TOKENIZERS_PARALLELISM", None)


@contextlib.contextmanager
def _datasets_progress_bars_off():
    """One bar of ours instead of one datasets.map bar per round."""
    import datasets

    was_enabled = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()
    try:
        yield
    finally:
        if was_enabled:
            datasets.enable_progress_bars()


# --------------------------------------------------------------------------- tokenize stage


@dataclass
class _Plan:
    """Which documents are kept and where they go."""

    train: list[int]
    val: list[int]
    total_read: int
    empty: int
    too_short: int
    undecodable: int
    fingerprint: str


def _val_score(text: str, seed: int) -> float:
    """A uniform number in [0, 1) fixed by (seed, document text): duplicates land in the same split."""
    key = str(seed).encode()[:64]
    digest = hashlib.blake2b(text.encode("utf-8"), digest_size=8, key=key).digest()
    return int.from_bytes(digest, "little") / 2.0**64


def _plan_split(corpus: _Corpus, data: DataSection, seed: int) -> _Plan:
    dataset = corpus.dataset
    fingerprint = hashlib.sha256()
    train, val = [], []
    scores: dict[int, float] = {}
    empty = too_short = 0
    index = 0
    for batch in tqdm(dataset.iter(batch_size=4096), total=-(-len(dataset) // 4096), desc="scan corpus",
                      unit="batch", leave=False):
        for text in batch["text"]:
            encoded = (text or "").encode("utf-8")
            fingerprint.update(len(encoded).to_bytes(8, "little") + encoded)
            stripped = len(text.strip()) if text else 0
            if stripped == 0:
                empty += 1
            elif stripped < data.min_chars:
                too_short += 1
            else:
                scores[index] = _val_score(text, seed)
                (val if scores[index] < data.val_fraction else train).append(index)
            index += 1
    fingerprint.update(f"undecodable={corpus.undecodable}".encode())

    total_read = len(dataset) + corpus.undecodable
    kept = len(train) + len(val)
    if kept == 0:
        raise DataError(
            f"corpus has no usable text: {total_read} documents read, all empty, shorter than "
            f"data.min_chars={data.min_chars} or not valid UTF-8"
        )
    if kept == 1:
        raise DataError(
            f"corpus has only 1 usable document (of {total_read} read); need at least 2, one for training "
            f"and one for validation (lower data.min_chars={data.min_chars} or add text)"
        )
    # Both splits must be non-empty: move the document closest to the threshold.
    if not val:
        moved = min(train, key=lambda i: (scores[i], i))
        train.remove(moved)
        val.append(moved)
    elif not train:
        moved = max(val, key=lambda i: (scores[i], i))
        val.remove(moved)
        train.append(moved)
    return _Plan(train, val, total_read, empty, too_short, corpus.undecodable, fingerprint.hexdigest())


@dataclass
class _Shard:
    documents: int
    tokens: int
    sha256: str
    bytes: int


def _text_batches(dataset: "datasets.Dataset", batch_size: int = 1000) -> Iterator[list[str]]:
    for batch in dataset.iter(batch_size=batch_size):
        yield batch["text"]


def _write_split(
    dataset: "datasets.Dataset",
    path: Path,
    encoder: _DocumentEncoder,
    dtype: np.dtype,
    num_proc: int,
    max_tokens: int,
    fingerprint: str,
    label: str,
) -> _Shard:
    """Tokenize `dataset` into the flat shard at `path`.

    With max_tokens > 0 the shard stops at the first document boundary at or past max_tokens:
    it holds whole documents, each ending in EOS, and at most one document more than the cap.
    """
    import datasets
    import pyarrow.compute as pc

    features = datasets.Features({"ids": datasets.List(datasets.Value(dtype.name))})
    digest = hashlib.sha256()
    documents = tokens = 0
    started = time.perf_counter()
    with (
        atomic_open(path) as handle,
        tqdm(total=len(dataset), desc=f"tokenize {label}", unit="doc") as progress,
        _datasets_progress_bars_off(),
        _quiet_forked_tokenizers(num_proc),
    ):
        for start in range(0, len(dataset), DOCS_PER_ROUND):
            if max_tokens and tokens >= max_tokens:
                break
            stop = min(start + DOCS_PER_ROUND, len(dataset))
            encoded = dataset.select(range(start, stop)).map(
                encoder,
                batched=True,
                num_proc=num_proc if num_proc > 1 and stop - start > 1 else None,
                remove_columns=dataset.column_names,
                features=features,
                keep_in_memory=True,  # token ids go straight to the shard, not to the datasets cache
                new_fingerprint=hashlib.sha256(f"{fingerprint}:{label}:{start}".encode()).hexdigest()[:16],
            )
            for table in encoded.with_format("arrow").iter(batch_size=1024):
                column = table.column("ids")
                lengths = pc.list_value_length(column).to_numpy()
                ids = pc.list_flatten(column).to_numpy()
                if max_tokens:
                    # Keep documents while the shard is still short of max_tokens.
                    before = tokens + np.concatenate(([0], np.cumsum(lengths)[:-1]))
                    keep = int(np.count_nonzero(before < max_tokens))
                    lengths = lengths[:keep]
                    ids = ids[: int(lengths.sum())]
                block = np.ascontiguousarray(ids, dtype=dtype).tobytes()
                handle.write(block)
                digest.update(block)
                documents += len(lengths)
                tokens += len(ids)
                progress.update(len(lengths))
                rate = tokens / max(time.perf_counter() - started, 1e-9)
                progress.set_postfix(tokens=tokens, tok_per_s=f"{rate:.3g}")
                if max_tokens and tokens >= max_tokens:
                    break
    return _Shard(documents, tokens, digest.hexdigest(), tokens * dtype.itemsize)


def tokenize_corpus(data: DataSection, tok_cfg: TokenizerSection, out_dir: Path, seed: int) -> dict:
    """The tokenize stage: corpus -> tokenizer.json, train.bin, val.bin, manifest.json in out_dir.

    Documents with len(text.strip()) < data.min_chars are skipped and counted. Each document goes
    to validation when a keyed hash of (seed, text) falls below data.val_fraction, so the split
    is deterministic and identical documents never straddle it; both splits get at least one.
    The tokenizer is trained on the train split only, unless tokenizer.path names one to reuse.
    data.max_tokens caps train.bin at a document boundary (see _write_split). Running twice gives
    byte-identical files. Returns flat metrics (counts, seconds, tokens_per_s).
    """
    started = time.perf_counter()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    # A half-rewritten directory must not look complete.
    (out_dir / MANIFEST_NAME).unlink(missing_ok=True)

    corpus = _read_corpus(data)
    plan = _plan_split(corpus, data, seed)
    train_docs = corpus.dataset.select(plan.train)
    val_docs = corpus.dataset.select(plan.val)

    tokenizer_path = out_dir / TOKENIZER_NAME
    if tok_cfg.path:
        source_path = Path(tok_cfg.path)
        load_tokenizer(source_path)  # validate before copying
        atomic_write_bytes(tokenizer_path, source_path.read_bytes())
    else:
        trained = train_tokenizer(_text_batches(train_docs), tok_cfg.vocab_size, tok_cfg.min_frequency)
        atomic_write_bytes(tokenizer_path, trained.to_str(pretty=True).encode("utf-8"))
    tokenizer = load_tokenizer(tokenizer_path)
    eos_id = tokenizer.token_to_id(EOS_TOKEN)
    if eos_id is None:
        raise DataError(f"{tok_cfg.path or tokenizer_path}: tokenizer has no {EOS_TOKEN!r} token")
    vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
    dtype = np.dtype("<u2") if vocab_size <= 1 << 16 else np.dtype("<u4")

    encoder = _DocumentEncoder(tokenizer.to_str(), eos_id)
    run_key = f"{plan.fingerprint}:{tokenizer_sha256(tokenizer)}"
    train = _write_split(train_docs, out_dir / "train.bin", encoder, dtype, data.num_proc, data.max_tokens,
                         run_key, "train")
    val = _write_split(val_docs, out_dir / "val.bin", encoder, dtype, data.num_proc, 0, run_key, "val")
    if train.tokens == 0 or val.tokens == 0:  # cannot happen (every document ends in EOS); guards the trainer
        raise DataError(f"{out_dir}: empty split after tokenizing ({train.tokens} train, {val.tokens} val tokens)")

    files = {name: {"bytes": shard.bytes, "sha256": shard.sha256}
             for name, shard in (("train.bin", train), ("val.bin", val))}
    files[TOKENIZER_NAME] = {"bytes": tokenizer_path.stat().st_size, "sha256": sha256_file(tokenizer_path)}
    manifest = {
        "format": MANIFEST_FORMAT,
        "vocab_size": vocab_size,
        "dtype": dtype.name,
        "eos_id": eos_id,
        "tokenizer_sha256": tokenizer_sha256(tokenizer),
        "source": {"kind": data.source, "fingerprint": plan.fingerprint, "description": corpus.description},
        "settings": {
            "seed": seed,
            "min_chars": data.min_chars,
            "val_fraction": data.val_fraction,
            "max_documents": data.max_documents,
            "max_tokens": data.max_tokens,
            "tokenizer": {"path": tok_cfg.path} if tok_cfg.path else
                         {"vocab_size": tok_cfg.vocab_size, "min_frequency": tok_cfg.min_frequency},
        },
        "documents": {"train": train.documents, "val": val.documents, "total_read": plan.total_read},
        "skipped": {"empty": plan.empty, "too_short": plan.too_short, "undecodable": plan.undecodable},
        "tokens": {"train": train.tokens, "val": val.tokens},
        "files": files,
    }
    atomic_write_bytes(out_dir / MANIFEST_NAME, json_bytes(manifest))

    seconds = time.perf_counter() - started
    total_tokens = train.tokens + val.tokens
    metrics = {
        "documents_read": plan.total_read,
        "documents_train": train.documents,
        "documents_val": val.documents,
        "documents_cut_by_max_tokens": len(plan.train) - train.documents,
        "skipped_empty": plan.empty,
        "skipped_too_short": plan.too_short,
        "skipped_undecodable": plan.undecodable,
        "tokens_train": train.tokens,
        "tokens_val": val.tokens,
        "vocab_size": vocab_size,
        "seconds": seconds,
        "tokens_per_s": total_tokens / max(seconds, 1e-9),
    }
    log.info(
        "tokenized %d documents into %d train + %d val tokens in %.1fs (%.0f tokens/s)",
        plan.total_read, metrics["tokens_train"], metrics["tokens_val"], seconds, metrics["tokens_per_s"],
    )
    return metrics


# --------------------------------------------------------------------------- reading shards


def read_manifest(dir: str | Path) -> dict:
    path = Path(dir) / MANIFEST_NAME
    if not path.is_file():
        raise DataError(f"{path}: no manifest (run the tokenize stage first)")
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as exc:
        raise DataError(f"{path}: not valid JSON ({_one_line(exc)})") from exc
    if not isinstance(manifest, dict) or manifest.get("format") != MANIFEST_FORMAT:
        found = manifest.get("format") if isinstance(manifest, dict) else None
        raise DataError(f"{path}: unsupported manifest format {found!r} (expected {MANIFEST_FORMAT})")
    return manifest


def open_split(dir: str | Path, split: str, verify: bool = False) -> np.memmap:
    """Read-only memmap of train.bin or val.bin; verify=True also checks its sha256."""
    if split not in SPLITS:
        raise DataError(f"split must be one of {', '.join(SPLITS)}, got {split!r}")
    manifest = read_manifest(dir)
    name = f"{split}.bin"
    path = Path(dir) / name
    try:
        expected = manifest["files"][name]
        tokens = int(manifest["tokens"][split])
        dtype = np.dtype(manifest["dtype"]).newbyteorder("<")
    except (KeyError, TypeError, ValueError) as exc:
        raise DataError(f"{Path(dir) / MANIFEST_NAME}: incomplete entry for {name} ({_one_line(exc)})") from exc
    if not path.is_file():
        raise DataError(f"{path}: missing (listed in the manifest)")
    size = path.stat().st_size
    if size != expected["bytes"] or size != tokens * dtype.itemsize:
        raise DataError(
            f"{path}: {size} bytes, manifest says {expected['bytes']} ({tokens} tokens of {dtype.name})"
        )
    if tokens == 0:
        raise DataError(f"{path}: holds no tokens")
    if verify and sha256_file(path) != expected["sha256"]:
        raise DataError(f"{path}: sha256 does not match the manifest (file corrupted or replaced)")
    return np.memmap(path, dtype=dtype, mode="r", shape=(tokens,))


def _windows(tokens: np.ndarray, starts: np.ndarray, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    windows = np.asarray(tokens[starts[:, None] + np.arange(seq_len + 1)], dtype=np.int64)
    stacked = torch.from_numpy(windows)
    return stacked[:, :-1].contiguous(), stacked[:, 1:].contiguous()


def _check_length(tokens: np.ndarray, seq_len: int) -> int:
    if seq_len <= 0:
        raise DataError(f"seq_len must be > 0, got {seq_len}")
    if len(tokens) < seq_len + 1:
        raise DataError(f"split has {len(tokens)} tokens, fewer than seq_len+1={seq_len + 1}: "
                        "lower train.seq_len or use more data")
    return len(tokens) - seq_len  # number of possible window starts


def sample_batch(
    tokens: np.ndarray,
    step: int,
    batch_size: int,
    seq_len: int,
    seed: int,
    rank: int = 0,
    world_size: int = 1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's share of the global batch for `step`: (x, y) int64 [batch_size/world_size, seq_len].

    The global batch's window starts come from a generator seeded with (seed, step) only, so a
    resumed run at step k sees the same data and ranks take contiguous slices of one batch.
    """
    if world_size <= 0 or not 0 <= rank < world_size:
        raise DataError(f"rank {rank} is not in a world of size {world_size}")
    if batch_size <= 0 or batch_size % world_size:
        raise DataError(f"batch_size {batch_size} is not divisible by world_size {world_size}")
    if step < 0:
        raise DataError(f"step must be >= 0, got {step}")
    n_starts = _check_length(tokens, seq_len)
    rng = np.random.default_rng([seed % 2**64, step])  # SeedSequence wants non-negative entropy
    starts = rng.integers(0, n_starts, size=batch_size)
    per_rank = batch_size // world_size
    return _windows(tokens, starts[rank * per_rank:(rank + 1) * per_rank], seq_len)


def validation_batches(
    tokens: np.ndarray, batch_size: int, seq_len: int, n_batches: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """n_batches fixed batches of windows spread evenly over the split (they overlap if it is short)."""
    if batch_size <= 0 or n_batches <= 0:
        raise DataError(f"batch_size and n_batches must be > 0, got {batch_size} and {n_batches}")
    n_starts = _check_length(tokens, seq_len)
    starts = np.linspace(0, n_starts - 1, batch_size * n_batches).round().astype(np.int64)
    return [_windows(tokens, chunk, seq_len) for chunk in starts.reshape(n_batches, batch_size)]
