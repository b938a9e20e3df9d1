"""The tokenize stage's work: corpus -> tokenizer.json, train.bin, val.bin, manifest.json."""

from __future__ import annotations

import contextlib
import hashlib
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from tqdm.auto import tqdm

from laplace import manifest
from laplace.config import DataSection, TokenizerSection
from laplace.data.readers import _Corpus, _read_corpus
from laplace.data.shards import KIND
from laplace.data.tokenizer import (
    EOS_TOKEN,
    TOKENIZER_NAME,
    _DocumentEncoder,
    _quiet_forked_tokenizers,
    load_tokenizer,
    tokenizer_sha256,
    train_tokenizer,
)
from laplace.errors import DataError
from laplace.fileio import atomic_open, atomic_write_bytes

if TYPE_CHECKING:
    import datasets

log = logging.getLogger(__name__)

# Documents tokenized per datasets.map call: bounds memory (results are kept in
# memory, not in the datasets cache) and lets data.max_tokens stop early.
DOCS_PER_ROUND = 20_000


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
    for batch in tqdm(
        dataset.iter(batch_size=4096), total=-(-len(dataset) // 4096), desc="scan corpus", unit="batch", leave=False
    ):
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


def _text_batches(dataset: datasets.Dataset, batch_size: int = 1000) -> Iterator[list[str]]:
    for batch in dataset.iter(batch_size=batch_size):
        yield batch["text"]


def _write_split(
    dataset: datasets.Dataset,
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
            encoded = dataset.select(
                range(start, stop)
            ).map(
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
    (out_dir / manifest.MANIFEST).unlink(missing_ok=True)

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
    train = _write_split(
        train_docs, out_dir / "train.bin", encoder, dtype, data.num_proc, data.max_tokens, run_key, "train"
    )
    val = _write_split(val_docs, out_dir / "val.bin", encoder, dtype, data.num_proc, 0, run_key, "val")
    if train.tokens == 0 or val.tokens == 0:  # cannot happen (every document ends in EOS); guards the trainer
        raise DataError(f"{out_dir}: empty split after tokenizing ({train.tokens} train, {val.tokens} val tokens)")

    written = {
        name: {"bytes": shard.bytes, "sha256": shard.sha256} for name, shard in (("train.bin", train), ("val.bin", val))
    }
    manifest.write_manifest(
        out_dir,
        KIND,
        ["train.bin", "val.bin", TOKENIZER_NAME],
        known=written,
        vocab_size=vocab_size,
        dtype=dtype.name,
        eos_id=eos_id,
        tokenizer_sha256=tokenizer_sha256(tokenizer),
        source={"kind": data.source, "fingerprint": plan.fingerprint, "description": corpus.description},
        settings={
            "seed": seed,
            "min_chars": data.min_chars,
            "val_fraction": data.val_fraction,
            "max_documents": data.max_documents,
            "max_tokens": data.max_tokens,
            "tokenizer": {"path": tok_cfg.path}
            if tok_cfg.path
            else {"vocab_size": tok_cfg.vocab_size, "min_frequency": tok_cfg.min_frequency},
        },
        documents={"train": train.documents, "val": val.documents, "total_read": plan.total_read},
        skipped={"empty": plan.empty, "too_short": plan.too_short, "undecodable": plan.undecodable},
        tokens={"train": train.tokens, "val": val.tokens},
    )

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
        plan.total_read,
        metrics["tokens_train"],
        metrics["tokens_val"],
        seconds,
        metrics["tokens_per_s"],
    )
    return metrics
