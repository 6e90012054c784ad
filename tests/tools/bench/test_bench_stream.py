"""``bench stream``: the stream's make-up, the deal of batches over node processes, a short cold-start run."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from attnstore.errors import ConfigError
from attnstore_tools.bench.stream import COLD_START, load_stream
from attnstore_tools.bench.stream_node import _batches
from attnstore_tools.cli import main as cli_main


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


def test_batches_are_dealt_round_robin_and_cover_every_row_of_the_run_once() -> None:
    dealt = [_batches(0, 70, 8, node, 4) for node in range(4)]
    assert dealt[0][:2] == [list(range(0, 8)), list(range(32, 40))]
    rows = sorted(row for node in dealt for batch in node for row in batch)
    assert rows == list(range(70))
    second_half = [_batches(35, 70, 8, node, 4) for node in range(4)]
    assert second_half[1][0] == list(range(43, 51))
    assert sorted(row for node in second_half for batch in node for row in batch) == list(range(35, 70))


@pytest.mark.soak
def test_a_cold_start_run_fills_an_empty_namespace_trains_its_projector_halfway_and_reports_each_half(
    tmp_path: Path,
) -> None:
    out = tmp_path / "stream.json"
    baselines = ["plain", "dict", "redis_cache"] if shutil.which("redis-server") else ["plain", "dict"]
    code = cli_main(["bench", "stream", "--cold-start", "--limit", "256", "--nodes", "2", "--batch", "16",
                     "--admit-after", "1", "--variants", ",".join(baselines), "--json", str(out)])
    result = json.loads(out.read_text())
    assert code == 0 and result["errors"] == 0, [v["errors"] for v in result["variants"].values()]
    assert list(result["variants"]) == [*baselines, COLD_START] and result["candidate"] == COLD_START
    if "redis_cache" in baselines:  # the shared cache starts empty too, and keeps every distinct line
        redis = result["variants"]["redis_cache"]["redis"]
        assert redis["prefilled_keys"] == 0 and redis["keys"] > 0 and result["speedup_vs_redis_cache"] > 0
    cold = result["variants"][COLD_START]
    fill, trained = cold["phases"]
    assert fill["rows"] == trained["rows"] == 128 and fill["hit_rate"]["map"] == 0  # no projector yet
    # The projector was trained from maps the first half wrote back, then every node could look maps up.
    report = trained["train_projector"]
    assert report["projector_version"] == 1 and report["entries"] >= 16 and trained["train_projector_seconds"] > 0
    assert cold["daemon"]["written_back_entries"] >= report["entries"] and result["daemon_rss_within_caps"]
    # Every row answered; the dicts start empty, so their first rows are all misses.
    # A projector trained on a few dozen written-back maps calibrates no threshold (too few pseudo-query hits to
    # trust one); its map hits were at cosine 0.40 when it did. Map hits left: rows stored meanwhile, distance 0.
    assert sum(cold["hit_rate"].values()) == pytest.approx(1.0) and cold["frac_cos_099"] >= 0.99
    assert result["variants"]["dict"]["hit_rate"]["miss"] > 0.5
