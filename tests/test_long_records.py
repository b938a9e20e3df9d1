"""Long JSON records parsed from their bytes a piece at a time (laplace/data/long_records.py): the
pieces join to what json.loads gives, whatever the escapes and wherever the cuts fall; the lines and
documents are those of the whole text; the verdicts on bad records are json.loads's; a record over
data.max_record_bytes is skipped, named and counted."""

from __future__ import annotations

import json
import random

import pytest

from laplace.config import DataSection
from laplace.data import long_records, record_files
from laplace.data.readers import slice_documents, unit_texts
from laplace.data.text_files import _string_lines
from laplace.data.units import SliceStats, Unit
from laplace.errors import DataError

SAMPLES = [
    'plain ascii text with "quotes" and \\ backslashes\n and lines\n\n',
    "Grüße, naïve café — ж, 中文字符, emoji 😀🎉 and a 𝄞 clef",
    "\\u0041 literally, \t tabs, \r returns, \x01 control, \u2028 separators",
]


def texts() -> list[str]:
    rng = random.Random(0)
    out = list(SAMPLES)
    for _ in range(20):
        out.append("".join(rng.choice(SAMPLES[rng.randrange(3)]) for _ in range(rng.randrange(1, 2000))))
    return out


@pytest.mark.parametrize("ensure_ascii", [True, False])
@pytest.mark.parametrize("piece_bytes", [2, 3, 7, 13, 64])
def test_pieces_join_to_what_json_loads_gives(monkeypatch, ensure_ascii, piece_bytes):
    monkeypatch.setattr(long_records, "_PIECE_BYTES", piece_bytes)
    for text in texts():
        raw = bytearray(json.dumps({"id": [1, {"a": "}"}], "text": text}, ensure_ascii=ensure_ascii).encode())
        (_, _), (key, start, end) = (
            [(k, (s, e)) for k, s, e in long_records.members(raw)][0],
            long_records.members(raw)[1],
        )
        assert key == "text"
        pieces = list(long_records.string_pieces(raw, start, end))
        assert "".join(pieces) == text
        assert len(pieces) > 1 or len(raw) < 2 * piece_bytes


@pytest.mark.parametrize("max_chars", [5, 16, 50])
def test_lines_from_pieces_are_the_lines_of_the_whole(max_chars):
    rng = random.Random(1)
    for text in texts():
        cuts = sorted(rng.sample(range(len(text) + 1), min(len(text), 6)))
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
        assert list(long_records.string_lines(iter(pieces), max_chars)) == list(_string_lines(text, max_chars))


def documents(path, monkeypatch, stream_over: int, **kw) -> tuple[list, SliceStats]:
    monkeypatch.setattr(record_files, "_STREAM_RECORD_BYTES", stream_over)
    monkeypatch.setattr(long_records, "_PIECE_BYTES", 101)
    data = DataSection(source="files", path=str(path), min_chars=1, max_document_chars=300, **kw)
    stats = SliceStats()
    docs = list(slice_documents([Unit(path.name, "jsonl", str(path))], {}, data, 0, stats))
    return docs, stats


def test_a_streamed_record_gives_the_documents_and_verdicts_of_a_whole_parse(tmp_path, monkeypatch):
    lines = [json.dumps({"text": t, "n": i}, ensure_ascii=i % 2 == 0) for i, t in enumerate(texts())]
    lines += [
        json.dumps({"meta": {"deep": [1, 2, {"x": "]"}]}, "text": "short"}),
        '{"text": null}',
        '{"text": "a lone \\ud800 surrogate, long enough to be streamed"}',
        '{"text": "unterminated',
        '{"text": "x"} trailing',
        '{"text": "bad escape \\q here"}',
        '{"text": "fine", "n": 1e400}',
        '{"text": "x", "n": [' + "[" * 3000 + "]" * 3000 + "]}",
    ]
    path = tmp_path / "records.jsonl"
    path.write_text("\n".join(lines) + "\n")
    whole = documents(path, monkeypatch, 1 << 40)
    streamed = documents(path, monkeypatch, 8)
    assert streamed[0] == whole[0] and len(whole[0]) > len(lines)  # long texts cut into several documents
    assert [b.split(": ", 1)[0] for b in streamed[1].bad] == [b.split(": ", 1)[0] for b in whole[1].bad]
    assert len(whole[1].bad) == 5 and streamed[1].undecodable == whole[1].undecodable
    assert streamed[1].read == whole[1].read and streamed[1].empty == whole[1].empty


def test_a_missing_text_field_is_the_same_error_streamed(tmp_path, monkeypatch):
    path = tmp_path / "records.jsonl"
    path.write_text('{"body": "' + "x" * 100 + '"}\n')
    with pytest.raises(DataError, match=r"records.jsonl:1: no field 'text' .*fields: body"):
        documents(path, monkeypatch, 8)


def test_a_record_over_max_record_bytes_is_skipped_named_and_counted(tmp_path, monkeypatch):
    path = tmp_path / "records.jsonl"
    big = json.dumps({"text": "y " * 5000})
    path.write_text("\n".join([json.dumps({"text": "before"}), big, json.dumps({"text": "after"})]) + "\n")
    docs, stats = documents(path, monkeypatch, 1 << 40, max_record_bytes=5000)
    assert docs == ["before", "after"] and stats.too_large == 1 and stats.undecodable == 0
    assert stats.bad == [f"{path}:2: a record of {len(big) + 1:,} bytes, over data.max_record_bytes=5,000"]
    assert list(unit_texts(Unit(path.name, "jsonl", str(path)), DataSection(max_record_bytes=5000)))[1].too_large
