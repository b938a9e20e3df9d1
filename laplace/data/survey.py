"""The tokenize stage's survey, and the tokenizer sample it leaves: each slice (a worker per slice)
hashes its input (the fingerprints that decide which slices are reused) and keeps its share of a
seeded sample for the tokenizer: the train documents with the smallest keyed hash, at most its
quota of tokenizer.sample_bytes, in a file of its own sorted by that hash. The tokenizer reads
the sample back as one stream merged from those files (laplace.data.tokenize)."""

from __future__ import annotations

import hashlib
import heapq
import json
import os
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

from laplace.config import DataSection
from laplace.data.encode import val_score
from laplace.data.readers import slice_documents, stable_hash, unit_fingerprint
from laplace.data.units import SliceStats, Unit
from laplace.errors import DataError
from laplace.fileio import atomic_write_json


@dataclass
class SurveyJob:
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
class Survey:
    slice: int
    fingerprints: dict[str, str]
    problems: dict[str, str]
    sample_file: str = ""  # the slice's share of the sample (see SurveyJob), read back streaming


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


def _persisted_survey(job: SurveyJob) -> Survey | None:
    """The survey this stage run already finished for the slice (a job run again after its worker
    died, or resubmitted), when its result and sample are still there."""
    try:
        saved = json.loads(Path(job.result_file).read_text())
        if saved.pop("run") != job.run or (saved["sample_file"] and not Path(saved["sample_file"]).is_file()):
            return None
        return Survey(**saved)
    except (OSError, ValueError, KeyError, TypeError):
        return None


def survey_slice(job: SurveyJob) -> Survey:
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
    survey = Survey(job.slice, {name: digest for name, (digest, _) in found.items()}, problems)
    if job.sample_bytes:
        docs = slice_documents(job.units, problems, data, job.quota, SliceStats())
        train = (t for t in docs if val_score(t, job.seed) >= data.val_fraction)
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


def _read_sample(path: str) -> Iterator[tuple[int, str]]:
    with open(path, encoding="utf-8") as f:
        for line in f:
            key, text = json.loads(line)
            yield key, text


def merged_sample(sample_files: list[str]) -> Iterator[tuple[int, str]]:
    """The global sample, streamed: the slices' sorted files merged by keyed hash (a k-way merge:
    one document per slice in memory, never the sample). Each slice kept at most its quota of
    tokenizer.sample_bytes, so the whole is within it, on disk as in memory: no merged copy is
    written (the training reads the slices' files through this merge too)."""
    return heapq.merge(*(_read_sample(path) for path in sample_files))


def sample_digest(sample_files: list[str]) -> tuple[str, int, int]:
    """(sha256 of the sample, documents, bytes of text). On a Dask worker under executor: dask."""
    digest = hashlib.sha256()
    count = size = 0
    for key, text in merged_sample(sample_files):
        digest.update(_sample_line(key, text))
        size += len(text.encode("utf-8"))
        count += 1
    return digest.hexdigest(), count, size
