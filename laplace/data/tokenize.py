"""The tokenize stage's work: a corpus -> tokenizer.json and fixed-size token shards, streamed,
in parallel, resumable.

    survey   each slice (a worker per slice) hashes its input and keeps its share of a seeded
             sample for the tokenizer (the train documents with the smallest keyed hash, at most
             tokenizer.sample_bytes in all)
    train    the byte-level BPE on that sample (or tokenizer.from), reused when the sample is unchanged
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
import ctypes
import dataclasses
import errno
import hashlib
import heapq
import json
import logging
import os
import shutil
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from laplace import manifest
from laplace.config import DataSection, TokenizerSection
from laplace.data.pool import Workers, process_pool, runs_repeated, sigterm_unwinds
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
from laplace.data.tokenizer import (
    EOS_TOKEN,
    TOKENIZER_NAME,
    document_end_id,
    document_start_ids,
    given_tokenizer_file,
    train_reaching,
)
from laplace.errors import DataError, Failure, InputError, one_line
from laplace.fileio import atomic_write_bytes, atomic_write_json, fsync_dir, fsync_file
from laplace.progress import progress_bar
from laplace.tokenizer_file import load_tokenizer, tokenizer_sha256

if TYPE_CHECKING:
    from laplace.data.dask_executor import DaskWorkers

log = logging.getLogger(__name__)

FORMAT = 3  # bump when the bytes a slice produces change for the same input and settings
_ENCODE_BATCH_CHARS = 1 << 18  # documents are encoded in batches of about this much text (memory: ~300 B per char)
# The encoder holds ~300 bytes per character of one input while it pre-tokenizes it: a longer
# document is encoded as pieces of at most this many characters (cut where the byte-level
# pre-tokenizer cuts anyway, so the ids are the same) and its ids joined.
_ENCODE_PIECE_CHARS = 1 << 18
_LISTED_BAD = 100  # bad files named in the manifest (all are logged)


def _val_score(text: str, seed: int) -> float:
    """A uniform number in [0, 1) fixed by (seed, document text): duplicates land in the same split."""
    key = str(seed).encode()[:64]
    digest = hashlib.blake2b(text.encode("utf-8"), digest_size=8, key=key).digest()
    return int.from_bytes(digest, "little") / 2.0**64


class DiskFull(Failure):
    """No space left for the shards or the manifest: one line naming the file, not a traceback;
    a crash (retried), and the run resumes from the shards it finished once there is room."""


_FULL_DISK_ERRNOS = {errno.ENOSPC, errno.EDQUOT}


_PER_RUN = ("samples", "surveys", "runs", "workers")  # staging folders of one run, removed on every exit


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
    sample_bytes: int  # the slice's quota of tokenizer.sample_bytes, on disk; 0: no sample (tokenizer.from)
    sample_file: str = ""  # where the slice's sample goes, sorted by keyed hash (JSON lines [hash, text])
    result_file: str = ""  # where the survey's result is persisted before it is returned
    run: str = ""  # this stage run: a result persisted by the same run is returned as it is


@dataclass
class _Survey:
    slice: int
    fingerprints: dict[str, str]
    problems: dict[str, str]
    sample_file: str = ""  # the slice's share of the sample (see _SurveyJob), read back streaming


def _sample_line(key: int, text: str) -> bytes:
    """A sample document as the slice's sample file holds it (its bytes count against the quota)."""
    return (json.dumps([key, text], ensure_ascii=False) + "\n").encode("utf-8")


def _bounded_sample(texts: Iterator[str], seed: int, budget: int) -> list[tuple[int, str]]:
    """The texts with the smallest keyed hashes whose sample lines add up to at most `budget` bytes
    (so the slice's file, and what this worker holds, stay within its quota)."""
    heap: list[tuple[int, int, str]] = []  # max-heap on the hash (negated), with each line's size
    size = 0
    for text in texts:
        key = stable_hash("sample", str(seed), text)
        if heap and size >= budget and key > -heap[0][0]:
            continue
        line = len(_sample_line(key, text))
        if line > budget:
            continue
        heapq.heappush(heap, (-key, line, text))
        size += line
        while size > budget and heap:
            _, dropped, _ = heapq.heappop(heap)
            size -= dropped
    return sorted((-k, t) for k, _, t in heap)


