"""The tokenize stage's processes (laplace/data/pool.py and the stage around it) under the
faults of FineWeb scale, each in a real child process: a worker killed mid-encode (what the OOM
killer does) fails the stage at once, naming the slice; SIGTERM during tokenizer training stops
it at once; a kill at every step of the final assembly leaves the old output or the new one and
the rerun succeeds; one huge record is tokenized under a 1 GB address-space cap; one large file
keeps every worker busy."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_tokenize import alive, write_corpus

from laplace.config import DataSection, TokenizerSection
from laplace.data.pydocs import python_docs_documents
from laplace.data.tokenize import staging_dir, tokenize_corpus
from laplace.data.tokenizer import train_tokenizer

from project import ROOT, descendants, env

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def tokenizer_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    train_tokenizer(python_docs_documents()[:400], 1024, 2).save(str(path))
    return path


# The stage as `laplace tokenize` runs it (a Failure is one line, status 1; bad input status 2),
# with settings from argv; `kill_at` kills the process with SIGKILL at that step of the assembly.
CHILD = """
import json, os, resource, signal, sys
spec = json.loads(sys.argv[1])
if spec.get("address_space"):
    resource.setrlimit(resource.RLIMIT_AS, (spec["address_space"], spec["address_space"]))
from laplace.config import DataSection, TokenizerSection
from laplace.data import assembly, tokenize
from laplace.errors import Failure, InputError
if spec.get("kill_at"):
    def step(name):
        if name == spec["kill_at"]:
            os.kill(os.getpid(), signal.SIGKILL)
    assembly.assembly_step = step
try:
    metrics = tokenize.tokenize_corpus(DataSection(**spec["data"]), TokenizerSection(**spec["tok"]), spec["out"], 0)
except InputError as exc:
    print(f"laplace tokenize: error: {exc}", file=sys.stderr); sys.exit(2)
except Failure as exc:
    print(f"laplace tokenize: error: {exc}", file=sys.stderr); sys.exit(1)
