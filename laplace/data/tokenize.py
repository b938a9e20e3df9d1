"""The tokenize stage's work: a corpus -> tokenizer.json and fixed-size token shards, streamed,
in parallel, resumable.

    survey   each slice (a worker per slice) hashes its input and keeps its share of a seeded
             sample for the tokenizer (the train documents with the smallest keyed hash, at most
             tokenizer.sample_bytes in all)
    train    the byte-level BPE on that sample (or tokenizer.path), reused when the sample is unchanged
    encode   each slice is streamed through the tokenizer into shards of data.shard_tokens tokens,
             <split>/<slice>-<part>/{tokens.bin, manifest.json}; a shard is finished when its
             manifest is written, and records where in the slice it ends
    assemble the new output directory is built beside the old one (unchanged shards hard-linked,
             never rewritten), the manifest written last, and swapped in

Work goes to `.<out>.partial/` beside the output: a killed run resumes from the shards it
finished there; a failed one leaves the previous output untouched. The worker pool is in
laplace.data.pool, the shard writer in laplace.data.shards.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import heapq
import json
import logging
import os
import shutil
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
from tqdm.auto import tqdm

from laplace import manifest
from laplace.config import DataSection, TokenizerSection
from laplace.data.pool import process_pool, sigterm_unwinds
from laplace.data.readers import (
    SliceStats,
    Unit,
    corpus_units,
    plan_slices,
    slice_documents,
    stable_hash,
    unit_fingerprint,
    write_python_docs,
)
from laplace.data.shards import KIND, SPLITS, TOKENS, ShardWriter
from laplace.data.tokenizer import EOS_TOKEN, TOKENIZER_NAME, load_tokenizer, tokenizer_sha256, train_reaching
from laplace.errors import DataError
from laplace.fileio import atomic_write_bytes, atomic_write_json, replace_dir

log = logging.getLogger(__name__)

FORMAT = 2  # bump when the bytes a slice produces change for the same input and settings
_ENCODE_BATCH_CHARS = 1 << 20  # documents are encoded in batches of about this much text
_LISTED_BAD = 100  # bad files named in the manifest (all are logged)


def _val_score(text: str, seed: int) -> float:
    """A uniform number in [0, 1) fixed by (seed, document text): duplicates land in the same split."""
    key = str(seed).encode()[:64]
    digest = hashlib.blake2b(text.encode("utf-8"), digest_size=8, key=key).digest()
    return int.from_bytes(digest, "little") / 2.0**64


def staging_dir(out_dir: Path) -> Path:
    return out_dir.parent / f".{out_dir.name}.partial"


def _quota(total: int, slot: int, slots: int) -> int:
    """slot's even share of a cap (0 = no cap); every slot gets at least 1 when capped."""
    if not total:
        return 0
    return max(1, total // slots + (slot < total % slots))


# --------------------------------------------------------------------------- survey: fingerprints and the sample


@dataclass
class _SurveyJob:
    slice: int
    units: list[Unit]
    data: DataSection
    seed: int
    quota: int
    sample_bytes: int  # 0: no sample needed (tokenizer.path)


@dataclass
class _Survey:
    slice: int
    fingerprints: dict[str, str]
    problems: dict[str, str]
    sample: list[tuple[int, str]] = field(default_factory=list)  # (keyed hash, text), smallest hashes


def _bounded_sample(texts: Iterator[str], seed: int, budget: int) -> list[tuple[int, str]]:
    """The texts with the smallest keyed hashes whose sizes add up to at most `budget` bytes."""
    heap: list[tuple[int, str]] = []  # max-heap on the hash (negated)
    size = 0
    for text in texts:
        key = stable_hash("sample", str(seed), text)
        if heap and size >= budget and key > -heap[0][0]:
            continue
        heapq.heappush(heap, (-key, text))
        size += len(text.encode("utf-8"))
        while size > budget and heap:
            _, dropped = heapq.heappop(heap)
            size -= len(dropped.encode("utf-8"))
    return sorted((-k, t) for k, t in heap)


def _survey(job: _SurveyJob) -> _Survey:
    data = job.data
    found = {u.name: unit_fingerprint(u, data) for u in job.units}
    problems = {name: problem for name, (_, problem) in found.items() if problem}
    if problems and data.on_bad_file == "error":
        name = sorted(problems)[0]
        where = next(u.location for u in job.units if u.name == name)
        raise DataError(f"{where}: {problems[name]} (data.on_bad_file: error; set it to skip to leave such input out)")
    survey = _Survey(job.slice, {name: digest for name, (digest, _) in found.items()}, problems)
    if job.sample_bytes:
        docs = slice_documents(job.units, problems, data, job.quota, SliceStats())
        train = (t for t in docs if _val_score(t, job.seed) >= data.val_fraction)
        survey.sample = _bounded_sample(train, job.seed, job.sample_bytes)
    return survey


# --------------------------------------------------------------------------- encode: one slice into shards


@dataclass
class _EncodeJob:
    slice: int
    units: list[Unit]
    problems: dict[str, str]
    data: DataSection
    seed: int
    quota_documents: int
    quota_tokens: int
    tokenizer_json: str
    eos_id: int
    dtype: str
    key: str
    staging: str


def _encode(job: _EncodeJob) -> tuple[dict, int]:
    """Encode one slice: its record (what the manifest keeps) and how many of its shards were
    adopted from an interrupted run (a figure of this run, not of the slice)."""
    from tokenizers import Tokenizer

    data = job.data
    record_path = Path(job.staging) / "slices" / f"{job.slice:05d}.json"
    if record_path.is_file():
        record = json.loads(record_path.read_text())
        if record.get("key") == job.key:  # the slice finished in an interrupted run: all of it is kept
            return record, sum(len(shards) for shards in record["shards"].values())
    tokenizer = Tokenizer.from_str(job.tokenizer_json)
    tokenizer.encode_special_tokens = True
    dtype = np.dtype(job.dtype)
    writers = {s: ShardWriter(Path(job.staging), s, job.slice, job.key, data.shard_tokens, dtype) for s in SPLITS}
    resumed = sum(len(w.finished) for w in writers.values())  # adopted from an interrupted run
    stats = SliceStats()
    counts = {s: 0 for s in SPLITS}
    cut = 0
    batch: list[tuple[str, int, int, str]] = []  # (split, doc index, tokens to skip, text)

    def flush() -> None:
        encodings = tokenizer.encode_batch_fast([text for *_, text in batch], add_special_tokens=False)
        for (split, index, skip, _), encoding in zip(batch, encodings):
            ids = np.fromiter((*encoding.ids, job.eos_id), dtype=dtype, count=len(encoding.ids) + 1)
            writers[split].write(ids, index, skip)
        batch.clear()

    chars = 0
    for text in slice_documents(job.units, job.problems, data, job.quota_documents, stats):
        split = "val" if _val_score(text, job.seed) < data.val_fraction else "train"
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
    stats.bad = stats.bad[:_LISTED_BAD]  # all are counted (undecodable); the first are named
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


# --------------------------------------------------------------------------- the stage


@contextlib.contextmanager
def _datasets_cache_in(directory: Path):
    """Point `datasets`' cache (local JSONL/Parquet builders, hub metadata) at a directory we remove
    afterwards: nothing corpus-sized is left in the user's ~/.cache."""
    saved = os.environ.get("HF_DATASETS_CACHE")
    os.environ["HF_DATASETS_CACHE"] = str(directory)
    config = sys.modules.get("datasets.config")
    before = getattr(config, "HF_DATASETS_CACHE", None)
    if config is not None:
        config.HF_DATASETS_CACHE = str(directory)
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("HF_DATASETS_CACHE", None)
        else:
            os.environ["HF_DATASETS_CACHE"] = saved
        if config is not None:
            config.HF_DATASETS_CACHE = before
        shutil.rmtree(directory, ignore_errors=True)


def _remove_temporaries(staging: Path) -> None:
    """Half-written shards of killed workers, and the staging directory itself when nothing in it is
    worth resuming from; finished shards stay for the next run."""
    for split in SPLITS:
        for tmp in (staging / split).glob(".*.tmp-*") if (staging / split).is_dir() else []:
            shutil.rmtree(tmp, ignore_errors=True)
    for directory in sorted((p for p in staging.rglob("*") if p.is_dir()), reverse=True) + [staging]:
        with contextlib.suppress(OSError):  # not empty: keep it
            directory.rmdir()


def _previous(out_dir: Path) -> dict:
    found, _ = manifest.read_manifest(out_dir, KIND)
    return found if found is not None and found.get("pipeline_format") == FORMAT else {}


def _settings(data: DataSection, tok_cfg: TokenizerSection, seed: int) -> dict:
    return {
        "seed": seed,
        "min_chars": data.min_chars,
        "max_document_chars": data.max_document_chars,
        "val_fraction": data.val_fraction,
        "on_bad_file": data.on_bad_file,
        "text_field": data.text_field,
        "max_documents": data.max_documents,
        "max_tokens": data.max_tokens,
        "slices": data.slices,
        "shard_tokens": data.shard_tokens,
        "tokenizer": {"path": tok_cfg.path}
        if tok_cfg.path
        else {
            "vocab_size": tok_cfg.vocab_size,
            "min_frequency": tok_cfg.min_frequency,
            "sample_bytes": tok_cfg.sample_bytes,
        },
    }


def _digest(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()


def _describe_source(data: DataSection, units: list[Unit]) -> str:
    import platform

    if data.source == "hub":
        return f"hub: {data.hub_path!r} ({data.hub_name}) split {data.hub_split!r}, field {data.text_field!r}, streamed"
    if data.source == "python-docs":
        return f"python-docs: Python {platform.python_version()} reference topics and stdlib docstrings"
    return f"files: {data.path} ({len(units)} files)"


def _sample_tokenizer(surveys: list[_Survey], budget: int) -> list[tuple[int, str]]:
    """The global sample: the smallest keyed hashes over all slices, at most `budget` bytes."""
    merged = sorted(item for s in surveys for item in s.sample)
    chosen, size = [], 0
    for key, text in merged:
        size += len(text.encode("utf-8"))
        if size > budget:
            break
        chosen.append((key, text))
    return chosen


def _tokenizer_bytes(
    tok_cfg: TokenizerSection, surveys: list[_Survey], settings: dict, previous: dict, out_dir: Path, staging: Path
) -> tuple[bytes, str]:
    """tokenizer.json's bytes and the key of what made it: reused when the key is unchanged."""
    if tok_cfg.path:
        source = Path(tok_cfg.path)
        load_tokenizer(source)  # validate before copying
        raw = source.read_bytes()
        return raw, hashlib.sha256(raw).hexdigest()
    sample = _sample_tokenizer(surveys, tok_cfg.sample_bytes)
    key = _digest([settings["tokenizer"], settings["seed"], hashlib.sha256(repr(sample).encode()).hexdigest()])
    if previous.get("tokenizer_key") == key and (out_dir / TOKENIZER_NAME).is_file():
        return (out_dir / TOKENIZER_NAME).read_bytes(), key
    staged = staging / TOKENIZER_NAME
    if staged.is_file() and (staging / "tokenizer.key").is_file() and (staging / "tokenizer.key").read_text() == key:
        return staged.read_bytes(), key
    if not sample:
        raise DataError(
            "corpus has no usable text: no train document of at least "
            f"data.min_chars={settings['min_chars']} characters that is valid UTF-8"
        )
    size = sum(len(t.encode("utf-8")) for _, t in sample)
    log.info("training the tokenizer on a sample of %d documents (%.1f MB)", len(sample), size / 1e6)
    note = f"the sample ({len(sample)} documents, {size:,} bytes; tokenizer.sample_bytes={tok_cfg.sample_bytes:,})"
    trained = train_reaching((t for _, t in sample), tok_cfg.vocab_size, tok_cfg.min_frequency, note)
    raw = trained.to_str(pretty=True).encode("utf-8")
    atomic_write_bytes(staged, raw)
    atomic_write_bytes(staging / "tokenizer.key", key.encode())
    return raw, key


def _reusable(previous: dict, out_dir: Path, index: int, key: str) -> dict | None:
    """The previous output's record of slice `index` when it was made with `key` and its shards are there."""
    record = previous.get("slices", {}).get(f"{index:05d}")
    if not record or record.get("key") != key:
        return None
    for shards in record["shards"].values():
        for shard in shards:
            path = out_dir / shard["path"] / TOKENS
            if not path.is_file() or path.stat().st_size != shard["bytes"]:
                return None
    return record


def tokenize_corpus(data: DataSection, tok_cfg: TokenizerSection, out_dir: Path, seed: int) -> dict:
    """The tokenize stage: corpus -> out_dir/{tokenizer.json, train/*, val/*, manifest.json}.

    Documents with len(text.strip()) < data.min_chars are skipped and counted; bad files are
    skipped and named (data.on_bad_file). A document goes to validation when a keyed hash of
    (seed, text) falls below data.val_fraction. The same input and settings give byte-identical
    files whatever data.num_proc. Returns flat metrics (counts, seconds, tokens_per_s).
    """
    out_dir = Path(out_dir)
    staging = staging_dir(out_dir)
    staging.mkdir(parents=True, exist_ok=True)
    try:
        with sigterm_unwinds(), _datasets_cache_in(staging / "hf-cache"):
            metrics = _tokenize(data, tok_cfg, out_dir, staging, seed)
    except (SystemExit, KeyboardInterrupt):
        finished = sum(1 for split in SPLITS for _ in staging.glob(f"{split}/*/manifest.json"))
        log.warning(
            "tokenize interrupted: %s left as it was; %d finished shards kept in %s for the next run to resume from",
            out_dir, finished, staging,
        )  # fmt: skip
        raise
    finally:
        _remove_temporaries(staging)
        shutil.rmtree(out_dir.parent / f".{out_dir.name}.next", ignore_errors=True)
    shutil.rmtree(staging, ignore_errors=True)
    return metrics


def _tokenize(data: DataSection, tok_cfg: TokenizerSection, out_dir: Path, staging: Path, seed: int) -> dict:
    started = time.perf_counter()
    if data.source == "python-docs" and not Path(data.path).exists():
        # Outside DVC (no corpus stage ran): the same files the corpus stage writes, generated once
        # here rather than in every worker; the shards are identical either way.
        data = dataclasses.replace(data, path=str(staging / "python-docs"))
        write_python_docs(Path(data.path))
    units = corpus_units(data)
    slices = plan_slices(units, data.slices)
    busy = [i for i, s in enumerate(slices) if s]
    docs_quota = {i: _quota(data.max_documents, k, len(busy)) for k, i in enumerate(busy)}
    tokens_quota = {i: _quota(data.max_tokens, k, len(busy)) for k, i in enumerate(busy)}
    settings = _settings(data, tok_cfg, seed)
    previous = _previous(out_dir)
    workers = max(1, min(data.num_proc, len(busy)))

    with process_pool(workers) as map_unordered:
        jobs = [
            _SurveyJob(i, slices[i], data, seed, docs_quota[i], 0 if tok_cfg.path else tok_cfg.sample_bytes)
            for i in busy
        ]
        surveys = []
        for survey in tqdm(map_unordered(_survey, jobs), total=len(jobs), desc="survey slices", unit="slice"):
            surveys.append(survey)
        surveys.sort(key=lambda s: s.slice)
        raw_tokenizer, tokenizer_key = _tokenizer_bytes(tok_cfg, surveys, settings, previous, out_dir, staging)

        tokenizer = _tokenizer_from(raw_tokenizer, tok_cfg.path or str(staging / TOKENIZER_NAME))
        eos_id = tokenizer.token_to_id(EOS_TOKEN)
        vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
        dtype = np.dtype("<u2") if vocab_size <= 1 << 16 else np.dtype("<u4")
        tok_sha = tokenizer_sha256(tokenizer)
        tokenizer_json = tokenizer.to_str()

        records: dict[int, dict] = {}
        reused: set[int] = set()
        encode_jobs = []
        for survey in surveys:
            i = survey.slice
            key = _digest(
                {
                    "format": FORMAT,
                    "tokenizer": tok_sha,
                    "settings": {k: v for k, v in settings.items() if k != "tokenizer"},
                    "dtype": dtype.name,
                    "quota": [docs_quota[i], tokens_quota[i]],
                    "units": [(u.name, u.kind, survey.fingerprints[u.name]) for u in slices[i]],
                }
            )
            if (record := _reusable(previous, out_dir, i, key)) is not None:
                records[i] = record
                reused.add(i)
                continue
            encode_jobs.append(
                _EncodeJob(
                    i, slices[i], survey.problems, data, seed, docs_quota[i], tokens_quota[i],
                    tokenizer_json, eos_id, dtype.name, key, str(staging),
                )
            )  # fmt: skip
        progress = tqdm(total=len(busy), initial=len(reused), desc="tokenize slices", unit="slice")
        tokens_done = shards_resumed = 0
        with progress:
            for record, resumed in map_unordered(_encode, encode_jobs):
                shards_resumed += resumed
                records[record["slice"]] = record
                tokens_done += sum(s["tokens"] for shards in record["shards"].values() for s in shards)
                rate = tokens_done / max(time.perf_counter() - started, 1e-9)
                progress.set_postfix(tokens=tokens_done, tok_per_s=f"{rate:.3g}")
                progress.update(1)

    bad = [line for i in busy for line in records[i]["stats"]["bad"]]
    for line in bad:
        log.warning("skipped %s", line)
    totals = {s: sum(sh["tokens"] for i in busy for sh in records[i]["shards"][s]) for s in SPLITS}
    documents = {s: sum(records[i]["documents"][s] for i in busy) for s in SPLITS}
    stats = {k: sum(records[i]["stats"][k] for i in busy) for k in ("read", "empty", "too_short", "undecodable")}
    if totals["train"] == 0 or totals["val"] == 0:
        raise DataError(
            f"corpus has no usable text for both splits: {stats['read']} documents read, {documents['train']} "
            f"for training and {documents['val']} for validation ({stats['empty']} empty, {stats['too_short']} "
            f"shorter than data.min_chars={data.min_chars}, {stats['undecodable']} not valid UTF-8); add text "
            f"or raise data.val_fraction={data.val_fraction}"
        )

    _assemble(
        out_dir,
        staging,
        records,
        reused,
        busy,
        raw_tokenizer,
        {
            "pipeline_format": FORMAT,
            "vocab_size": vocab_size,
            "dtype": dtype.name,
            "eos_id": eos_id,
            "tokenizer_sha256": tok_sha,
            "tokenizer_key": tokenizer_key,
            "source": {"kind": data.source, "description": _describe_source(data, units), "files": len(units)},
            "settings": settings,
            "documents": {**documents, "total_read": stats["read"] + stats["undecodable"]},
            "skipped": {k: stats[k] for k in ("empty", "too_short", "undecodable")},
            "bad_input": bad[:_LISTED_BAD],
            "tokens": totals,
        },
    )
    seconds = time.perf_counter() - started
    shards = {s: sum(len(records[i]["shards"][s]) for i in busy) for s in SPLITS}
    metrics = {
        "documents_read": stats["read"] + stats["undecodable"],
        "documents_train": documents["train"],
        "documents_val": documents["val"],
        "documents_cut_by_max_tokens": sum(records[i]["cut_by_max_tokens"] for i in busy),
        "skipped_empty": stats["empty"],
        "skipped_too_short": stats["too_short"],
        "skipped_undecodable": stats["undecodable"],
        "tokens_train": totals["train"],
        "tokens_val": totals["val"],
        "shards_train": shards["train"],
        "shards_val": shards["val"],
        "slices": len(busy),
        "slices_reused": len(reused),
        "shards_resumed": shards_resumed,
        "vocab_size": vocab_size,
        "workers": workers,
        "seconds": seconds,
        "tokens_per_s": (totals["train"] + totals["val"]) / max(seconds, 1e-9),
    }
    if metrics["shards_resumed"]:
        log.info("resumed an interrupted run: %d finished shards kept as they were", metrics["shards_resumed"])
    log.info(
        "tokenized %d documents (of %d read; %d skipped) into %d train + %d val tokens in %d+%d shards "
        "(%d of %d slices reused) in %.1fs (%.0f tokens/s)",
        documents["train"] + documents["val"], metrics["documents_read"],
        stats["empty"] + stats["too_short"] + stats["undecodable"], totals["train"], totals["val"],
        shards["train"], shards["val"], len(reused), len(busy), seconds, metrics["tokens_per_s"],
    )  # fmt: skip
    return metrics


def _tokenizer_from(raw: bytes, where: str):
    from tokenizers import Tokenizer

    try:
        tokenizer = Tokenizer.from_str(raw.decode("utf-8"))
    except Exception as exc:
        raise DataError(f"{where}: not a valid tokenizer.json ({exc})") from exc
    tokenizer.encode_special_tokens = True
    if tokenizer.token_to_id(EOS_TOKEN) is None:
        raise DataError(f"{where}: tokenizer has no {EOS_TOKEN!r} token")
    return tokenizer


def _assemble(
    out_dir: Path,
    staging: Path,
    records: dict[int, dict],
    reused: set[int],
    busy: list[int],
    raw_tokenizer: bytes,
    fields: dict,
) -> None:
    """Build the new output beside the old one and swap it in; the manifest is written last.

    Shards of reused slices are hard links to the old files (the same inode: neither rewritten nor
    rehashed by DVC); new ones are moved from the staging directory.
    """
    nxt = out_dir.parent / f".{out_dir.name}.next"
    shutil.rmtree(nxt, ignore_errors=True)
    nxt.mkdir(parents=True)
    known: dict[str, dict] = {}
    names: list[str] = []
    order: dict[str, list[dict]] = {s: [] for s in SPLITS}
    for i in busy:
        for split in SPLITS:
            for shard in records[i]["shards"][split]:
                source = (out_dir if i in reused else staging) / shard["path"]
                target = nxt / shard["path"]
                target.mkdir(parents=True)
                for name in (TOKENS, manifest.MANIFEST):
                    if i in reused:
                        os.link(source / name, target / name)
                    else:
                        os.replace(source / name, target / name)
                names += [f"{shard['path']}/{TOKENS}", f"{shard['path']}/{manifest.MANIFEST}"]
                known[f"{shard['path']}/{TOKENS}"] = {"bytes": shard["bytes"], "sha256": shard["sha256"]}
                order[split].append({"path": shard["path"], "tokens": shard["tokens"]})
    old_tokenizer = out_dir / TOKENIZER_NAME
    if old_tokenizer.is_file() and old_tokenizer.read_bytes() == raw_tokenizer:
        os.link(old_tokenizer, nxt / TOKENIZER_NAME)
    else:
        atomic_write_bytes(nxt / TOKENIZER_NAME, raw_tokenizer)
    names.append(TOKENIZER_NAME)
    manifest.write_manifest(
        nxt,
        KIND,
        names,
        known=known,
        shards=order,
        slices={f"{i:05d}": records[i] for i in busy},
        **fields,
    )
    replace_dir(nxt, out_dir)