def _persisted_survey(job: _SurveyJob) -> _Survey | None:
    """The survey this stage run already finished for the slice (a job run again after its worker
    died, or resubmitted), when its result and sample are still there."""
    try:
        saved = json.loads(Path(job.result_file).read_text())
        if saved.pop("run") != job.run or (saved["sample_file"] and not Path(saved["sample_file"]).is_file()):
            return None
        return _Survey(**saved)
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _survey(job: _SurveyJob) -> _Survey:
    """One slice's survey; its result persisted (job.result_file) before it is returned."""
    if job.result_file and (done := _persisted_survey(job)) is not None:
        return done
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
        # held here, in the worker, bounded by the budget; the stage only ever streams the files
        sample = _bounded_sample(train, job.seed, job.sample_bytes)
        path = Path(job.sample_file)
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(f"{path}.tmp", "wb") as f:
            for key, text in sample:
                f.write(_sample_line(key, text))
        os.replace(f"{path}.tmp", path)
        survey.sample_file = str(path)
    if job.result_file:
        Path(job.result_file).parent.mkdir(parents=True, exist_ok=True)
        atomic_write_json(Path(job.result_file), {**asdict(survey), "run": job.run})
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


def encode_slice(job: _EncodeJob) -> tuple[dict, int]:
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
        "max_record_bytes": data.max_record_bytes,
        "split_bytes": data.split_bytes,
        "val_fraction": data.val_fraction,
        "on_bad_file": data.on_bad_file,
        "text_field": data.text_field,
        "max_documents": data.max_documents,
        "max_tokens": data.max_tokens,
        "slices": data.slices,
        "shard_tokens": data.shard_tokens,
        "tokenizer": {"from": tok_cfg.from_}
        if tok_cfg.from_
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


def _read_sample(path: str) -> Iterator[tuple[int, str]]:
    with open(path, encoding="utf-8") as f:
        for line in f:
            key, text = json.loads(line)
            yield key, text


def _sample(sample_files: list[str]) -> Iterator[tuple[int, str]]:
    """The global sample, streamed: the slices' sorted files merged by keyed hash (a k-way merge:
    one document per slice in memory, never the sample). Each slice kept at most its quota of
    tokenizer.sample_bytes, so the whole is within it, on disk as in memory: no merged copy is
    written (the training reads the slices' files through this merge too)."""
    return heapq.merge(*(_read_sample(path) for path in sample_files))


def _sample_digest(sample_files: list[str]) -> tuple[str, int, int]:
    """(sha256 of the sample, documents, bytes of text). On a Dask worker under executor: dask."""
    digest = hashlib.sha256()
    count = size = 0
    for key, text in _sample(sample_files):
        digest.update(_sample_line(key, text))
        size += len(text.encode("utf-8"))
        count += 1
    return digest.hexdigest(), count, size


@dataclass
class _TrainJob:
    sample_files: list[str]
    vocab_size: int
    min_frequency: int
    note: str


def _train(job: _TrainJob) -> str:
    """In a child process of its own (SIGTERM stops it at once): the BPE trained on the sample."""
    texts = (text for _, text in _sample(job.sample_files))
    return train_reaching(texts, job.vocab_size, job.min_frequency, job.note).to_str(pretty=True)


def _tokenizer_bytes(
    tok_cfg: TokenizerSection,
    given: Path | None,
    surveys: list[_Survey],
    settings: dict,
    previous: dict,
    out_dir: Path,
    staging: Path,
    workers: Workers | DaskWorkers,
) -> tuple[bytes, str]:
    """tokenizer.json's bytes and the key of what made it: reused when the key is unchanged."""
    if given is not None:  # tokenizer.from
        load_tokenizer(given)  # validate before copying
        raw = given.read_bytes()
        return raw, hashlib.sha256(raw).hexdigest()
    sample_files = [s.sample_file for s in surveys if s.sample_file]
    sample_sha, count, size = workers.small(_sample_digest, sample_files, "tokenizer sample (digest)")
    key = _digest([settings["tokenizer"], settings["seed"], sample_sha])
    if previous.get("tokenizer_key") == key and (out_dir / TOKENIZER_NAME).is_file():
        return (out_dir / TOKENIZER_NAME).read_bytes(), key
    staged = staging / TOKENIZER_NAME
    if staged.is_file() and (staging / "tokenizer.key").is_file() and (staging / "tokenizer.key").read_text() == key:
        return staged.read_bytes(), key
    if not count:
        raise DataError(
            "corpus has no usable text: no train document of at least "
            f"data.min_chars={settings['min_chars']} characters that is valid UTF-8"
        )
    log.info("training the tokenizer on a sample of %d documents (%.1f MB)", count, size / 1e6)
    note = f"the sample ({count} documents, {size:,} bytes; tokenizer.sample_bytes={tok_cfg.sample_bytes:,})"
    job = _TrainJob(sample_files, tok_cfg.vocab_size, tok_cfg.min_frequency, note)
    raw = workers.call(_train, job, "tokenizer training").encode("utf-8")
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


