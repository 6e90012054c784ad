"""``bench stream``: the stream's make-up and the deal of batches over node processes."""

from __future__ import annotations

from pathlib import Path

import pytest

from attnstore.errors import ConfigError
from attnstore_tools.bench.stream import load_stream
from attnstore_tools.bench.stream_node import _batches


def _system(folder: Path, name: str, count: int) -> None:
    rows = "".join(f"{i}\tE1\t{name} line {i}\n" for i in range(count))
    (folder / f"{name}.tsv").write_text("line_id\tevent_id\tcontent\n" + rows, encoding="utf-8")


def test_build_lines_come_first_per_system_and_the_stream_interleaves_blocks_of_fifty(tmp_path: Path) -> None:
    _system(tmp_path, "A", 130)
    _system(tmp_path, "B", 70)
    build, stream = load_stream(tmp_path, 10, 10_000)
    assert build == [f"A line {i}" for i in range(10)] + [f"B line {i}" for i in range(10)]
    expected = ([f"A line {i}" for i in range(10, 60)] + [f"B line {i}" for i in range(10, 60)]
                + [f"A line {i}" for i in range(60, 110)] + [f"B line {i}" for i in range(60, 70)]
                + [f"A line {i}" for i in range(110, 130)])
    assert stream == expected
    assert load_stream(tmp_path, 10, 7)[1] == expected[:7]


def test_a_folder_without_loghub_files_is_refused_naming_it(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=str(tmp_path)):
        load_stream(tmp_path, 10, 10)


def test_batches_are_dealt_round_robin_and_cover_every_row_once() -> None:
    dealt = [_batches(70, 8, node, 4) for node in range(4)]
    assert dealt[0][:2] == [list(range(0, 8)), list(range(32, 40))]
    rows = sorted(row for node in dealt for batch in node for row in batch)
    assert rows == list(range(70))
