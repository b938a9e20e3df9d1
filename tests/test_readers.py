"""The corpus readers on bad and unusual input: bad records are data (counted, skipped, named by
file:line), symlinks are followed once, special files are skipped, every JSON-lines spelling is
read as records, long records come in bounded pieces, large files are read as byte-range parts,
and an unreachable hub is a crash to retry rather than bad input."""

from __future__ import annotations

import contextlib
import gzip
import json
import logging
import os
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from laplace.config import DataSection, TokenizerSection
from laplace.data.hub import HubUnreachable, _raise_if_network
from laplace.data.readers import corpus_units, iter_documents, plan_slices, slice_documents, unit_fingerprint
from laplace.data.text_files import record_pieces
from laplace.data.tokenize import tokenize_corpus
from laplace.data.tokenizer import train_tokenizer
from laplace.data.units import SliceStats
from laplace.errors import DataError, Failure

TEXT = "The quick brown fox jumps over the lazy dog, again and again, in a sentence long enough. "


def files(path, **kw) -> DataSection:
    return DataSection(source="files", path=str(path), min_chars=10, **kw)


def test_lone_surrogate_is_counted_and_skipped_with_its_file_and_line(tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    lines = [json.dumps({"text": TEXT * (i + 1)}) for i in range(40)]
    lines[6] = '{"text": "broken \\ud800 surrogate ' + TEXT + '"}'  # valid JSON, not valid Unicode text
    (corpus / "a.jsonl").write_text("\n".join(lines) + "\n")
    tok = tmp_path / "tok.json"
    train_tokenizer([TEXT * 3], 300, 1).save(str(tok))
    out = tmp_path / "out"
    data = files(corpus, num_proc=1, slices=2, val_fraction=0.3)
    metrics = tokenize_corpus(data, TokenizerSection(from_=str(tok)), out, 0)
    assert metrics["skipped_undecodable"] == 1
    assert metrics["documents_train"] + metrics["documents_val"] == 39
    bad = json.loads((out / "manifest.json").read_text())["bad_input"]
    assert bad == [f"{corpus / 'a.jsonl'}:7: not valid Unicode text (a lone surrogate such as \\ud800)"]
    with pytest.raises(DataError, match=r"a\.jsonl:7: not valid Unicode"):
        list(iter_documents(files(corpus, on_bad_file="error")))


def test_a_symlink_loop_is_an_error_naming_it_and_links_are_followed_once(tmp_path):
    corpus = tmp_path / "corpus"
    (corpus / "sub").mkdir(parents=True)
    (corpus / "sub" / "a.txt").write_text(TEXT)
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "b.txt").write_text(TEXT + "b")
    (corpus / "linked").symlink_to(outside)  # a link to a directory elsewhere: followed once
    assert [u.name for u in corpus_units(files(corpus))] == ["linked/b.txt", "sub/a.txt"]
    (corpus / "sub" / "loop").symlink_to(corpus)
    with pytest.raises(DataError, match=r"sub/loop is a symlink loop"):
        corpus_units(files(corpus))


def test_a_fifo_is_skipped_with_a_warning_instead_of_blocking(tmp_path, caplog):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.txt").write_text(TEXT)
    os.mkfifo(corpus / "pipe.jsonl")
    with caplog.at_level(logging.WARNING):
        units = corpus_units(files(corpus))
    assert [u.name for u in units] == ["a.txt"]
    assert "pipe.jsonl: not a regular file" in caplog.text


@pytest.mark.parametrize("name", ["a.ndjson", "a.jsonl.gz", "a.ndjson.gz"])
def test_ndjson_and_gzipped_json_lines_are_read_as_records(tmp_path, name):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    raw = "".join(json.dumps({"text": f"{i} {TEXT}"}) + "\n" for i in range(200)).encode()
    (corpus / name).write_bytes(gzip.compress(raw) if name.endswith(".gz") else raw)
    docs = list(iter_documents(files(corpus)))
    assert docs == [f"{i} {TEXT}" for i in range(200)]


