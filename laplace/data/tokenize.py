"""The tokenize stage's work: a corpus -> tokenizer.json and fixed-size token shards, streamed,
in parallel, resumable.

    survey   each slice (a worker per slice) hashes its input and keeps its share of a seeded
             sample for the tokenizer (the train documents with the smallest keyed hash, at most
             tokenizer.sample_bytes in all): laplace.data.survey
    train    the byte-level BPE on that sample (or tokenizer.from), reused when the sample is unchanged
    encode   each slice is streamed through the tokenizer into shards of data.shard_tokens tokens,
             <split>/<slice>-<part>/{tokens.bin, manifest.json}; a shard is finished when its
             manifest is written, and records where in the slice it ends: laplace.data.encode
    assemble the new output directory is built beside the old one (unchanged shards hard-linked,
             never rewritten), the manifest written last, and swapped in: laplace.data.assembly

This module plans the slices, trains the tokenizer, runs the phases on the workers and writes the
stage's figures. Work goes to `.<out>.partial/` beside the output: a killed run resumes from the
shards it finished there; a failed one leaves the previous output untouched. The worker pool is
in laplace.data.pool, the shard writer in laplace.data.shards.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import hashlib
import json
import logging
import os
import shutil
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from laplace import manifest
from laplace.config import DataSection, TokenizerSection
from laplace.data import assembly  # through the module: the crash tests replace assembly.assembly_step
from laplace.data.encode import LISTED_BAD, EncodeJob, encode_slice
from laplace.data.pool import Workers, process_pool, runs_repeated, sigterm_unwinds
from laplace.data.readers import corpus_units, plan_slices, write_python_docs
from laplace.data.shards import KIND, SPLITS, TOKENS
from laplace.data.survey import Survey, SurveyJob, merged_sample, sample_digest, survey_slice
from laplace.data.tokenizer import (
    EOS_TOKEN,
    TOKENIZER_NAME,
    document_end_id,
    document_start_ids,
    given_tokenizer_file,
    train_reaching,
)
from laplace.data.units import Unit
from laplace.errors import DataError, Failure, InputError, one_line
from laplace.fileio import atomic_write_bytes
from laplace.progress import progress_bar
from laplace.tokenizer_file import load_tokenizer, tokenizer_sha256

if TYPE_CHECKING:
    from laplace.data.dask_executor import DaskWorkers

log = logging.getLogger(__name__)

FORMAT = 3  # bump when the bytes a slice produces change for the same input and settings


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


@dataclass
class _TrainJob:
    sample_files: list[str]
    vocab_size: int
    min_frequency: int
    note: str


def _train(job: _TrainJob) -> str:
    """In a child process of its own (SIGTERM stops it at once): the BPE trained on the sample."""
    texts = (text for _, text in merged_sample(job.sample_files))
    return train_reaching(texts, job.vocab_size, job.min_frequency, job.note).to_str(pretty=True)


def _tokenizer_bytes(
    tok_cfg: TokenizerSection,
    given: Path | None,
    surveys: list[Survey],
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
    sample_sha, count, size = workers.small(sample_digest, sample_files, "tokenizer sample (digest)")
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
    assembly.recover(out_dir)
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
        shutil.rmtree(assembly.next_dir(out_dir), ignore_errors=True)  # never the live output (see assembly._swap)
    assembly.assembly_step("removing the staging directory")
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


def _surveys(plan: _Plan, tok_cfg: TokenizerSection, pool) -> list[Survey]:
    """Survey every slice (its fingerprints, problems and share of the tokenizer sample), in slice order."""
    # each slice's quota of the sample (an even share, like max_documents): the whole sample is
    # within tokenizer.sample_bytes on disk, and a survey worker holds at most its slice's quota
    busy, staging = plan.busy, plan.staging
    sample_quota = {i: 0 if tok_cfg.from_ else _quota(tok_cfg.sample_bytes, k, len(busy)) for k, i in enumerate(busy)}
    jobs = [
        SurveyJob(
            i, plan.slices[i], plan.data, plan.seed, plan.docs_quota[i], sample_quota[i],
            str(staging / f"samples/{i:05d}.jsonl"), str(staging / f"surveys/{i:05d}.json"), plan.run,
        )
        for i in busy
    ]  # fmt: skip
    survey_of = pool.map_unordered(survey_slice, jobs, lambda j: f"slice {j.slice:05d} (survey)")
    surveys = list(progress_bar(survey_of, total=len(jobs), desc="survey slices", unit="slice"))
    return sorted(surveys, key=lambda s: s.slice)


def _tokenizer_used(
    plan: _Plan, tok_cfg: TokenizerSection, surveys: list[Survey], previous: dict, out_dir: Path, pool
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
    plan: _Plan, surveys: list[Survey], tok: _TokenizerUsed, previous: dict, out_dir: Path
) -> tuple[dict[int, dict], list[EncodeJob]]:
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
            EncodeJob(
                i, plan.slices[i], survey.problems, plan.data, plan.seed, plan.docs_quota[i], plan.tokens_quota[i],
                tok.json, tok.eos_id, tok.start_ids, tok.dtype.name, key, str(plan.staging),
            )
        )  # fmt: skip
    return records, jobs


def _encode(plan: _Plan, jobs: list[EncodeJob], records: dict[int, dict], pool, map_slices, started: float) -> int:
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
        "bad_input": totals.bad[:LISTED_BAD],
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
    assembly.assemble(out_dir, staging, records, reused, plan.busy, tok.raw, _manifest_fields(plan, tok, totals))
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
