"""Tests for laplace.data: corpora, tokenizer, shards, manifest and the sampler."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import datasets
import numpy as np
import pytest
import torch

import laplace.manifest
from laplace.config import DataSection, TokenizerSection
from laplace.data.pydocs import python_docs_documents
from laplace.data.readers import iter_documents
from laplace.data.sampler import sample_batch, validation_batches
from laplace.data.shards import open_split, read_manifest
from laplace.data.tokenize import tokenize_corpus
from laplace.data.tokenizer import EOS_TOKEN, train_tokenizer
from laplace.errors import DataError
from laplace.tokenizer_file import load_tokenizer, tokenizer_sha256

SMALL_TOKENIZER = TokenizerSection(vocab_size=320, min_frequency=1)


@pytest.fixture(autouse=True)
def isolated_datasets_cache(tmp_path, monkeypatch):
    """Keep the json/parquet builders' caches out of the user's ~/.cache."""
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf-cache"))


def distinct_documents(n: int) -> list[str]:
    """n different documents of a few hundred characters each."""
    words = ["alpha", "river", "stone", "cloud", "ember", "maple", "quartz", "delta", "falcon", "harbor"]
    rng = np.random.default_rng(7)
    return [f"Document {i}: " + " ".join(rng.choice(words, size=40 + i % 17)) + "." for i in range(n)]


def split_documents(ids: np.ndarray, eos_id: int) -> list[np.ndarray]:
    """Cut a shard back into its documents (each ends with EOS)."""
    ends = np.flatnonzero(ids == eos_id)
    starts = np.concatenate(([0], ends[:-1] + 1))
    return [ids[s:e] for s, e in zip(starts, ends, strict=True)]


def decoded_documents(out_dir: Path, split: str) -> list[str]:
    manifest = read_manifest(out_dir)
    tokenizer = load_tokenizer(out_dir / "tokenizer.json")
    ids = np.asarray(open_split(out_dir, split))
    return [tokenizer.decode(doc.tolist()) for doc in split_documents(ids, manifest["eos_id"])]


def write_txt_corpus(root: Path, texts: list[str]) -> str:
    root.mkdir(parents=True, exist_ok=True)
    for i, text in enumerate(texts):
        (root / f"doc{i:03d}.txt").write_text(text, encoding="utf-8")
    return str(root)


def files(path, **kw) -> DataSection:
    return DataSection(source="files", path=str(path), **{"num_proc": 1, "slices": 4, **kw})


@pytest.fixture(scope="module")
def python_docs_shards(tmp_path_factory):
    out = tmp_path_factory.mktemp("python-docs")
    metrics = tokenize_corpus(DataSection(num_proc=2), TokenizerSection(vocab_size=1024), out, seed=1234)
    return out, metrics


# --------------------------------------------------------------------------- python-docs corpus


def test_python_docs_corpus_is_large_english_text():
    docs = python_docs_documents()
    total = sum(len(d) for d in docs)
    assert len(docs) > 300
    assert total > 1_000_000
    assert len(set(docs)) == len(docs)  # duplicates would leak between splits
    assert docs == python_docs_documents()  # fixed order
    text = " ".join(docs).lower()
    # English prose: " the " alone is over 1% of the words.
    words = text.split()
    assert text.count(" the ") / len(words) > 0.01
    assert sum(w in {"the", "of", "a", "is", "to", "and"} for w in words) / len(words) > 0.05


def test_python_docs_manifest_matches_shards(python_docs_shards):
    out, metrics = python_docs_shards
    manifest = read_manifest(out)
    assert manifest["dtype"] == "uint16" and manifest["vocab_size"] == 1024
    assert manifest["eos_id"] == 0
    kept = manifest["documents"]["train"] + manifest["documents"]["val"]
    skipped = sum(manifest["skipped"].values())
    assert kept + skipped == manifest["documents"]["total_read"] == len(python_docs_documents())
    assert manifest["documents"]["val"] > 0.02 * kept  # val_fraction 0.05
    for split in ("train", "val"):
        entries = manifest["shards"][split]
        assert len(entries) == metrics[f"shards_{split}"] >= 2  # one stream per slice
        for entry in entries:
            shard = read_shard_manifest(out / entry["path"])
            assert shard["tokens"] == entry["tokens"] and shard["split"] == split
            assert (out / entry["path"] / "tokens.bin").stat().st_size == 2 * entry["tokens"]
        ids = open_split(out, split, verify=True)
        assert len(ids) == manifest["tokens"][split] == metrics[f"tokens_{split}"]
        # Each document contributes exactly one EOS, and the split ends with one.
        assert int(np.count_nonzero(np.asarray(ids) == manifest["eos_id"])) == manifest["documents"][split]
        assert ids[-1] == manifest["eos_id"]
        assert int(np.asarray(ids).max()) < manifest["vocab_size"]
    tokenizer = load_tokenizer(out / "tokenizer.json")
    assert tokenizer_sha256(tokenizer) == manifest["tokenizer_sha256"]
    assert metrics["documents_train"] == manifest["documents"]["train"]
    assert metrics["tokens_per_s"] > 0 and metrics["seconds"] > 0
    # ~4 characters per token at this vocabulary size: real text, not bytes.
    chars = sum(len(d) for d in python_docs_documents())
    assert 2.0 < chars / (manifest["tokens"]["train"] + manifest["tokens"]["val"]) < 6.0
    assert laplace.manifest.verify(out, "tokenized") == (True, "")


def read_shard_manifest(path: Path) -> dict:
    found, reason = laplace.manifest.read_manifest(path, "token-shard")
    assert found is not None, reason
    return found


# --------------------------------------------------------------------------- tokenizer


ROUND_TRIP_TEXTS = [
    "Hello, world!",
    "  leading and trailing spaces   ",
    "tabs\tand\t\ttabs\nnew\n\n\nlines\r\nwindows line\r\n",
    "unicode: naïve café, Größe, Ελληνικά, русский, 日本語のテキスト, 한국어",
    "emoji: 👍🏽 👨‍👩‍👧‍👦 🎉🐍",
    "combining: e\u0301 a\u0308 and zero width\u200bspace, NUL \x00 and BEL \x07",
    "def f(x):\n    return {'a': [1, 2, 3]}  # comment\n\tif x != 0: pass\n",
    "a literal <|endoftext|> in text stays text",
    "",
    " ",
    "\n",
]


def test_tokenizer_round_trip():
    tokenizer = train_tokenizer(distinct_documents(50) + ROUND_TRIP_TEXTS, vocab_size=300, min_frequency=1)
    assert tokenizer.get_vocab_size() == 300
    assert tokenizer.token_to_id(EOS_TOKEN) == 0
    for text in ROUND_TRIP_TEXTS + ["unseen: ∮ E⋅da = Q,  n → ∞ 🦀 \U0010ffff"]:
        ids = tokenizer.encode(text).ids
        assert 0 not in ids  # text never becomes EOS
        assert tokenizer.decode(ids) == text


def test_tokenizer_training_is_deterministic_and_loads(tmp_path):
    texts = distinct_documents(80)
    first = train_tokenizer(texts, vocab_size=400, min_frequency=2)
    second = train_tokenizer(iter(texts), vocab_size=400, min_frequency=2)
    assert first.to_str() == second.to_str()
    assert tokenizer_sha256(first) == tokenizer_sha256(second)
    path = tmp_path / "tok.json"
    path.write_text(first.to_str(pretty=True))
    loaded = load_tokenizer(path)
    assert tokenizer_sha256(loaded) == tokenizer_sha256(first)  # formatting does not matter
    text = "a literal <|endoftext|> after loading"
    assert loaded.decode(loaded.encode(text).ids) == text


def test_load_tokenizer_errors_name_the_path(tmp_path):
    with pytest.raises(DataError, match="nope.json: tokenizer file not found"):
        load_tokenizer(tmp_path / "nope.json")
    broken = tmp_path / "broken.json"
    broken.write_text('{"version": "1.0", "model": ')
    with pytest.raises(DataError, match="broken.json: not a valid tokenizer.json"):
        load_tokenizer(broken)


# --------------------------------------------------------------------------- files corpora and bad input


def all_documents(out: Path) -> list[str]:
    return decoded_documents(out, "train") + decoded_documents(out, "val")


def test_skipped_counts_and_bad_files_are_named(tmp_path, caplog):
    root = tmp_path / "corpus"
    good = distinct_documents(12)
    write_txt_corpus(root, good)
    (root / "empty.txt").write_bytes(b"")
    (root / "blank.txt").write_bytes(b"  \n\n\t ")
    (root / "short.txt").write_text("too short to keep")
    (root / "bad.txt").write_bytes(b"\xff\xfe not utf-8 " * 20)
    (root / "image.png").write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR" + bytes(range(256)))
    out = tmp_path / "out"
    with caplog.at_level("WARNING", logger="laplace.data.tokenize"):
        metrics = tokenize_corpus(files(root, min_chars=40, val_fraction=0.3), SMALL_TOKENIZER, out, seed=0)
    manifest = read_manifest(out)
    assert manifest["skipped"] == {"empty": 2, "too_short": 1, "undecodable": 2, "too_large": 0}
    assert manifest["documents"]["total_read"] == 17
    assert manifest["documents"]["train"] + manifest["documents"]["val"] == 12
    assert metrics["skipped_undecodable"] == 2 and metrics["skipped_empty"] == 2
    assert sorted(all_documents(out)) == sorted(good)
    # each bad file is named, with why, in the log and in the manifest
    listed = sorted(manifest["bad_input"])
    assert listed[0].startswith(f"{root / 'bad.txt'}: not valid UTF-8 (byte 0)")
    assert listed[1].startswith(f"{root / 'image.png'}: binary (a NUL byte at offset 8)")
    logged = [r.getMessage() for r in caplog.records]
    assert any(str(root / "bad.txt") in m for m in logged) and any(str(root / "image.png") in m for m in logged)


def test_bad_file_is_an_error_when_asked(tmp_path):
    root = tmp_path / "corpus"
    write_txt_corpus(root, distinct_documents(6))
    (root / "bad.txt").write_bytes(b"ok \xc3\x28 broken")
    with pytest.raises(DataError) as caught:
        tokenize_corpus(files(root, on_bad_file="error"), SMALL_TOKENIZER, tmp_path / "out", seed=0)
    message = str(caught.value)
    assert message.startswith(f"{root / 'bad.txt'}: not valid UTF-8 (byte 3)") and "data.on_bad_file" in message
    assert "\n" not in message


def test_no_usable_text_is_a_clear_error(tmp_path):
    root = tmp_path / "corpus"
    root.mkdir()
    (root / "a.txt").write_text("")
    (root / "b.txt").write_text("short")
    (root / "c.txt").write_bytes(b"\xff\xfe\xfd")
    with pytest.raises(DataError) as caught:
        tokenize_corpus(files(root), SMALL_TOKENIZER, tmp_path / "out", seed=0)
    message = str(caught.value)
    assert message.startswith("corpus has no usable text") and "data.min_chars=64" in message
    assert "\n" not in message
    assert not (tmp_path / "out").exists()


def test_path_errors_name_the_knob(tmp_path):
    with pytest.raises(DataError, match=r"data.path: .*missing does not exist"):
        list(iter_documents(files(tmp_path / "missing")))
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match=r"data.path: .*empty holds no files"):
        list(iter_documents(files(tmp_path / "empty")))


def test_directories_and_text_extensions_are_read(tmp_path):
    root = tmp_path / "corpus"
    docs = distinct_documents(6)
    (root / "man" / "man1").mkdir(parents=True)
    (root / "man" / "man1" / "ls.1").write_text(docs[0])
    (root / "LICENSE").write_text(docs[1])
    (root / "notes.md").write_text(docs[2])
    (root / "guide.rst").write_text(docs[3])
    (root / "nested").mkdir()
    (root / "nested" / "a.txt").write_text(docs[4])
    (root / "nested" / "b.jsonl").write_text(json.dumps({"text": docs[5]}) + "\n")
    (root / ".hidden").write_text("never read: " + docs[0])
    assert sorted(iter_documents(files(root))) == sorted(docs)
    assert list(iter_documents(files(root / "notes.md"))) == [docs[2]]  # one file is a corpus too


def test_a_large_text_file_is_cut_into_documents(tmp_path):
    paragraphs = [f"Paragraph {i}: " + "word " * (20 + i % 30) for i in range(400)]
    text = "\n\n".join(paragraphs) + "\n"
    (tmp_path / "big.txt").write_text(text)
    docs = list(iter_documents(files(tmp_path / "big.txt", max_document_chars=2000, min_chars=1)))
    assert len(docs) > 10
    assert max(len(d) for d in docs) <= 2000
    assert "".join(docs) == text  # nothing lost, nothing added
    assert all(d.startswith(("Paragraph", "\n")) for d in docs)  # cut at blank lines
    one_line = "x" * 5000
    (tmp_path / "line.txt").write_text(one_line)
    docs = list(iter_documents(files(tmp_path / "line.txt", max_document_chars=2000, min_chars=1)))
    assert [len(d) for d in docs] == [2000, 2000, 1000] and "".join(docs) == one_line


def test_jsonl_json_and_parquet_sources(tmp_path):
    docs = distinct_documents(18)
    root = tmp_path / "records"
    root.mkdir()
    datasets.Dataset.from_dict({"body": docs[:6], "id": list(range(6))}).to_json(root / "a.jsonl", lines=True)
    datasets.Dataset.from_dict({"body": docs[6:12], "id": list(range(6))}).to_parquet(root / "b.parquet")
    (root / "c.json").write_text(json.dumps([{"body": d} for d in docs[12:]]))
    data = files(root, text_field="body")
    assert sorted(iter_documents(data)) == sorted(docs)

    out = tmp_path / "out"
    tokenize_corpus(dataclasses.replace(data, val_fraction=0.2), SMALL_TOKENIZER, out, seed=3)
    manifest = read_manifest(out)
    assert manifest["documents"]["train"] + manifest["documents"]["val"] == 18
    assert sorted(all_documents(out)) == sorted(docs)

    with pytest.raises(DataError, match=r"a\.jsonl:1: no field 'text'"):
        list(iter_documents(files(root / "a.jsonl")))
    with pytest.raises(DataError, match=r"b\.parquet: no field 'content'"):
        list(iter_documents(files(root / "b.parquet", text_field="content")))


def test_jsonl_bad_records_are_named_and_skipped(tmp_path):
    docs = distinct_documents(4)
    lines = [json.dumps({"text": d}).encode() for d in docs]
    lines.insert(2, b'{"text": "broken \xff\xfe bytes ' + b"x" * 80 + b'"}')
    lines.append(b'{"text": null}')
    lines.append(b"{not json")
    (tmp_path / "c.jsonl").write_bytes(b"\n".join(lines) + b"\n")
    data = files(tmp_path / "c.jsonl", val_fraction=0.5)
    out = tmp_path / "out"
    tokenize_corpus(data, TokenizerSection(vocab_size=300, min_frequency=1), out, seed=0)
    manifest = read_manifest(out)
    assert manifest["skipped"] == {"empty": 1, "too_short": 0, "undecodable": 2, "too_large": 0}
    assert sorted(manifest["bad_input"]) == [
        f"{tmp_path / 'c.jsonl'}:3: not valid UTF-8 (invalid start byte at byte 17)",
        f"{tmp_path / 'c.jsonl'}:7: not a JSON record (JSONDecodeError: Expecting property name enclosed in "
        "double quotes: line 1 column 2 (char 1))",
    ]
    assert sorted(all_documents(out)) == sorted(docs)


# --------------------------------------------------------------------------- datasets and the hub source (offline)


def test_saved_dataset_and_local_hub_directory(tmp_path):
    docs = distinct_documents(20)
    saved = tmp_path / "saved"
    datasets.Dataset.from_dict({"text": docs}).save_to_disk(str(saved))
    assert sorted(iter_documents(files(saved))) == sorted(docs)
    assert sorted(iter_documents(DataSection(source="hub", hub_path=str(saved), slices=3))) == sorted(docs)

    hub_dir = tmp_path / "my-hub-dataset"
    hub_dir.mkdir()
    for part in range(3):
        rows = {"content": docs[part::3]}
        datasets.Dataset.from_dict(rows).to_json(hub_dir / f"part-{part}.jsonl", lines=True)
    # the default hub_name (sample-10BT) stays set: a local folder has no configurations
    data = DataSection(source="hub", hub_path=str(hub_dir), text_field="content", slices=8, num_proc=1)
    assert sorted(iter_documents(data)) == sorted(docs)
    capped = list(iter_documents(dataclasses.replace(data, max_documents=4)))
    assert len(capped) == 20  # max_documents applies per slice in tokenize_corpus, not here
    with pytest.raises(DataError, match="no field 'text'"):
        list(iter_documents(dataclasses.replace(data, text_field="text")))
    with pytest.raises(DataError, match="data.hub_path: could not load"):
        list(iter_documents(dataclasses.replace(data, hub_path=str(tmp_path / "does-not-exist"))))

    out = tmp_path / "out"
    metrics = tokenize_corpus(dataclasses.replace(data, max_documents=9, val_fraction=0.3), SMALL_TOKENIZER, out, 0)
    manifest = read_manifest(out)
    assert manifest["source"]["kind"] == "hub"
    assert manifest["documents"]["total_read"] == metrics["documents_read"] == 9  # 3 hub shards, 3 each


# --------------------------------------------------------------------------- split, determinism, caps, shards


def test_split_is_by_document_and_independent_of_workers(tmp_path):
    docs = distinct_documents(60)
    root = write_txt_corpus(tmp_path / "corpus", docs)
    data = files(root, val_fraction=0.2, num_proc=2)
    first, second = tmp_path / "first", tmp_path / "second"
    tokenize_corpus(data, SMALL_TOKENIZER, first, seed=11)
    tokenize_corpus(dataclasses.replace(data, num_proc=1), SMALL_TOKENIZER, second, seed=11)
    names = sorted(p.relative_to(first) for p in first.rglob("*") if p.is_file())
    assert names == sorted(p.relative_to(second) for p in second.rglob("*") if p.is_file())
    for name in names:
        assert (first / name).read_bytes() == (second / name).read_bytes(), name

    train, val = decoded_documents(first, "train"), decoded_documents(first, "val")
    assert not set(train) & set(val)
    assert sorted(train + val) == sorted(docs)
    assert 3 <= len(val) <= 25  # about 20% of 60

    other = tmp_path / "other-seed"
    tokenize_corpus(data, SMALL_TOKENIZER, other, seed=12)
    assert set(decoded_documents(other, "val")) != set(val)


def test_literal_eos_text_does_not_add_documents(tmp_path):
    docs = [d + " <|endoftext|> inside the text" for d in distinct_documents(8)]
    root = write_txt_corpus(tmp_path / "corpus", docs)
    out = tmp_path / "out"
    tokenize_corpus(files(root, val_fraction=0.3), SMALL_TOKENIZER, out, seed=0)
    manifest = read_manifest(out)
    for split in ("train", "val"):
        ids = np.asarray(open_split(out, split))
        assert int(np.count_nonzero(ids == manifest["eos_id"])) == manifest["documents"][split]
    assert sorted(all_documents(out)) == sorted(docs)


def test_max_tokens_stops_at_a_document_boundary_in_each_slice(tmp_path):
    root = write_txt_corpus(tmp_path / "corpus", distinct_documents(40))
    data = files(root, val_fraction=0.1, slices=1)
    full, capped = tmp_path / "full", tmp_path / "capped"
    tokenize_corpus(data, SMALL_TOKENIZER, full, seed=0)
    tok = TokenizerSection(from_=str(full / "tokenizer.json"))
    metrics = tokenize_corpus(dataclasses.replace(data, max_tokens=500), tok, capped, seed=0)
    manifest, full_manifest = read_manifest(capped), read_manifest(full)
    train = np.asarray(open_split(capped, "train", verify=True))
    full_train = np.asarray(open_split(full, "train"))
    longest = max(len(d) for d in split_documents(full_train, 0))
    assert 500 <= len(train) < 500 + longest
    assert np.array_equal(train, full_train[: len(train)])  # a prefix of the uncapped stream
    assert train[-1] == manifest["eos_id"]
    cut = full_manifest["documents"]["train"] - manifest["documents"]["train"]
    assert cut > 0 and metrics["documents_cut_by_max_tokens"] == cut
    assert manifest["tokens"]["val"] == full_manifest["tokens"]["val"]  # the cap is for train only


def test_shard_size_changes_the_files_not_the_token_stream(tmp_path):
    root = write_txt_corpus(tmp_path / "corpus", distinct_documents(50))
    data = files(root, val_fraction=0.2, slices=3)
    whole, small = tmp_path / "whole", tmp_path / "small"
    tokenize_corpus(data, SMALL_TOKENIZER, whole, seed=0)
    tokenize_corpus(dataclasses.replace(data, shard_tokens=97), SMALL_TOKENIZER, small, seed=0)
    for split in ("train", "val"):
        assert np.array_equal(np.asarray(open_split(whole, split)), np.asarray(open_split(small, split)))
        entries = read_manifest(small)["shards"][split]
        assert len(entries) > len(read_manifest(whole)["shards"][split])
        for entry in entries:
            shard = read_shard_manifest(small / entry["path"])
            last = entry is entries[-1] or entries[entries.index(entry) + 1]["path"][-10:-5] != entry["path"][-10:-5]
            assert shard["tokens"] == 97 or last  # fixed size, the last of each slice shorter


def test_reuses_given_tokenizer(tmp_path, python_docs_shards):
    shards, _ = python_docs_shards
    root = write_txt_corpus(tmp_path / "corpus", distinct_documents(10))
    out = tmp_path / "out"
    tok_cfg = TokenizerSection(from_=str(shards / "tokenizer.json"), vocab_size=999999)
    tokenize_corpus(files(root, val_fraction=0.3), tok_cfg, out, seed=0)
    assert (out / "tokenizer.json").read_bytes() == (shards / "tokenizer.json").read_bytes()
    assert read_manifest(out)["vocab_size"] == 1024
    assert read_manifest(out)["tokenizer_sha256"] == read_manifest(shards)["tokenizer_sha256"]


def test_unreachable_vocabulary_is_an_error_naming_the_reached_size(tmp_path):
    root = write_txt_corpus(tmp_path / "corpus", distinct_documents(10))
    with pytest.raises(DataError) as caught:
        tokenize_corpus(files(root, val_fraction=0.3), TokenizerSection(vocab_size=5000), tmp_path / "out", 0)
    message = str(caught.value)
    assert message.startswith("tokenizer.vocab_size: 5000 asked, but the sample (")
    reached = int(message.split("reaches only ")[1].split()[0])
    assert 257 < reached < 5000 and f"set tokenizer.vocab_size to {reached}" in message


def test_tokenizer_sample_is_bounded_and_seeded(tmp_path):
    from laplace.data.survey import _bounded_sample

    texts = distinct_documents(200)
    sample = _bounded_sample(iter(texts), seed=1, budget=5000)
    assert sum(len(t.encode()) for _, t in sample) <= 5000 and len(sample) > 5
    assert [k for k, _ in sample] == sorted(k for k, _ in sample)
    assert sample == _bounded_sample(iter(reversed(texts)), seed=1, budget=5000)  # order does not matter
    assert sample != _bounded_sample(iter(texts), seed=2, budget=5000)
    # the smallest hashes of all: nothing left out had a smaller one
    left_out = {t for t in texts} - {t for _, t in sample}
    assert min(_bounded_sample(iter(left_out), seed=1, budget=10**9))[0] > sample[0][0]


def test_python_docs_from_the_install_or_from_its_directory_give_the_same_shards(tmp_path, python_docs_shards):
    from laplace.data.readers import write_python_docs

    reference, _ = python_docs_shards
    written = tmp_path / "python-docs"
    assert write_python_docs(written) == len(python_docs_documents())
    out = tmp_path / "out"
    tok_cfg = TokenizerSection(vocab_size=1024)
    tokenize_corpus(DataSection(path=str(written), num_proc=1), tok_cfg, out, seed=1234)
    for name in ("tokenizer.json", "manifest.json"):
        assert (out / name).read_bytes() == (reference / name).read_bytes(), name


# --------------------------------------------------------------------------- reruns: reuse, failure, resume


def test_rerun_reuses_unchanged_slices_and_a_failure_keeps_the_last_good_output(tmp_path):
    root = Path(write_txt_corpus(tmp_path / "corpus", distinct_documents(40)))
    tok = tmp_path / "tok"
    tokenize_corpus(files(root, val_fraction=0.2), SMALL_TOKENIZER, tok, seed=0)
    data = files(root, val_fraction=0.2, slices=8)
    tok_cfg = TokenizerSection(from_=str(tok / "tokenizer.json"))  # a fixed tokenizer: shards can stay
    out = tmp_path / "out"
    tokenize_corpus(data, tok_cfg, out, seed=0)
    inodes = {p.relative_to(out): p.stat().st_ino for p in out.rglob("tokens.bin")}

    with open(root / "doc007.txt", "a") as f:
        f.write(" And one more sentence appended to this document.")
    metrics = tokenize_corpus(data, tok_cfg, out, seed=0)
    assert metrics["slices_reused"] == metrics["slices"] - 1  # only doc007's slice is redone
    after = {p.relative_to(out): p.stat().st_ino for p in out.rglob("tokens.bin")}
    kept = [p for p in after if inodes.get(p) == after[p]]
    assert len(kept) >= len(after) - 2  # the changed slice's train and val shards at most
    assert laplace.manifest.verify(out, "tokenized") == (True, "")
    assert any("one more sentence appended" in d for d in all_documents(out))

    good = {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()}
    (root / "doc003.txt").write_bytes(b"\xff broken " * 20)
    with pytest.raises(DataError, match=r"doc003\.txt: not valid UTF-8"):
        tokenize_corpus(dataclasses.replace(data, on_bad_file="error"), tok_cfg, out, seed=0)
    assert {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()} == good
    leftovers = [p for p in tmp_path.rglob("*") if ".tmp-" in p.name or p.name.endswith(".next")]
    assert leftovers == []
    empty_dirs = [p for p in tmp_path.rglob("*") if p.is_dir() and not any(p.iterdir())]
    assert empty_dirs == []  # a staging directory with nothing to resume from is removed too


def test_open_split_detects_corruption(tmp_path):
    root = write_txt_corpus(tmp_path / "corpus", distinct_documents(12))
    out = tmp_path / "out"
    tokenize_corpus(files(root, val_fraction=0.3), SMALL_TOKENIZER, out, seed=0)
    assert len(open_split(out, "train", verify=True)) > 0

    shard = out / read_manifest(out)["shards"]["train"][0]["path"] / "tokens.bin"
    raw = bytearray(shard.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    shard.write_bytes(bytes(raw))
    open_split(out, "train")  # same size: only the checksum notices
    with pytest.raises(DataError, match=r"tokens\.bin fails its sha256 checksum"):
        open_split(out, "train", verify=True)
    from laplace.data.shards import verify_share

    train, val = open_split(out, "train"), open_split(out, "val")
    verdicts = [verify_share([train, val], rank, 2) for rank in range(2)]
    assert sum(bool(v) for v in verdicts) == 1  # the shard is read by exactly one of two ranks

    shard.write_bytes(bytes(raw[:-2]))
    with pytest.raises(DataError, match=r"tokens\.bin is truncated or resized \(\d+ bytes, the manifest says"):
        open_split(out, "train")
    with pytest.raises(DataError, match="split must be one of"):
        open_split(out, "test")
    (out / "manifest.json").unlink()
    with pytest.raises(DataError, match=r"manifest\.json is missing .*run the tokenize stage first"):
        open_split(out, "train")


def test_token_shards_index_like_the_concatenation(tmp_path):
    from laplace.data.shards import TokenShards

    parts = [np.arange(0, 7), np.arange(7, 8), np.arange(8, 30)]
    entries = []
    for i, part in enumerate(parts):
        (tmp_path / f"s{i}").mkdir()
        part.astype("<u2").tofile(tmp_path / f"s{i}" / "tokens.bin")
        entries.append({"path": f"s{i}", "tokens": len(part)})
    tokens = TokenShards(tmp_path, entries, np.dtype("<u2"), {})
    flat = np.arange(30, dtype=np.uint16)
    assert len(tokens) == 30 and np.array_equal(np.asarray(tokens), flat)
    assert tokens[5] == 5 and tokens[-1] == 29
    for a, b in [(0, 30), (3, 12), (6, 9), (7, 8), (29, 30), (10, 10)]:
        assert np.array_equal(tokens[a:b], flat[a:b])
    windows = np.array([[0, 6], [5, 7]])[:, :, None] + np.arange(3)
    assert np.array_equal(tokens[windows], flat[windows])
    x, y = sample_batch(tokens, step=3, batch_size=4, seq_len=8, seed=0)
    x2, y2 = sample_batch(flat, step=3, batch_size=4, seq_len=8, seed=0)
    assert torch.equal(x, x2) and torch.equal(y, y2)


# --------------------------------------------------------------------------- sampler


def test_sample_batch_is_a_function_of_seed_and_step():
    tokens = np.arange(10_000, dtype=np.uint16)
    x, y = sample_batch(tokens, step=5, batch_size=8, seq_len=32, seed=1)
    assert x.shape == y.shape == (8, 32) and x.dtype == y.dtype == torch.int64
    # Consecutive tokens (arange) make the shift easy to check exactly.
    assert torch.equal(y, x + 1)
    assert torch.equal(x[:, 1:], y[:, :-1])
    again_x, again_y = sample_batch(tokens, step=5, batch_size=8, seq_len=32, seed=1)
    assert torch.equal(x, again_x) and torch.equal(y, again_y)
    assert not torch.equal(x, sample_batch(tokens, step=6, batch_size=8, seq_len=32, seed=1)[0])
    assert not torch.equal(x, sample_batch(tokens, step=5, batch_size=8, seq_len=32, seed=2)[0])

    halves = [sample_batch(tokens, 5, 8, 32, seed=1, rank=r, world_size=2) for r in range(2)]
    assert all(h[0].shape == (4, 32) for h in halves)
    assert torch.equal(torch.cat([h[0] for h in halves]), x)
    assert torch.equal(torch.cat([h[1] for h in halves]), y)

    # Windows stay inside the split, touching both ends over many steps.
    starts = torch.cat([sample_batch(tokens[:40], s, 8, 32, seed=0)[0][:, 0] for s in range(50)])
    assert int(starts.min()) == 0 and int(starts.max()) == 40 - 33


def test_sample_batch_errors():
    tokens = np.arange(100, dtype=np.uint16)
    with pytest.raises(DataError, match="not divisible by world_size 3"):
        sample_batch(tokens, 0, 8, 16, seed=0, rank=0, world_size=3)
    with pytest.raises(DataError, match="fewer than seq_len\\+1=101"):
        sample_batch(tokens, 0, 4, 100, seed=0)


def test_validation_batches_are_fixed_and_spread(python_docs_shards):
    out, _ = python_docs_shards
    val = open_split(out, "val")
    batches = validation_batches(val, batch_size=4, seq_len=64, n_batches=3)
    again = validation_batches(val, batch_size=4, seq_len=64, n_batches=3)
    assert len(batches) == 3
    for (x, y), (x2, y2) in zip(batches, again, strict=True):
        assert x.shape == y.shape == (4, 64)
        assert torch.equal(x, x2) and torch.equal(y, y2)
        assert torch.equal(x[:, 1:], y[:, :-1])
    first_tokens = np.asarray(val[:65], dtype=np.int64)
    last_tokens = np.asarray(val[-65:], dtype=np.int64)
    assert np.array_equal(batches[0][0][0].numpy(), first_tokens[:-1])  # first window at the start
    assert np.array_equal(batches[-1][1][-1].numpy(), last_tokens[1:])  # last window at the end