def test_gzipped_json_lines_under_a_local_hub_dataset(tmp_path, monkeypatch):
    corpus = tmp_path / "hubdir"
    corpus.mkdir()
    raw = "".join(json.dumps({"text": f"{i} {TEXT}"}) + "\n" for i in range(50)).encode()
    (corpus / "train.jsonl.gz").write_bytes(gzip.compress(raw))
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    data = DataSection(source="hub", hub_path=str(corpus), hub_name="", min_chars=10, slices=1)
    assert sorted(iter_documents(data)) == sorted(f"{i} {TEXT}" for i in range(50))


def test_ndjson_and_gzipped_json_lines_under_a_local_hub_dataset_match_the_files_source(tmp_path, monkeypatch):
    # `datasets` picks its builder by extension: .ndjson and .jsonl.gz must both go to the json one
    corpus = tmp_path / "hubdir"
    corpus.mkdir()
    ndjson = [{"text": f"nd {i} {TEXT}"} for i in range(30)] + [{"text": "é " + TEXT}, {"text": ""}]
    gzipped = [{"text": f"gz {i} {TEXT * (1 + i % 3)}"} for i in range(20)] + [{"text": "short"}]
    (corpus / "a.ndjson").write_text("".join(json.dumps(r) + "\n" for r in ndjson))
    (corpus / "b.jsonl.gz").write_bytes(gzip.compress("".join(json.dumps(r) + "\n" for r in gzipped).encode()))
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    from_files = list(iter_documents(files(corpus, slices=2)))
    hub = DataSection(source="hub", hub_path=str(corpus), min_chars=10, slices=2)  # default hub_name kept
    assert len(corpus_units(hub)) == 2  # one datasets shard per file
    from_hub = list(iter_documents(hub))
    assert len(from_files) == len(from_hub) == 51  # the empty and the short record skipped by both
    assert sorted(from_hub) == sorted(from_files)
    assert sum(d.startswith("nd ") for d in from_hub) == 30 and sum(d.startswith("gz ") for d in from_hub) == 20


def test_a_long_record_comes_in_bounded_pieces_cut_at_paragraphs_and_spaces():
    text = ("para " * 300 + "\n\n") * 50 + "x" * 5000
    pieces = list(record_pieces(text, 1000))
    assert "".join(pieces) == text  # nothing lost or added
    assert max(map(len, pieces)) <= 1000
    assert sum(p.endswith(" ") or p.endswith("\n") for p in pieces[:-6]) == len(pieces) - 6  # cut at safe points