MapSlices = Callable[[Callable, list], Iterable]


def tokenize_corpus(
    data: DataSection, tok_cfg: TokenizerSection, out_dir: Path, seed: int, map_slices: MapSlices | None = None
) -> dict:
    """The tokenize stage: corpus -> out_dir/{tokenizer.json, train/*, val/*, manifest.json}.

    Documents with len(text.strip()) < data.min_chars are skipped and counted; bad files are
    skipped and named (data.on_bad_file). A document goes to validation when a keyed hash of
    (seed, text) falls below data.val_fraction. The same input and settings give byte-identical
    files whatever data.num_proc. Returns flat metrics (counts, seconds, tokens_per_s).

    map_slices(encode_slice, jobs) -> results, in any order: runs the encode jobs somewhere else
    (a Dask cluster through Prefect, Ray, ...; every worker must see the staging directory). Each
    job is independent and resumable and writes its own result record. Default: the local pool.
    """
    out_dir = Path(out_dir)
    staging = staging_dir(out_dir)
    _recover(out_dir)
    staging.mkdir(parents=True, exist_ok=True)
    try:
        with sigterm_unwinds(), _datasets_cache_in(staging / "hf-cache"):
            metrics = _tokenize(data, tok_cfg, out_dir, staging, seed, map_slices)
    except OSError as exc:
        if exc.errno not in _FULL_DISK_ERRNOS:
            raise
        where = f" writing {exc.filename}" if exc.filename else ""
        raise DiskFull(
            f"tokenize: no space left on device{where} ({one_line(exc)}); {out_dir} left as it was, "
            "free some space and rerun to resume"
        ) from None
    except (SystemExit, KeyboardInterrupt):
        finished = sum(1 for split in SPLITS for _ in staging.glob(f"{split}/*/manifest.json"))
        if finished:
            log.warning(
                "tokenize interrupted: %s left as it was; %d finished shards kept in %s for the next run to resume",
                out_dir, finished, staging,
            )  # fmt: skip
        else:
            log.warning("tokenize interrupted: %s left as it was; no finished shard to resume from", out_dir)
        raise
    except InputError:  # refused: the input changes before a rerun, so nothing but finished shards is kept
        for name in (TOKENIZER_NAME, "tokenizer.key"):
            (staging / name).unlink(missing_ok=True)
        raise
    finally:
        for name in _PER_RUN:  # the sample, the surveys' results, the run ledger, the workers' tags
            shutil.rmtree(staging / name, ignore_errors=True)
        _remove_temporaries(staging)
        shutil.rmtree(_next_dir(out_dir), ignore_errors=True)  # never the live output (see _swap)
    _assembly_step("removing the staging directory")
    shutil.rmtree(staging, ignore_errors=True)
    return metrics


@contextlib.contextmanager
def _executor(data: DataSection, busy: int, staging: Path, ledger: Path, map_slices: MapSlices | None):
    """Where the slices run: data.executor's pool (the local one, or a Dask cluster), closed on the way out."""
    if data.executor == "dask" and map_slices is None:
        from laplace.data.dask_executor import dask_pool  # distributed only when asked for

        with dask_pool(data.dask_address, data.num_proc, ledger, data.dask_in_flight) as pool:
            yield pool
        return
    with process_pool(max(1, min(data.num_proc, busy)), staging / "workers", ledger) as pool:
        yield pool


