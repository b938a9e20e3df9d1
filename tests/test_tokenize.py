"""Tokenization at scale, end to end: memory that does not grow with the corpus, kills (SIGKILL,
SIGTERM) that leave no process behind and resume to byte-identical shards, the corpus as a DVC
dependency (append -> tokenize reruns, unchanged shards kept), and training on sharded
data that does not depend on the shard size."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import yaml
from test_layout import CONFIG_FILE, closure, knob_keys, module_file, params_read, used_definitions

from laplace.config import DataSection, TokenizerSection, config_from_dict
from laplace.data.pydocs import python_docs_documents
from laplace.data.tokenize import staging_dir, tokenize_corpus
from laplace.data.tokenizer import train_tokenizer
from laplace.pipeline.layout import KNOB_FILE_DEPS
from laplace.pipeline.stages import STAGES

from project import ROOT, TINY_MODEL, TINY_PARAMS, commit_all, copy_project, descendants, env, run

pytestmark = pytest.mark.slow


def write_corpus(root: Path, megabytes: float, files: int = 8) -> None:
    """JSON Lines of real English (python-docs, each copy numbered), `files` files."""
    docs = python_docs_documents()
    root.mkdir(parents=True, exist_ok=True)
    handles = [open(root / f"part-{i:02d}.jsonl", "w", encoding="utf-8") for i in range(files)]
    written = n = 0
    while written < megabytes * 1e6:
        text = f"Copy {n // len(docs)}. " + docs[n % len(docs)]
        handles[n % files].write(json.dumps({"text": text}) + "\n")
        written += len(text)
        n += 1
    for h in handles:
        h.close()


@pytest.fixture(scope="module")
def tokenizer_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    train_tokenizer(python_docs_documents()[:400], 1024, 2).save(str(path))
    return path


CHILD = """
import json, resource, sys
from laplace.config import DataSection, TokenizerSection
from laplace.data.tokenize import tokenize_corpus
corpus, tok, out, shard_tokens = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
data = DataSection(source="files", path=corpus, num_proc=2, slices=4, shard_tokens=shard_tokens)
tok = TokenizerSection(from_=tok) if tok else TokenizerSection(vocab_size=512, sample_bytes=1_000_000)
metrics = tokenize_corpus(data, tok, out, seed=0)
# VmHWM: this process image's peak RSS (ru_maxrss survives exec: a child of a big pytest reads pytest's)
print(json.dumps({"self_kb": int(next(l for l in open("/proc/self/status") if l.startswith("VmHWM")).split()[1]),
                  "workers_kb": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss,
                  "tokens": metrics["tokens_train"] + metrics["tokens_val"],
                  "shards_resumed": metrics["shards_resumed"]}))