def test_a_large_file_is_read_as_byte_range_parts_with_every_line_once(tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    records = [f"{i} " + TEXT * (1 + i % 7) for i in range(3000)]
    (corpus / "big.jsonl").write_text("".join(json.dumps({"text": r}) + "\n" for r in records))
    data = files(corpus, split_bytes=50_000, slices=8)
    units = corpus_units(data)
    assert len(units) == 8 and all(u.parts == 8 for u in units)
    from laplace.data.readers import plan_slices

    assert all(len(s) == 1 for s in plan_slices(units, 8))  # consecutive slices: one part each
    seen = [d for u in units for d in slice_documents([u], {}, data, 0, SliceStats())]
    assert seen == records  # each line in exactly one part, in order
    assert len({unit_fingerprint(u, data)[0] for u in units}) == 8  # each part fingerprints its own bytes


def test_an_unreachable_hub_is_a_retryable_failure_not_bad_input():
    import httpx

    with socket.socket() as s:  # a port with no server: connection refused, a real transport error
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    try:
        httpx.get(f"http://127.0.0.1:{port}/", timeout=5)
    except httpx.TransportError as exc:
        try:
            raise RuntimeError("Couldn't reach the dataset") from exc
        except RuntimeError as wrapped:
            with pytest.raises(HubUnreachable, match="the hub is unreachable") as caught:
                _raise_if_network(wrapped, "could not load 'x'")
    assert isinstance(caught.value, Failure) and not isinstance(caught.value, DataError)
    _raise_if_network(FileNotFoundError("Dataset 'x' doesn't exist on the Hub"), "could not load 'x'")  # bad input


# --------------------------------------------------------------------------- inputs that used to crash
# (a line nested 100,000 deep, a truncated or non-gzip .jsonl.gz, an unreadable .jsonl read under
# another user id since root ignores file modes, a BOM, a .json array with a non-object, a full disk)

GOOD = [{"text": f"{i} {TEXT}"} for i in range(5)]


def one_slice(path, **kw) -> DataSection:
    return DataSection(source="files", path=str(path), min_chars=10, slices=1, **kw)


def jsonl(records) -> str:
    return "".join(json.dumps(r) + "\n" for r in records)


def read(directory: Path, **kw) -> tuple[list[str], SliceStats]:
    """Every document of the corpus and what was skipped, as the stage's survey and encode read it."""
    data = one_slice(directory, **kw)
    (units,) = plan_slices(corpus_units(data), 1)
    problems = {u.name: p for u in units if (p := unit_fingerprint(u, data)[1])}
    stats = SliceStats()
    return list(slice_documents(units, problems, data, 0, stats)), stats


@pytest.fixture
def corpus(tmp_path) -> Path:
    directory = tmp_path / "corpus"
    directory.mkdir()
    (directory / "good.jsonl").write_text(jsonl(GOOD))
    return directory


def test_a_line_nested_100000_deep_is_skipped_and_named(corpus):
    (corpus / "deep.jsonl").write_text(jsonl(GOOD[:1]) + "[" * 100_000 + "]" * 100_000 + "\n" + jsonl(GOOD[1:2]))
    docs, stats = read(corpus)
    assert len(docs) == len(GOOD) + 2
    assert stats.bad == [f"{corpus / 'deep.jsonl'}:2: not a JSON record (nested too deeply to parse)"]


def test_a_truncated_gzip_keeps_the_records_before_the_cut_and_names_the_file(corpus):
    whole = gzip.compress(jsonl([{"text": f"gz {i} {TEXT}"} for i in range(200)]).encode())
    (corpus / "cut.jsonl.gz").write_bytes(whole[: len(whole) // 2])
    docs, stats = read(corpus)
    kept = [d for d in docs if d.startswith("gz ")]
    assert 0 < len(kept) < 200 and kept == [f"gz {i} {TEXT}" for i in range(len(kept))]
    (bad,) = stats.bad
    assert bad.startswith(f"{corpus / 'cut.jsonl.gz'}: a truncated gzip file (EOFError")


def test_a_jsonl_gz_that_is_not_gzip_is_skipped_and_named(corpus):
    (corpus / "plain.jsonl.gz").write_text(jsonl(GOOD))  # not compressed
    docs, stats = read(corpus)
    assert len(docs) == len(GOOD)
    (bad,) = stats.bad
    assert bad.startswith(f"{corpus / 'plain.jsonl.gz'}: not a valid gzip file (BadGzipFile")


@contextlib.contextmanager
def as_user(uid: int):
    """This process's effective uid set to `uid` (root's file access checks then apply to it)."""
    os.seteuid(uid)
    try:
        yield
    finally:
        os.seteuid(0)


@pytest.mark.skipif(os.geteuid() != 0, reason="reads the corpus as another user: needs root to switch")
def test_an_unreadable_jsonl_is_skipped_and_named():
    corpus = Path(tempfile.mkdtemp(prefix="laplace-unreadable-"))  # outside pytest's root-only tmp
    try:
        os.chmod(corpus, 0o755)
        (corpus / "good.jsonl").write_text(jsonl(GOOD))
        secret = corpus / "secret.jsonl"
        secret.write_text(jsonl(GOOD))
        secret.chmod(0o000)
        with as_user(65534):  # nobody: the real PermissionError that a file mode gives
            docs, stats = read(corpus)
    finally:
        shutil.rmtree(corpus)
    assert len(docs) == len(GOOD)
    (bad,) = stats.bad
    assert bad == f"{secret}: unreadable (PermissionError: [Errno 13] Permission denied: '{secret}')"


def test_a_bom_at_the_start_of_a_jsonl_keeps_its_first_record(corpus):
    (corpus / "bom.jsonl").write_bytes(b"\xef\xbb\xbf" + jsonl([{"text": f"bom {TEXT}"}] + GOOD[:1]).encode())
    (corpus / "bom.json").write_bytes(b"\xef\xbb\xbf" + json.dumps([{"text": f"array {TEXT}"}]).encode())
    docs, stats = read(corpus)
    assert f"bom {TEXT}" in docs and f"array {TEXT}" in docs and not stats.bad


def test_a_json_array_with_a_non_object_element_skips_that_element_only(corpus):
    (corpus / "mixed.json").write_text(json.dumps([{"text": f"a {TEXT}"}, 7, {"text": f"b {TEXT}"}]))
    docs, stats = read(corpus)
    assert f"a {TEXT}" in docs and f"b {TEXT}" in docs
    assert stats.bad == [f"{corpus / 'mixed.json'}[1]: a JSON int, not an object"]


def test_every_crash_input_at_once_through_the_stage(corpus, tmp_path):
    """The stage itself (worker processes) completes and lists each one in the manifest."""
    (corpus / "deep.jsonl").write_text("{" * 50_000 + "\n" + jsonl(GOOD[:1]))
    (corpus / "plain.jsonl.gz").write_text(jsonl(GOOD))
    whole = gzip.compress(jsonl(GOOD).encode())
    (corpus / "cut.jsonl.gz").write_bytes(whole[:-12])
    (corpus / "mixed.json").write_text(json.dumps([{"text": f"a {TEXT}"}, "x"]))
    tok = tmp_path / "tok.json"
    train_tokenizer([TEXT * 3], 300, 1).save(str(tok))
    data = DataSection(source="files", path=str(corpus), min_chars=10, slices=3, num_proc=2, val_fraction=0.3)
    tokenize_corpus(data, TokenizerSection(from_=str(tok)), tmp_path / "out", 0)
    bad = json.loads((tmp_path / "out" / "manifest.json").read_text())["bad_input"]
    named = sorted(line.split(": ", 1)[0].rsplit("/", 1)[1] for line in bad)
    assert named == ["cut.jsonl.gz", "deep.jsonl:1", "mixed.json[1]", "plain.jsonl.gz"], bad


def small_tmpfs(path: Path) -> bool:
    path.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(path)], capture_output=True)
    return done.returncode == 0


@pytest.mark.skipif(os.geteuid() != 0, reason="mounts a 256 KB tmpfs: needs root")
def test_a_full_disk_is_one_line_and_a_crash(tmp_path):
    """A real ENOSPC: the output goes to a 256 KB tmpfs, the corpus needs more."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "big.jsonl").write_text(jsonl({"text": f"{i} {TEXT * 4}"} for i in range(4000)))
    tok = tmp_path / "tok.json"
    train_tokenizer([TEXT * 3], 300, 1).save(str(tok))
    disk = tmp_path / "disk"
    if not small_tmpfs(disk):
        pytest.skip("mount -t tmpfs is not permitted here")
    params = {"data": {"source": "files", "path": str(corpus), "min_chars": 10, "slices": 2, "num_proc": 1}}
    params["data"]["shard_tokens"] = 1000
    params["tokenizer"] = {"from": str(tok)}
    (disk / "params.yaml").write_text(json.dumps(params))  # the project on the small disk: data/ goes there
    try:
        out = subprocess.run(
            [str(Path(sys.executable).parent / "laplace"), "tokenize"],
            cwd=disk,
            capture_output=True,
            text=True,
            timeout=300,
        )
        left = sorted(p.name for p in (disk / "data").iterdir()) if (disk / "data").is_dir() else []
    finally:
        subprocess.run(["umount", str(disk)], check=True)
    assert out.returncode == 1, out.stderr[-3000:]
    errors = [line for line in out.stderr.splitlines() if "error" in line.lower()]
    assert len(errors) == 1, out.stderr[-3000:]
    assert errors[0].startswith("laplace tokenize: error: tokenize: no space left on device"), errors
    assert "Traceback" not in out.stderr
    assert "tokenized" not in left  # no half output: the last good one (none here) is what stays