@dataclass(frozen=True)
class _Plan:
    """One run's slices and what each may take: read by every phase of `_tokenize`."""

    data: DataSection
    units: list[Unit]
    slices: list[list[Unit]]
    busy: list[int]  # the slices with input (the rest are empty)
    docs_quota: dict[int, int]
    tokens_quota: dict[int, int]
    settings: dict
    seed: int
    staging: Path
    run: str  # this run's id in the workers' ledger


@dataclass(frozen=True)
class _TokenizerUsed:
    """The tokenizer every slice is encoded with, and the figures the manifest records of it."""

    raw: bytes
    key: str
    json: str
    sha256: str
    vocab_size: int
    dtype: np.dtype
    eos_id: int
    start_ids: list[int]


def _plan(data: DataSection, tok_cfg: TokenizerSection, staging: Path, seed: int) -> _Plan:
    if data.source == "python-docs" and not Path(data.path).exists():
        # Outside DVC (no corpus stage ran): the same files the corpus stage writes, generated once
        # here rather than in every worker; the shards are identical either way.
        data = dataclasses.replace(data, path=str(staging / "python-docs"))
        write_python_docs(Path(data.path))
    units = corpus_units(data)
    slices = plan_slices(units, data.slices)
    busy = [i for i, s in enumerate(slices) if s]
    return _Plan(
        data, units, slices, busy,
        docs_quota={i: _quota(data.max_documents, k, len(busy)) for k, i in enumerate(busy)},
        tokens_quota={i: _quota(data.max_tokens, k, len(busy)) for k, i in enumerate(busy)},
        settings=_settings(data, tok_cfg, seed), seed=seed, staging=staging, run=os.urandom(8).hex(),
    )  # fmt: skip


def _surveys(plan: _Plan, tok_cfg: TokenizerSection, pool) -> list[_Survey]:
    """Survey every slice (its fingerprints, problems and share of the tokenizer sample), in slice order."""
    # each slice's quota of the sample (an even share, like max_documents): the whole sample is
    # within tokenizer.sample_bytes on disk, and a survey worker holds at most its slice's quota
    busy, staging = plan.busy, plan.staging
    sample_quota = {i: 0 if tok_cfg.from_ else _quota(tok_cfg.sample_bytes, k, len(busy)) for k, i in enumerate(busy)}
    jobs = [
        _SurveyJob(
            i, plan.slices[i], plan.data, plan.seed, plan.docs_quota[i], sample_quota[i],
            str(staging / f"samples/{i:05d}.jsonl"), str(staging / f"surveys/{i:05d}.json"), plan.run,
        )
        for i in busy
    ]  # fmt: skip
    survey_of = pool.map_unordered(_survey, jobs, lambda j: f"slice {j.slice:05d} (survey)")
    surveys = list(progress_bar(survey_of, total=len(jobs), desc="survey slices", unit="slice"))
    return sorted(surveys, key=lambda s: s.slice)


def _tokenizer_used(
    plan: _Plan, tok_cfg: TokenizerSection, surveys: list[_Survey], previous: dict, out_dir: Path, pool
) -> _TokenizerUsed:
    """tokenizer.from, or the BPE trained on the surveys' sample (reused when that is unchanged)."""
    given = given_tokenizer_file(tok_cfg.from_) if tok_cfg.from_ else None
    raw, key = _tokenizer_bytes(tok_cfg, given, surveys, plan.settings, previous, out_dir, plan.staging, pool)
    tokenizer = _tokenizer_from(raw, str(given or plan.staging / TOKENIZER_NAME))
    vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
    return _TokenizerUsed(
        raw, key, tokenizer.to_str(), tokenizer_sha256(tokenizer), vocab_size,
        dtype=np.dtype("<u2") if vocab_size <= 1 << 16 else np.dtype("<u4"),
        eos_id=document_end_id(tokenizer, given), start_ids=document_start_ids(tokenizer),
    )  # fmt: skip