"""


def child_env() -> dict:
    return env(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")


def tokenize_in_child(corpus: Path, tok: Path | str, out: Path, shard_tokens: int = 50_000) -> dict:
    args = [sys.executable, "-c", CHILD, str(corpus), str(tok), str(out), str(shard_tokens)]
    done = subprocess.run(args, capture_output=True, text=True, env=child_env(), timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_peak_memory_does_not_grow_with_the_corpus(tmp_path):
    """10x the text, with the default trained tokenizer: the peak RSS of the stage process and of
    its largest child (worker or trainer) within 10% of the 1x run. The stage streams the slices'
    samples (a k-way merge of files) instead of holding them; workers hold a batch, not a file."""
    small, large = tmp_path / "small", tmp_path / "large"
    write_corpus(small, 2)
    write_corpus(large, 20)
    one = tokenize_in_child(small, "", tmp_path / "out-small")
    ten = tokenize_in_child(large, "", tmp_path / "out-large")
    assert ten["tokens"] > 9 * one["tokens"]
    assert ten["self_kb"] <= 1.10 * one["self_kb"], (one, ten)
    assert ten["workers_kb"] <= 1.10 * one["workers_kb"], (one, ten)


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def finished_shards(staging: Path) -> list[Path]:
    return [
        p for split in ("train", "val") for p in (staging / split).glob("[0-9]*") if (p / "manifest.json").is_file()
    ]


@pytest.mark.parametrize("how", [signal.SIGKILL, signal.SIGTERM], ids=["SIGKILL", "SIGTERM"])
def test_killed_tokenize_leaves_no_process_and_resumes_to_identical_shards(tmp_path, tokenizer_file, how):
    corpus = tmp_path / "corpus"
    write_corpus(corpus, 6)
    reference = tmp_path / "reference"
    data = DataSection(source="files", path=str(corpus), num_proc=2, slices=4, shard_tokens=20_000)
    tokenize_corpus(data, TokenizerSection(from_=str(tokenizer_file)), reference, seed=0)

    out = tmp_path / "out"
    staging = staging_dir(out)
    args = [sys.executable, "-c", CHILD, str(corpus), str(tokenizer_file), str(out), "20000"]
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=child_env())
    deadline = time.monotonic() + 300
    workers: set[int] = set()
    while len(finished_shards(staging)) < 4:
        assert proc.poll() is None, "finished before it could be killed"
        assert time.monotonic() < deadline
        workers.update(descendants(proc.pid))
        time.sleep(0.05)
    workers.update(descendants(proc.pid))
    assert workers, "the pool should be running"
    kept = {p.relative_to(staging): (p / "tokens.bin").stat().st_ino for p in finished_shards(staging)}
    proc.send_signal(how)
    status = proc.wait(timeout=60)
    assert status == (-signal.SIGKILL if how == signal.SIGKILL else 128 + signal.SIGTERM)
    deadline = time.monotonic() + 15
    while any(alive(p) for p in workers) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert [p for p in workers if alive(p)] == [], "orphaned worker processes"
    assert not out.exists()  # nothing half-made in the output
    if how == signal.SIGTERM:  # it tidied up: only finished shards remain, to resume from
        assert [p for p in staging.rglob("*") if ".tmp-" in p.name] == []
        assert b"tokenize interrupted" in proc.stderr.read()  # and said what it kept

    resumed = tokenize_in_child(corpus, tokenizer_file, out, shard_tokens=20_000)
    assert resumed["shards_resumed"] >= len(kept), (resumed, len(kept))  # counted and reported
    names = sorted(p.relative_to(reference) for p in reference.rglob("*") if p.is_file())
    assert names == sorted(p.relative_to(out) for p in out.rglob("*") if p.is_file())
    for name in names:
        assert (out / name).read_bytes() == (reference / name).read_bytes(), name
    for shard, inode in kept.items():  # a finished shard is moved into place, never rewritten
        assert (out / shard / "tokens.bin").stat().st_ino == inode, shard
    assert not staging.exists()


def test_appending_to_the_corpus_reruns_tokenize_and_keeps_unchanged_shards(tmp_path):
    repo = copy_project(
        tmp_path / "repo",
        {
            **TINY_PARAMS,
            "data.source": "files",
            "data.path": "data/raw",
            "data.slices": 4,
            "data.val_fraction": 0.2,
            "data.max_documents": 0,
            "tokenizer.from": "tokenizer.json",  # fixed, so unchanged slices keep their shards
        },
    )
    raw = repo / "data" / "raw"
    raw.mkdir(parents=True)
    for i, doc in enumerate(python_docs_documents()[:60]):
        (raw / f"doc{i:02d}.md").write_text(doc)
    train_tokenizer(python_docs_documents()[:300], 300, 2).save(str(repo / "tokenizer.json"))
    dvc = str(Path(sys.executable).parent / "dvc")
    run([dvc, "add", "data/raw"], repo)
    assert (repo / "data" / "raw.dvc").is_file()
    commit_all(repo, "corpus")
    run([dvc, "repro", "tokenize"], repo)
    assert "tokenize" not in run([dvc, "status", "tokenize"], repo).stdout
    tokenized = repo / "data" / "tokenized"
    before = {p.relative_to(tokenized): p.stat().st_ino for p in tokenized.rglob("tokens.bin")}

    with open(raw / "doc05.md", "a") as f:
        f.write("\n\nA paragraph appended to one file of the corpus.\n")
    status = run([dvc, "status", "tokenize"], repo).stdout
    assert "tokenize:" in status and "modified:" in status and "data/raw" in status
    run([dvc, "add", "data/raw"], repo)
    out = run([dvc, "repro", "tokenize"], repo).stdout
    assert "Running stage 'tokenize'" in out
    metrics = json.loads((repo / "metrics" / "tokenize.json").read_text())
    assert metrics["slices_reused"] == metrics["slices"] - 1
    after = {p.relative_to(tokenized): p.stat().st_ino for p in tokenized.rglob("tokens.bin")}
    assert sum(after.get(p) == ino for p, ino in before.items()) >= len(before) - 2  # untouched, same inode

    # dvc push to a remote both clones see, then a second clone pulls exactly the same data
    remote = tmp_path / "remote"
    run([dvc, "remote", "add", "-d", "-f", "shared", str(remote)], repo)
    commit_all(repo, "tokenized, shared remote")
    run([dvc, "push"], repo)
    second = tmp_path / "second"
    run(["git", "clone", "-q", str(repo), str(second)], tmp_path)
    run([dvc, "pull", "data/raw.dvc", "tokenize"], second)
    for part in ("data/raw", "data/tokenized"):
        assert tree_digest(second / part) == tree_digest(repo / part), part
    assert "tokenize" not in run([dvc, "status", "tokenize"], second).stdout  # up to date there too


def tree_digest(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}  # fmt: skip


def test_training_on_sharded_data_does_not_depend_on_the_shard_size(tmp_path):
    """Bitwise: the sampler reads the shards as their concatenation (the old single train.bin),
    so the same tokens cut into 1 shard or into many train to identical losses."""
    from laplace.training.loop import train

    cfg = config_from_dict(
        {
            "data": {"max_documents": 300, "num_proc": 1, "slices": 4},
            "tokenizer": {"vocab_size": 400},
            "model": {"preset": "tiny", **TINY_MODEL},
            "train": {"steps": 6, "batch_size": 4, "seq_len": 32, "eval_every": 3, "eval_batches": 2,
                      "checkpoint_every": 6, "warmup_steps": 1, "log_every": 1},
        }
    )  # fmt: skip
    whole, small = tmp_path / "whole", tmp_path / "small"
    tokenize_corpus(cfg.data, cfg.tokenizer, whole, cfg.seed)
    import dataclasses

    tokenize_corpus(dataclasses.replace(cfg.data, shard_tokens=1000), cfg.tokenizer, small, cfg.seed)
    n_whole = len(json.loads((whole / "manifest.json").read_text())["shards"]["train"])
    n_small = len(json.loads((small / "manifest.json").read_text())["shards"]["train"])
    assert n_small > 3 * n_whole
    first = train(cfg, whole, tmp_path / "run-whole", progress=False)
    second = train(cfg, small, tmp_path / "run-small", progress=False)
    losses = [(r["step"], r.get("loss"), r.get("val_loss")) for r in first.history]
    assert losses == [(r["step"], r.get("loss"), r.get("val_loss")) for r in second.history]
    assert any(v is not None for *_, v in losses)
    shutil.rmtree(tmp_path / "run-whole")
    assert np.isfinite(losses[-1][1]) and len(losses) >= 6


def test_sigterm_handler_is_not_left_installed():
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(Exception):  # noqa: B017 - any failure inside the stage
        tokenize_corpus(DataSection(source="files", path="/nonexistent/corpus"), TokenizerSection(), Path("/tmp/x"), 0)
    assert signal.getsignal(signal.SIGTERM) is before
    assert os.environ.get("HF_DATASETS_CACHE") is None or "partial" not in os.environ["HF_DATASETS_CACHE"]


def staged_bytes(staging: Path) -> tuple[int, int]:
    """(bytes of the tokenizer sample, bytes of everything else but shards and the staged tokenizer)."""
    sample = other = 0
    try:
        paths = list(staging.rglob("*"))
    except FileNotFoundError:  # not made yet, or moved into place (or a subfolder removed) as we walked
        paths = []
    for path in paths:
        try:
            size = path.stat().st_size if path.is_file() else 0
        except OSError:  # removed while we looked
            continue
        rel = path.relative_to(staging).parts
        if rel[0] == "samples":
            sample += size
        elif rel[0] not in ("train", "val") and path.name not in ("tokenizer.json", "tokenizer.key"):
            other += size
    return sample, other


def stage_in(tmp_path: Path, **tokenizer) -> subprocess.Popen:
    corpus = tmp_path / "corpus"
    write_corpus(corpus, 3, files=8)
    params = {"seed": 0, "data": {"source": "files", "path": "corpus", "slices": 4, "num_proc": 2}}
    params["tokenizer"] = {"vocab_size": 400, "sample_bytes": 300_000, **tokenizer}
    (tmp_path / "params.yaml").write_text(json.dumps(params))
    return subprocess.Popen(
        [str(Path(sys.executable).parent / "laplace"), "tokenize"],
        cwd=tmp_path,
        env=env(OMP_NUM_THREADS="1"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_staging_holds_at_most_the_tokenizer_sample_besides_the_shards(tmp_path):
    """3 MB of corpus, tokenizer.sample_bytes 300 KB: the slices' sample files (the only copy of the
    sample) never add up to more, sampled every 10 ms through the run; the quota binds."""
    proc = stage_in(tmp_path)
    staging = staging_dir(tmp_path / "data" / "tokenized")
    peak_sample = peak_other = 0
    while proc.poll() is None:
        sample, other = staged_bytes(staging)
        peak_sample, peak_other = max(peak_sample, sample), max(peak_other, other)
        time.sleep(0.01)
    _, err = proc.communicate()
    assert proc.returncode == 0, err[-3000:]
    assert 150_000 < peak_sample <= 300_000, peak_sample
    assert peak_other < 64_000, peak_other  # survey results, the run ledger, the workers' tags
    assert not staging.exists()


@pytest.mark.parametrize("how", ["sigterm", "refusal"])
def test_staging_is_gone_after_sigterm_and_after_a_refusal(tmp_path, how):
    """SIGTERM once the sample is on disk (no shard finished yet), or a refusal (a vocabulary the
    sample cannot reach, exit status 2): no staging directory is left behind."""
    proc = stage_in(tmp_path, **({"vocab_size": 60_000} if how == "refusal" else {}))
    staging = staging_dir(tmp_path / "data" / "tokenized")
    if how == "sigterm":
        deadline = time.monotonic() + 120
        while not list((staging / "samples").glob("*.jsonl")) and time.monotonic() < deadline:
            assert proc.poll() is None, proc.communicate()[1][-3000:]
            time.sleep(0.01)
        proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == (2 if how == "refusal" else 128 + signal.SIGTERM), err[-3000:]
    if how == "refusal":
        assert "tokenizer.vocab_size" in err, err[-3000:]
    assert not staging.exists(), sorted(str(p.relative_to(staging)) for p in staging.rglob("*"))
    assert not (tmp_path / "data" / "tokenized").exists()


# --------------------------------------------------------------------------- files knobs name are DVC deps
# Every file a knob names is a DVC dependency of every stage that reads the knob (the declared-params
# check of tests/test_layout.py, for files), and a tokenizer replaced in place under models/ marks
# tokenize changed in `dvc status` (a real git + DVC repo).

DVC = ["python", "-m", "dvc"]


def knob_file_problems(dvc: dict) -> list[str]:
    sections, problems = knob_keys(), []
    for name, stage in STAGES.items():
        if name == "track":  # logs the run's knobs' values (cfg.flat) to MLflow, reads none of their files
            continue
        entry = {stage.module.__name__, "laplace.pipeline.params"}
        files = closure(entry) - {CONFIG_FILE}
        runs = used_definitions(files, {module_file(m) for m in entry})
        read = set().union(*(params_read(path, sections, runs[path]) for path in files))
        read = {key.removesuffix("_") for key in read}  # tokenizer.from_ is the field of tokenizer.from
        deps = dvc[name].get("deps", [])
        problems += [
            f"{name}: reads {key}, but {dep} (where its files live) is not among its deps"
            for key, dep in sorted(KNOB_FILE_DEPS.items())
            if key in read and dep not in deps
        ]
    return problems


def test_every_stage_depends_on_the_files_its_knobs_name():
    from laplace.config import Config, project_path_knobs

    # every file knob has its dependency (data.hub_path names a hub dataset: its id is the param)
    keys = {key for key, _ in project_path_knobs(Config())}
    assert keys - set(KNOB_FILE_DEPS) == {"data.hub_path"}
    dvc = yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"]
    assert knob_file_problems(dvc) == []
    # and the check can fail: tokenize without models/ is what let a replaced tokenizer go unseen
    dvc["tokenize"]["deps"] = [d for d in dvc["tokenize"]["deps"] if d != "models"]
    assert knob_file_problems(dvc) == [
        "tokenize: reads tokenizer.from, but models (where its files live) is not among its deps"
    ]


def test_replacing_a_given_tokenizer_in_place_marks_tokenize_changed(tmp_path):
    repo = copy_project(tmp_path / "repo", {**TINY_PARAMS, "tokenizer.from": "models/tok/tokenizer.json"})
    texts = ["the quick brown fox jumps over the lazy dog " * 4, "a key is a word, the value its number " * 4]
    (repo / "models" / "tok").mkdir(parents=True)
    train_tokenizer(texts, 280, 1).save(str(repo / "models" / "tok" / "tokenizer.json"))
    # tokenize's outputs and corpus as a run would leave them (the status compares hashes, not contents)
    for rel in ("data/python-docs/doc.md", "data/tokenized/manifest.json", "metrics/tokenize.json"):
        (repo / rel).parent.mkdir(parents=True, exist_ok=True)
        (repo / rel).write_text("{}")
    run([*DVC, "commit", "--force", "tokenize"], repo)  # dvc.lock as after `dvc repro tokenize`
    assert "tokenize" not in run([*DVC, "status", "tokenize"], repo).stdout

    train_tokenizer(texts, 300, 1).save(str(repo / "models" / "tok" / "tokenizer.json"))  # another, same path
    status = run([*DVC, "status", "tokenize"], repo).stdout
    assert "tokenize:" in status and "changed deps" in status and "models" in status, status
