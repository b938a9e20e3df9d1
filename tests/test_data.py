"""Tests for laplace.data: corpora, tokenizer, shards, manifest and the sampler."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import datasets
import numpy as np
import pytest
import torch

import laplace.data.tokenize
from laplace.config import DataSection, TokenizerSection
from laplace.data.pydocs import python_docs_documents
from laplace.data.readers import load_corpus
from laplace.data.sampler import sample_batch, validation_batches
from laplace.data.shards import open_split, read_manifest
from laplace.data.tokenize import tokenize_corpus
from laplace.data.tokenizer import EOS_TOKEN, load_tokenizer, tokenizer_sha256, train_tokenizer
from laplace.errors import DataError

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


def write_txt_corpus(root: Path, texts: list[str]) -> list[str]:
    root.mkdir(parents=True, exist_ok=True)
    for i, text in enumerate(texts):
        (root / f"doc{i:03d}.txt").write_text(text, encoding="utf-8")
    return [str(root / "*.txt")]


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
    itemsize = np.dtype(manifest["dtype"]).itemsize
    assert manifest["dtype"] == "uint16" and manifest["vocab_size"] == 1024
    assert manifest["eos_id"] == 0
    kept = manifest["documents"]["train"] + manifest["documents"]["val"]
    skipped = sum(manifest["skipped"].values())
    assert kept + skipped == manifest["documents"]["total_read"] == len(python_docs_documents())
    assert manifest["documents"]["val"] > 0.02 * kept  # val_fraction 0.05
    for split in ("train", "val"):
        path = out / f"{split}.bin"
        assert path.stat().st_size == manifest["files"][f"{split}.bin"]["bytes"]
        assert manifest["tokens"][split] == path.stat().st_size // itemsize
        ids = open_split(out, split, verify=True)
        assert len(ids) == manifest["tokens"][split] == metrics[f"tokens_{split}"]
        # Each document contributes exactly one EOS, and the shard ends with one.
        assert int(np.count_nonzero(ids == manifest["eos_id"])) == manifest["documents"][split]
        assert ids[-1] == manifest["eos_id"]
        assert int(ids.max()) < manifest["vocab_size"]
    tokenizer = load_tokenizer(out / "tokenizer.json")
    assert tokenizer_sha256(tokenizer) == manifest["tokenizer_sha256"]
    assert metrics["documents_train"] == manifest["documents"]["train"]
    assert metrics["tokens_per_s"] > 0 and metrics["seconds"] > 0
    # ~4 characters per token at this vocabulary size: real text, not bytes.
    chars = sum(len(d) for d in python_docs_documents())
    assert 2.0 < chars / (manifest["tokens"]["train"] + manifest["tokens"]["val"]) < 6.0


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


# --------------------------------------------------------------------------- files corpora and skipping


def test_skipped_counts_from_files(tmp_path):
    root = tmp_path / "corpus"
    good = distinct_documents(6)
    write_txt_corpus(root, good)
    (root / "empty.txt").write_bytes(b"")
    (root / "blank.txt").write_bytes(b"  \n\n\t ")
    (root / "short.txt").write_text("too short to keep")
    (root / "bad.txt").write_bytes(b"\xff\xfe not utf-8 " * 20)
    data = DataSection(source="files", files=[str(root / "*.txt")], min_chars=40, num_proc=1)
    out = tmp_path / "out"
    metrics = tokenize_corpus(data, SMALL_TOKENIZER, out, seed=0)
    manifest = read_manifest(out)
    assert manifest["skipped"] == {"empty": 2, "too_short": 1, "undecodable": 1}
    assert manifest["documents"]["total_read"] == 10
    assert manifest["documents"]["train"] + manifest["documents"]["val"] == 6
    assert manifest["documents"]["val"] >= 1 and manifest["documents"]["train"] >= 1
    assert metrics["skipped_undecodable"] == 1 and metrics["skipped_empty"] == 2
    assert sorted(decoded_documents(out, "train") + decoded_documents(out, "val")) == sorted(good)
    assert manifest["source"]["kind"] == "files"


def test_no_usable_text_is_a_clear_error(tmp_path):
    root = tmp_path / "corpus"
    root.mkdir()
    (root / "a.txt").write_text("")
    (root / "b.txt").write_text("short")
    (root / "c.txt").write_bytes(b"\xff\xfe\xfd")
    data = DataSection(source="files", files=[str(root / "*.txt")], num_proc=1)
    with pytest.raises(DataError) as caught:
        tokenize_corpus(data, SMALL_TOKENIZER, tmp_path / "out", seed=0)
    message = str(caught.value)
    assert message.startswith("corpus has no usable text: 3 documents read")
    assert "data.min_chars=64" in message and "\n" not in message
    assert not (tmp_path / "out" / "tokenizer.json").exists()  # failed before training


def test_file_pattern_errors(tmp_path):
    with pytest.raises(DataError, match="missing/\\*.txt' matches no file"):
        load_corpus(DataSection(source="files", files=[str(tmp_path / "missing" / "*.txt")]))
    (tmp_path / "x.csv").write_text("a,b")
    with pytest.raises(DataError, match="x.csv has unsupported type '.csv'"):
        load_corpus(DataSection(source="files", files=[str(tmp_path / "x.csv")]))
    with pytest.raises(DataError, match="data.files is empty"):
        load_corpus(DataSection(source="files", files=[]))


def test_relative_file_paths_resolve_against_cwd(tmp_path, monkeypatch):
    write_txt_corpus(tmp_path / "rel", distinct_documents(3))
    monkeypatch.chdir(tmp_path)
    corpus = load_corpus(DataSection(source="files", files=["rel/doc001.txt", "rel/*.txt"], max_documents=2))
    # doc001 first (pattern order), then the glob without repeating it; capped at 2.
    assert list(corpus["text"]) == [distinct_documents(3)[1], distinct_documents(3)[0]]


def test_jsonl_and_parquet_sources(tmp_path):
    docs = distinct_documents(12)
    datasets.Dataset.from_dict({"body": docs[:6], "id": list(range(6))}).to_json(tmp_path / "a.jsonl", lines=True)
    datasets.Dataset.from_dict({"body": docs[6:], "id": list(range(6))}).to_parquet(tmp_path / "b.parquet")
    data = DataSection(
        source="files", files=[str(tmp_path / "a.jsonl"), str(tmp_path / "b.parquet")], text_field="body"
    )
    assert list(load_corpus(data)["text"]) == docs
    assert list(load_corpus(dataclasses.replace(data, max_documents=8))["text"]) == docs[:8]

    out = tmp_path / "out"
    tokenize_corpus(dataclasses.replace(data, num_proc=1), SMALL_TOKENIZER, out, seed=3)
    manifest = read_manifest(out)
    assert manifest["documents"]["train"] + manifest["documents"]["val"] == 12
    assert sorted(decoded_documents(out, "train") + decoded_documents(out, "val")) == sorted(docs)

    with pytest.raises(DataError, match=r"a\.jsonl: no field 'text'"):
        load_corpus(dataclasses.replace(data, text_field="text"))
    with pytest.raises(DataError, match=r"b\.parquet: no field 'content'"):
        load_corpus(dataclasses.replace(data, files=[str(tmp_path / "b.parquet")], text_field="content"))


def test_jsonl_invalid_utf8_record_is_skipped_and_counted(tmp_path):
    docs = distinct_documents(4)
    lines = [json.dumps({"text": d}).encode() for d in docs]
    lines.insert(2, b'{"text": "broken \xff\xfe bytes ' + b"x" * 80 + b'"}')
    lines.append(b'{"text": null}')
    (tmp_path / "c.jsonl").write_bytes(b"\n".join(lines) + b"\n")
    data = DataSection(source="files", files=[str(tmp_path / "c.jsonl")], num_proc=1)
    out = tmp_path / "out"
    tokenize_corpus(data, SMALL_TOKENIZER, out, seed=0)
    manifest = read_manifest(out)
    assert manifest["skipped"] == {"empty": 1, "too_short": 0, "undecodable": 1}
    assert manifest["documents"]["total_read"] == 6
    assert sorted(decoded_documents(out, "train") + decoded_documents(out, "val")) == sorted(docs)


# --------------------------------------------------------------------------- hub source (offline)


def test_hub_source_from_local_directory(tmp_path):
    hub_dir = tmp_path / "my-hub-dataset"
    hub_dir.mkdir()
    docs = distinct_documents(10)
    datasets.Dataset.from_dict({"content": docs}).to_json(hub_dir / "part-0.jsonl", lines=True)
    data = DataSection(
        source="hub", hub_path=str(hub_dir), hub_name="", text_field="content", hub_streaming=True, max_documents=4
    )
    streamed = load_corpus(data)
    assert isinstance(streamed, datasets.Dataset)
    assert streamed.column_names == ["text"] and list(streamed["text"]) == docs[:4]

    full = load_corpus(dataclasses.replace(data, hub_streaming=False, max_documents=0))
    assert full.column_names == ["text"] and list(full["text"]) == docs

    with pytest.raises(DataError, match="set data.max_documents"):
        load_corpus(dataclasses.replace(data, max_documents=0))
    with pytest.raises(DataError, match="no field 'text'"):
        load_corpus(dataclasses.replace(data, text_field="text"))
    with pytest.raises(DataError, match="data.hub_path: could not load"):
        load_corpus(dataclasses.replace(data, hub_path=str(tmp_path / "does-not-exist")))

    out = tmp_path / "out"
    tokenize_corpus(dataclasses.replace(data, max_documents=8, num_proc=1), SMALL_TOKENIZER, out, seed=0)
    manifest = read_manifest(out)
    assert manifest["source"]["kind"] == "hub"
    assert manifest["documents"]["total_read"] == 8


# --------------------------------------------------------------------------- split, determinism, caps


def test_split_is_by_document_and_deterministic(tmp_path):
    docs = distinct_documents(60)
    patterns = write_txt_corpus(tmp_path / "corpus", docs)
    data = DataSection(source="files", files=patterns, val_fraction=0.2, num_proc=2)
    first, second = tmp_path / "first", tmp_path / "second"
    tokenize_corpus(data, SMALL_TOKENIZER, first, seed=11)
    tokenize_corpus(data, SMALL_TOKENIZER, second, seed=11)
    for name in ("tokenizer.json", "train.bin", "val.bin", "manifest.json"):
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
    patterns = write_txt_corpus(tmp_path / "corpus", docs)
    out = tmp_path / "out"
    tokenize_corpus(DataSection(source="files", files=patterns, num_proc=1), SMALL_TOKENIZER, out, seed=0)
    manifest = read_manifest(out)
    for split in ("train", "val"):
        ids = open_split(out, split)
        assert int(np.count_nonzero(ids == manifest["eos_id"])) == manifest["documents"][split]
    assert sorted(decoded_documents(out, "train") + decoded_documents(out, "val")) == sorted(docs)


def test_max_tokens_stops_at_a_document_boundary(tmp_path):
    patterns = write_txt_corpus(tmp_path / "corpus", distinct_documents(40))
    data = DataSection(source="files", files=patterns, num_proc=1, val_fraction=0.1)
    full, capped = tmp_path / "full", tmp_path / "capped"
    tokenize_corpus(data, SMALL_TOKENIZER, full, seed=0)
    metrics = tokenize_corpus(dataclasses.replace(data, max_tokens=500), SMALL_TOKENIZER, capped, seed=0)
    manifest, full_manifest = read_manifest(capped), read_manifest(full)
    train = np.asarray(open_split(capped, "train", verify=True))
    full_train = np.asarray(open_split(full, "train"))
    longest = max(len(d) for d in split_documents(full_train, 0))
    assert 500 <= len(train) < 500 + longest
    assert np.array_equal(train, full_train[: len(train)])  # a prefix of the uncapped stream
    assert train[-1] == manifest["eos_id"]
    assert int(np.count_nonzero(train == 0)) == manifest["documents"]["train"]
    cut = full_manifest["documents"]["train"] - manifest["documents"]["train"]
    assert cut > 0 and metrics["documents_cut_by_max_tokens"] == cut
    assert manifest["tokens"]["val"] == full_manifest["tokens"]["val"]  # the cap is for train only


def test_tokenizing_in_rounds_gives_the_same_shards(tmp_path, monkeypatch):
    patterns = write_txt_corpus(tmp_path / "corpus", distinct_documents(40))
    data = DataSection(source="files", files=patterns, num_proc=1, val_fraction=0.1)
    for max_tokens in (0, 700):
        one_round, rounds = tmp_path / f"one-{max_tokens}", tmp_path / f"rounds-{max_tokens}"
        capped = dataclasses.replace(data, max_tokens=max_tokens)
        tokenize_corpus(capped, SMALL_TOKENIZER, one_round, seed=0)
        with monkeypatch.context() as patch:
            patch.setattr(laplace.data.tokenize, "DOCS_PER_ROUND", 7)
            tokenize_corpus(capped, SMALL_TOKENIZER, rounds, seed=0)
        for name in ("train.bin", "val.bin", "manifest.json"):
            assert (one_round / name).read_bytes() == (rounds / name).read_bytes(), (max_tokens, name)


def test_reuses_given_tokenizer(tmp_path, python_docs_shards):
    shards, _ = python_docs_shards
    patterns = write_txt_corpus(tmp_path / "corpus", distinct_documents(10))
    out = tmp_path / "out"
    tok_cfg = TokenizerSection(path=str(shards / "tokenizer.json"), vocab_size=999999)
    tokenize_corpus(DataSection(source="files", files=patterns, num_proc=1), tok_cfg, out, seed=0)
    assert (out / "tokenizer.json").read_bytes() == (shards / "tokenizer.json").read_bytes()
    assert read_manifest(out)["vocab_size"] == 1024
    assert read_manifest(out)["tokenizer_sha256"] == read_manifest(shards)["tokenizer_sha256"]


# --------------------------------------------------------------------------- shard integrity


def test_open_split_detects_corruption(tmp_path):
    patterns = write_txt_corpus(tmp_path / "corpus", distinct_documents(12))
    out = tmp_path / "out"
    tokenize_corpus(DataSection(source="files", files=patterns, num_proc=1), SMALL_TOKENIZER, out, seed=0)
    assert len(open_split(out, "train", verify=True)) > 0

    train = out / "train.bin"
    raw = bytearray(train.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    train.write_bytes(bytes(raw))
    open_split(out, "train")  # same size: only the checksum notices
    with pytest.raises(DataError, match=r"train\.bin fails its sha256 checksum"):
        open_split(out, "train", verify=True)

    train.write_bytes(bytes(raw[:-2]))
    with pytest.raises(DataError, match=r"train\.bin is truncated or resized \(\d+ bytes, the manifest says"):
        open_split(out, "train")

    (out / "val.bin").unlink()
    with pytest.raises(DataError, match=r"val\.bin is missing"):
        open_split(out, "val")
    with pytest.raises(DataError, match="split must be one of"):
        open_split(out, "test")
    (out / "manifest.json").unlink()
    with pytest.raises(DataError, match=r"manifest\.json is missing .*run the tokenize stage first"):
        open_split(out, "train")


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