def _encode_jobs(
    plan: _Plan, surveys: list[_Survey], tok: _TokenizerUsed, previous: dict, out_dir: Path
) -> tuple[dict[int, dict], list[_EncodeJob]]:
    """The previous output's records of the slices whose key is unchanged, and a job for each other one."""
    records: dict[int, dict] = {}
    jobs = []
    for survey in surveys:
        i = survey.slice
        key = _digest(
            {
                "format": FORMAT,
                "tokenizer": tok.sha256,
                "settings": {k: v for k, v in plan.settings.items() if k != "tokenizer"},
                "dtype": tok.dtype.name,
                "quota": [plan.docs_quota[i], plan.tokens_quota[i]],
                "units": [(u.name, u.kind, survey.fingerprints[u.name]) for u in plan.slices[i]],
                **({"start_ids": tok.start_ids} if tok.start_ids else {}),  # shards from before BOS was kept
            }
        )
        if (record := _reusable(previous, out_dir, i, key)) is not None:
            records[i] = record
            continue
        jobs.append(
            _EncodeJob(
                i, plan.slices[i], survey.problems, plan.data, plan.seed, plan.docs_quota[i], plan.tokens_quota[i],
                tok.json, tok.eos_id, tok.start_ids, tok.dtype.name, key, str(plan.staging),
            )
        )  # fmt: skip
    return records, jobs


def _encode(plan: _Plan, jobs: list[_EncodeJob], records: dict[int, dict], pool, map_slices, started: float) -> int:
    """Run the encode jobs (the pool, or map_slices), adding each slice's record; returns the shards resumed."""
    progress = progress_bar(total=len(plan.busy), initial=len(records), desc="tokenize slices", unit="slice")
    tokens_done = shards_resumed = 0
    with progress:
        if map_slices is None:
            done = pool.map_unordered(encode_slice, jobs, lambda j: f"slice {j.slice:05d} (encode)")
        else:
            done = map_slices(encode_slice, jobs)
        for record, resumed in done:
            shards_resumed += resumed
            records[record["slice"]] = record
            tokens_done += sum(s["tokens"] for shards in record["shards"].values() for s in shards)
            rate = tokens_done / max(time.perf_counter() - started, 1e-9)
            progress.set_postfix(tokens=tokens_done, tok_per_s=f"{rate:.3g}", refresh=False)
            progress.update(1)
    return shards_resumed


_SKIPPED = ("empty", "too_short", "undecodable", "too_large")  # too_large: absent in older records


@dataclass(frozen=True)
class _Totals:
    tokens: dict[str, int]
    documents: dict[str, int]
    stats: dict[str, int]  # documents read, and skipped by each reason
    bad: list[str]  # bad input, one line each

    @property
    def documents_read(self) -> int:
        return self.stats["read"] + self.stats["undecodable"] + self.stats["too_large"]


def _totals(plan: _Plan, records: dict[int, dict]) -> _Totals:
    """Every slice's counts summed; DataError when a split would be empty."""
    busy, data = plan.busy, plan.data
    bad = [line for i in busy for line in records[i]["stats"]["bad"]]
    for line in bad:
        log.warning("skipped %s", line)
    totals = _Totals(
        tokens={s: sum(sh["tokens"] for i in busy for sh in records[i]["shards"][s]) for s in SPLITS},
        documents={s: sum(records[i]["documents"][s] for i in busy) for s in SPLITS},
        stats={k: sum(records[i]["stats"].get(k, 0) for i in busy) for k in ("read", *_SKIPPED)},
        bad=bad,
    )
    if totals.tokens["train"] == 0 or totals.tokens["val"] == 0:
        stats, documents = totals.stats, totals.documents
        raise DataError(
            f"corpus has no usable text for both splits: {stats['read']} documents read, {documents['train']} "
            f"for training and {documents['val']} for validation ({stats['empty']} empty, {stats['too_short']} "
            f"shorter than data.min_chars={data.min_chars}, {stats['undecodable']} not valid UTF-8); add text "
            f"or raise data.val_fraction={data.val_fraction}"
        )
    return totals


def _manifest_fields(plan: _Plan, tok: _TokenizerUsed, totals: _Totals) -> dict:
    return {
        "pipeline_format": FORMAT,
        "vocab_size": tok.vocab_size,
        "dtype": tok.dtype.name,
        "eos_id": tok.eos_id,
        "document_start_ids": tok.start_ids,
        "tokenizer_sha256": tok.sha256,
        "tokenizer_key": tok.key,
        "source": {
            "kind": plan.data.source,
            "description": _describe_source(plan.data, plan.units),
            "files": len(plan.units),
        },
        "settings": plan.settings,
        "documents": {**totals.documents, "total_read": totals.documents_read},
        "skipped": {k: totals.stats[k] for k in _SKIPPED},
        "bad_input": totals.bad[:_LISTED_BAD],
        "tokens": totals.tokens,
    }