# VmHWM: this process image's peak RSS (ru_maxrss survives exec: a child of a big pytest reads pytest's)
metrics["self_kb"] = int(next(l for l in open("/proc/self/status") if l.startswith("VmHWM")).split()[1])
metrics["torch_imported"] = "torch" in sys.modules
print(json.dumps(metrics))
"""


def child(spec: dict, **kw) -> subprocess.Popen:
    args = [sys.executable, "-c", CHILD, json.dumps(spec)]
    e = env(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", MALLOC_ARENA_MAX="2")
    return subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=e, **kw)


def tags(staging: Path) -> dict[int, str]:
    """Which job each worker holds now (the pool's tag files)."""
    out = {}
    for tag in (staging / "workers").glob("[0-9]*") if (staging / "workers").is_dir() else []:
        try:
            out[int(tag.name)] = tag.read_text()
        except OSError:
            pass
    return out


def wait_for(predicate, proc: subprocess.Popen, seconds: float = 300):
    deadline = time.monotonic() + seconds
    while not (found := predicate()):
        assert proc.poll() is None, f"finished first: {proc.stderr.read()[-2000:]}"
        assert time.monotonic() < deadline
        time.sleep(0.02)
    return found


def gone(pids) -> list[int]:
    deadline = time.monotonic() + 10
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    return [p for p in pids if alive(p)]


def test_a_worker_killed_mid_encode_fails_the_stage_in_seconds_naming_the_slice(tmp_path, tokenizer_file):
    corpus, out = tmp_path / "corpus", tmp_path / "out"
    write_corpus(corpus, 12, files=4)
    data = {"source": "files", "path": str(corpus), "num_proc": 2, "slices": 4, "shard_tokens": 50_000}
    proc = child({"data": data, "tok": {"from_": str(tokenizer_file)}, "out": str(out)})
    staging = staging_dir(out)
    held = wait_for(lambda: {p: j for p, j in tags(staging).items() if "(encode)" in j}, proc)
    pid, job = next(iter(held.items()))
    workers = descendants(proc.pid)
    killed = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    status = proc.wait(timeout=30)  # multiprocessing.Pool waited forever here
    elapsed = time.monotonic() - killed
    stderr = proc.stderr.read()
    assert status == 1, stderr[-2000:]  # a crash (retried), not bad input (2)
    last = stderr.strip().splitlines()[-1]
    assert last.startswith("laplace tokenize: error: tokenize worker") and job in last, last
    assert "killed by SIGKILL" in last and "Traceback" not in stderr
    assert elapsed < 30
    assert gone(workers) == [], "workers left running"
    assert not out.exists()


def test_sigterm_during_tokenizer_training_stops_the_stage_at_once(tmp_path):
    corpus, out = tmp_path / "corpus", tmp_path / "out"
    write_corpus(corpus, 6, files=2)
    data = {"source": "files", "path": str(corpus), "num_proc": 1, "slices": 2}
    tok = {"vocab_size": 8000, "min_frequency": 1, "sample_bytes": 6_000_000}
    proc = child({"data": data, "tok": tok, "out": str(out)})
    wait_for(lambda: "tokenizer training" in tags(staging_dir(out)).values(), proc)
    workers = descendants(proc.pid)
    assert workers, "training runs in a child process"
    sent = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    status = proc.wait(timeout=30)
    assert status == 128 + signal.SIGTERM
    assert time.monotonic() - sent < 10  # not when training ends
    assert gone(workers) == []


STEPS = ["started", "linked a shard", "wrote the tokenizer", "wrote the manifest", "swapped",
         "removing the staging directory"]  # fmt: skip


def manifest_of(out: Path) -> str:
    return (out / "manifest.json").read_text() if (out / "manifest.json").is_file() else ""


def verified(out: Path) -> bool:
    """Every file the manifest lists is there with its size."""
    found = json.loads(manifest_of(out))
    return all((out / name).stat().st_size == entry["bytes"] for name, entry in found["files"].items())


def test_a_kill_at_each_step_of_the_assembly_leaves_old_or_new_and_the_rerun_succeeds(tmp_path, tokenizer_file):
    corpus = tmp_path / "corpus"
    write_corpus(corpus, 0.4, files=6)
    data = DataSection(source="files", path=str(corpus), num_proc=1, slices=3, shard_tokens=5_000)
    tok = TokenizerSection(from_=str(tokenizer_file))
    old = tmp_path / "old"
    tokenize_corpus(data, tok, old, 0)
    with open(corpus / "part-00.jsonl", "a") as f:  # one slice changes, the others are reused
        f.write(json.dumps({"text": "A new document appended to the corpus, long enough to be kept. " * 20}) + "\n")
    new = tmp_path / "new"
    tokenize_corpus(data, tok, new, 0)
    assert manifest_of(new) != manifest_of(old)

    spec = {"data": {"source": "files", "path": str(corpus), "num_proc": 1, "slices": 3, "shard_tokens": 5_000},
            "tok": {"from_": str(tokenizer_file)}}  # fmt: skip
    for step in STEPS:
        out = tmp_path / f"out-{step.replace(' ', '-')}"
        shutil.copytree(old, out)
        proc = child({**spec, "out": str(out), "kill_at": step})
        assert proc.wait(timeout=300) == -signal.SIGKILL, (step, proc.stderr.read()[-2000:])
        assert manifest_of(out) in (manifest_of(old), manifest_of(new)), step  # the old output or the new
        assert verified(out), step
        rerun = child({**spec, "out": str(out)})
        assert rerun.wait(timeout=300) == 0, (step, rerun.stderr.read()[-2000:])  # never a traceback
        assert manifest_of(out) == manifest_of(new), step
        for path in new.rglob("*"):
            if path.is_file():
                assert (out / path.relative_to(new)).read_bytes() == path.read_bytes(), (step, path)
        assert not staging_dir(out).exists() and not (tmp_path / f".{out.name}.next").exists(), step


def test_a_200_mb_record_is_tokenized_under_a_1_gb_address_space_cap(tmp_path, tokenizer_file):
    """The whole stage process (num_proc 1: the encoder runs in it) under RLIMIT_AS of 1 GB; torch
    is never imported by the stage. The record is real text with non-Latin-1 characters (CPython
    would store it decoded at 2 bytes a character): its bytes are held once and parsed a piece at a
    time (long_records), cut into documents of 1M characters, each encoded 256K characters at a
    time; the peak RSS stays under 2x the record.
    Lean: data.max_tokens stops the train split after a few pieces (the rest are read, cut and
    counted, not encoded); the peak is while the first pieces are encoded with the whole record
    held, and the writer streams, so encoding all 198 pieces peaks the same (measured: 564 MB peak
    RSS for all 148M tokens, in 282 s on the shared machine)."""
    corpus, out = tmp_path / "corpus", tmp_path / "out"
    corpus.mkdir()
    line = " ".join(f"w{i % 50}ж" for i in range(200)) + "\\n"  # JSON-escaped newline: one huge string
    with open(corpus / "big.jsonl", "w", encoding="utf-8") as f:
        f.write(json.dumps({"text": "A small record before the huge one. " * 4}) + "\n")
        f.write('{"text": "')
        chars = 0
        for k in range(200_000_000 // len(line.encode())):  # numbered lines: every piece a different document
            chars += f.write(f"{k} {line}")
        f.write('"}\n')
        f.write(json.dumps({"text": "A small record after the huge one. " * 4}) + "\n")
    assert (corpus / "big.jsonl").stat().st_size > 200_000_000
    data = {"source": "files", "path": str(corpus), "num_proc": 1, "slices": 1, "split_bytes": 1 << 40,
            "max_tokens": 2_000_000, "val_fraction": 0.02}  # fmt: skip
    proc = child({"data": data, "tok": {"from_": str(tokenizer_file)}, "out": str(out), "address_space": 1 << 30})
    stdout, stderr = proc.communicate(timeout=900)
    assert proc.returncode == 0, stderr[-3000:]
    metrics = json.loads(stdout.strip().splitlines()[-1])
    pieces = metrics["documents_train"] + metrics["documents_val"] + metrics["documents_cut_by_max_tokens"]
    assert pieces >= 2 + chars // 1_000_000, metrics  # 2 small records + the huge one in documents of <= 1M chars
    assert metrics["tokens_train"] >= 2_000_000 and metrics["documents_val"] >= 1
    assert metrics["skipped_undecodable"] == 0 and not metrics["torch_imported"]
    record = (corpus / "big.jsonl").stat().st_size
    assert metrics["self_kb"] * 1024 < 2 * record, (metrics["self_kb"], record)  # about 2x the record at most
    print(f"peak RSS {metrics['self_kb'] / 1024:.0f} MB for a record of {record / 1e6:.0f} MB")


def test_a_one_file_corpus_keeps_both_workers_busy(tmp_path, tokenizer_file):
    corpus, out = tmp_path / "corpus", tmp_path / "out"
    write_corpus(corpus, 8, files=1)
    data = {"source": "files", "path": str(corpus), "num_proc": 2, "slices": 4, "split_bytes": 1_000_000}
    proc = child({"data": data, "tok": {"from_": str(tokenizer_file)}, "out": str(out)})
    staging = staging_dir(out)
    busy = wait_for(lambda: (t := tags(staging)) and len([j for j in t.values() if "(encode)" in j]) == 2 and t, proc)
    assert len(set(busy.values())) == 2  # two slices of the one file at once
    stdout, stderr = proc.communicate(timeout=600)
    assert proc.returncode == 0, stderr[-2000:]
    one = json.loads(stdout.strip().splitlines()[-1])
    assert one["slices"] == 4 and one["workers"] == 2
    serial = tmp_path / "serial"  # and byte-identical to one process
    tokenize_corpus(DataSection(**{**data, "num_proc": 1}), TokenizerSection(from_=str(tokenizer_file)), serial, 0)
    for path in serial.rglob("*"):
        if path.is_file():
            assert (out / path.relative_to(serial)).read_bytes() == path.read_bytes(), path
