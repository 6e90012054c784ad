"""Reading corpora: plain lines, TSV columns, JSON lines, and clear errors."""

from __future__ import annotations

import pytest

from attnstore.errors import CorpusError
from attnstore_tools.corpus import read_texts


def test_plain_text_is_one_text_per_line_blank_lines_kept(tmp_path):
    path = tmp_path / "c.txt"
    path.write_text("first line\n\nthird \"quoted\" line\n", encoding="utf-8")
    assert read_texts(path) == ["first line", "", 'third "quoted" line']


def test_tsv_reads_the_named_column_with_quotes_as_text(tmp_path):
    path = tmp_path / "c.tsv"
    path.write_text('score\tsentence1\n1.0\tA "man" plays.\n2.5\tA dog runs.\n', encoding="utf-8")
    assert read_texts(path, column="sentence1") == ['A "man" plays.', "A dog runs."]


def test_tsv_with_several_columns_needs_a_column(tmp_path):
    path = tmp_path / "c.tsv"
    path.write_text("a\tb\nx\ty\n", encoding="utf-8")
    with pytest.raises(CorpusError, match="--column"):
        read_texts(path)
    with pytest.raises(CorpusError, match="no column 'c'"):
        read_texts(path, column="c")


def test_jsonl_reads_multiline_texts_from_the_text_field(tmp_path):
    path = tmp_path / "c.jsonl"
    path.write_text('{"text": "one\\ntwo"}\n{"text": "three", "other": 1}\n', encoding="utf-8")
    assert read_texts(path) == ["one\ntwo", "three"]


def test_bad_jsonl_line_and_missing_file_are_clear_errors(tmp_path):
    path = tmp_path / "c.jsonl"
    path.write_text('{"text": "ok"}\n{"prompt": "no text"}\n', encoding="utf-8")
    with pytest.raises(CorpusError, match="line 2 has no string field 'text'"):
        read_texts(path)
    with pytest.raises(CorpusError, match="cannot read corpus"):
        read_texts(tmp_path / "missing.txt")