def _metrics(plan: _Plan, tok: _TokenizerUsed, totals: _Totals, records: dict, run_facts: dict) -> dict:
    """The stage's flat metrics, and the one log line that says them."""
    busy, stats, tokens, documents = plan.busy, totals.stats, totals.tokens, totals.documents
    shards = {s: sum(len(records[i]["shards"][s]) for i in busy) for s in SPLITS}
    seconds = run_facts["seconds"]
    metrics = {
        "documents_read": totals.documents_read,
        "documents_train": documents["train"],
        "documents_val": documents["val"],
        "documents_cut_by_max_tokens": sum(records[i]["cut_by_max_tokens"] for i in busy),
        **{f"skipped_{k}": stats[k] for k in _SKIPPED},
        "tokens_train": tokens["train"],
        "tokens_val": tokens["val"],
        "shards_train": shards["train"],
        "shards_val": shards["val"],
        "slices": len(busy),
        "slices_reused": run_facts["slices_reused"],
        "shards_resumed": run_facts["shards_resumed"],
        "vocab_size": tok.vocab_size,
        "executor": run_facts["executor"],
        "workers": run_facts["workers"],
        "slices_rerun": run_facts["slices_rerun"],
        "seconds": seconds,
        "tokens_per_s": (tokens["train"] + tokens["val"]) / max(seconds, 1e-9),
    }
    if metrics["shards_resumed"]:
        log.info("resumed an interrupted run: %d finished shards kept as they were", metrics["shards_resumed"])
    log.info(
        "tokenized %d documents (of %d read; %d skipped) into %d train + %d val tokens in %d+%d shards "
        "(%d of %d slices reused) in %.1fs (%.0f tokens/s)",
        documents["train"] + documents["val"], metrics["documents_read"], sum(stats[k] for k in _SKIPPED),
        tokens["train"], tokens["val"], shards["train"], shards["val"], metrics["slices_reused"], len(busy), seconds,
        metrics["tokens_per_s"],
    )  # fmt: skip
    return metrics


def _tokenize(
    data: DataSection, tok_cfg: TokenizerSection, out_dir: Path, staging: Path, seed: int, map_slices: MapSlices | None
) -> dict:
    """survey -> the tokenizer -> encode the changed slices -> assemble (the module's docstring)."""
    started = time.perf_counter()
    plan = _plan(data, tok_cfg, staging, seed)
    previous = _previous(out_dir)
    ledger = staging / "runs"
    shutil.rmtree(ledger, ignore_errors=True)  # runs are counted per stage run
    ledger.mkdir(parents=True)
    with _executor(plan.data, len(plan.busy), staging, ledger, map_slices) as pool:
        surveys = _surveys(plan, tok_cfg, pool)
        tok = _tokenizer_used(plan, tok_cfg, surveys, previous, out_dir, pool)
        records, jobs = _encode_jobs(plan, surveys, tok, previous, out_dir)
        reused = set(records)
        shards_resumed = _encode(plan, jobs, records, pool, map_slices, started)
        workers = pool.num_proc

    repeated = runs_repeated(ledger)  # a job run again in this run: a recompute after a lost worker
    for name, n in repeated.items():
        log.info("%s ran %d more time(s) (its worker was lost)", name, n)
    totals = _totals(plan, records)
    _assemble(out_dir, staging, records, reused, plan.busy, tok.raw, _manifest_fields(plan, tok, totals))
    run_facts = {
        "seconds": time.perf_counter() - started,
        "slices_reused": len(reused),
        "shards_resumed": shards_resumed,
        "executor": plan.data.executor if map_slices is None else "map_slices",
        "workers": workers,
        "slices_rerun": sum(repeated.values()),
    }
    return _metrics(plan, tok, totals, records, run_facts)


