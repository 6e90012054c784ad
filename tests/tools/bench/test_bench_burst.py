"""``bench burst``: a node's memory at start, in steady traffic, under a burst of maximal requests and after it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from attnstore_tools.cli import main as cli_main
from tests.support.data import small_data

pytestmark = pytest.mark.real_model


@pytest.mark.soak
def test_a_short_burst_reports_every_phases_memory_and_the_bound_its_settings_give(tmp_path: Path) -> None:
    data = small_data(tmp_path / "data", 40)
    out = tmp_path / "burst.json"
    code = cli_main(["bench", "burst", "--data-dir", str(data), "--work-dir", str(tmp_path / "work"),
                     "--steady-requests", "20", "--burst-clients", "4", "--burst-rounds", "1", "--max-inputs", "4",
                     "--memory-budget", "128MiB", "--settle", "0.5", "--json", str(out)])
    report = json.loads(out.read_text())
    assert code == 0 and report["errors"] == 0
    memory = report["memory"]
    assert set(memory) == {"start", "steady", "burst_peak", "after", "after_steady"}
    for kinds in memory.values():
        assert kinds["rss"] > 100 * 2**20 and kinds["anon"] + kinds["file"] <= kinds["rss"] + 2**20
    assert memory["burst_peak"]["rss"] >= memory["start"]["rss"]
    bound = report["bound"]
    assert bound["rss"] == bound["start"] + bound["memory_budget"] + bound["rows"]
    assert bound["memory_budget"] == 128 * 2**20 and report["peak_within_bound"] is True
    assert report["burst"]["rows"] == 16
    assert report["after_vs_steady"] == memory["after"]["rss"] / memory["steady"]["rss"]


def test_bad_settings_are_refused_by_name_before_anything_is_built(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli_main(["bench", "burst", "--max-inputs", "0", "--work-dir", str(tmp_path)]) != 0
    assert "--max-inputs must be >= 1, got 0" in capsys.readouterr().err
    assert cli_main(["bench", "burst", "--settle", "-1", "--work-dir", str(tmp_path)]) != 0
    assert "--settle must be >= 0" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())