def _tokenizer_from(raw: bytes, where: str):
    from tokenizers import Tokenizer

    try:
        tokenizer = Tokenizer.from_str(raw.decode("utf-8"))
    except Exception as exc:
        raise DataError(f"{where}: not a valid tokenizer.json ({exc})") from exc
    tokenizer.encode_special_tokens = True
    if document_end_id(tokenizer, where) is None:
        raise DataError(
            f"{where}: tokenizer has no {EOS_TOKEN!r} token, and no config.json or tokenizer_config.json beside it "
            "names its end-of-sequence token"
        )
    return tokenizer


def _assembly_step(name: str) -> None:
    """Called at each step of the assembly (a no-op): the crash tests kill the stage here."""


def _next_dir(out_dir: Path) -> Path:
    return out_dir.parent / f".{out_dir.name}.next"


def _old_dir(out_dir: Path) -> Path:
    return out_dir.parent / f".{out_dir.name}.old"


def _recover(out_dir: Path) -> None:
    """Undo what a run killed during the assembly left: a half-built (or swapped-out) `.next`, and
    the previous output parked as `.old` when the swap is two renames (see _swap)."""
    old = _old_dir(out_dir)
    if old.is_dir() and not out_dir.exists():
        os.replace(old, out_dir)  # killed between the two renames: the previous output comes back
    shutil.rmtree(old, ignore_errors=True)
    shutil.rmtree(_next_dir(out_dir), ignore_errors=True)


_RENAME_EXCHANGE = 2


def _swap(nxt: Path, out_dir: Path) -> None:
    """Put `nxt` in place of `out_dir` in one step: renameat2(RENAME_EXCHANGE) swaps the two names
    atomically (Linux 3.15+, most local filesystems), so a kill leaves either output. Elsewhere two
    renames, with the previous output parked as `.old` for _recover to put back."""
    for p in nxt.rglob("*"):
        if p.is_file():
            fsync_file(p)
    fsync_dir(nxt)
    if out_dir.exists() and sys.platform == "linux":
        libc = ctypes.CDLL(None, use_errno=True)
        at_fdcwd = -100
        if libc.renameat2(at_fdcwd, os.fsencode(nxt), at_fdcwd, os.fsencode(out_dir), _RENAME_EXCHANGE) == 0:
            fsync_dir(out_dir.parent)
            _assembly_step("swapped")
            shutil.rmtree(nxt, ignore_errors=True)  # now the previous output
            return
    if out_dir.exists():
        os.replace(out_dir, _old_dir(out_dir))
        _assembly_step("parked")
    os.replace(nxt, out_dir)
    fsync_dir(out_dir.parent)
    _assembly_step("swapped")
    shutil.rmtree(_old_dir(out_dir), ignore_errors=True)


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

    Every shard is a hard link: to the old output's file for a reused slice (the same inode:
    neither rewritten nor rehashed by DVC), to the staged file for a new one. Nothing is moved out
    of the staging directory until the new output is in place, so a kill at any step leaves the old
    output or the new one, and the staging directory to resume from (tests kill at each step).
    """
    nxt = _next_dir(out_dir)
    shutil.rmtree(nxt, ignore_errors=True)
    nxt.mkdir(parents=True)
    _assembly_step("started")
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
                    os.link(source / name, target / name)
                _assembly_step("linked a shard")
                names += [f"{shard['path']}/{TOKENS}", f"{shard['path']}/{manifest.MANIFEST}"]
                known[f"{shard['path']}/{TOKENS}"] = {"bytes": shard["bytes"], "sha256": shard["sha256"]}
                order[split].append({"path": shard["path"], "tokens": shard["tokens"]})
    old_tokenizer = out_dir / TOKENIZER_NAME
    if old_tokenizer.is_file() and old_tokenizer.read_bytes() == raw_tokenizer:
        os.link(old_tokenizer, nxt / TOKENIZER_NAME)
    else:
        atomic_write_bytes(nxt / TOKENIZER_NAME, raw_tokenizer)
    names.append(TOKENIZER_NAME)
    _assembly_step("wrote the tokenizer")
    manifest.write_manifest(
        nxt,
        KIND,
        names,
        known=known,
        shards=order,
        slices={f"{i:05d}": records[i] for i in busy},
        **fields,
    )
    _assembly_step("wrote the manifest")
    _swap(nxt, out_dir)
