"""``attnstore demo``: where it finds its data, what it reads, and a real run end to end."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from attnstore.errors import ConfigError
from attnstore_tools.cli import main
from attnstore_tools.corpus import data_dir
from attnstore_tools.demo import log_lines

DATA = Path(__file__).resolve().parents[3] / "shared" / "data"


def test_data_dir_prefers_flag_then_environment(tmp_path, monkeypatch):
    flagged, env = tmp_path / "flag", tmp_path / "env"
    flagged.mkdir()
    env.mkdir()
    monkeypatch.setenv("ATTNSTORE_DATA", str(env))
    assert data_dir(flagged) == flagged.resolve()
    assert data_dir(None) == env.resolve()
    monkeypatch.setenv("ATTNSTORE_DATA", str(tmp_path / "missing"))
    with pytest.raises(ConfigError, match="ATTNSTORE_DATA"):
        data_dir(None)


def test_log_lines_store_lines_spread_over_each_systems_first_half_and_ask_the_first_of_its_second(tmp_path):
    (tmp_path / "loghub").mkdir()
    for system in ("A", "B"):
        rows = "".join(f"{system}{i}\t{system} line {i}\n" for i in range(12))
        (tmp_path / "loghub" / f"{system}.tsv").write_text("event_id\tcontent\n" + rows)
    stored, queries = log_lines(tmp_path, stored=2, queries=1)
    assert stored == ["A line 0", "A line 3", "B line 0", "B line 3"]  # every third line of the six
    assert queries == ["A line 6", "B line 6"]


def test_log_lines_refuse_a_folder_without_loghub_files(tmp_path):
    with pytest.raises(ConfigError, match="loghub"):
        log_lines(tmp_path, 1, 1)
    (tmp_path / "loghub").mkdir()
    (tmp_path / "loghub" / "A.tsv").write_text("event_id\ttext\nA1\tx\n")
    with pytest.raises(ConfigError, match="no 'content' column"):
        log_lines(tmp_path, 1, 1)


# The six Loghub systems of short lines: enough near-duplicates for the build to fit a fidelity gate, in a
# fraction of the capture and calibration time of all eight (HDFS's and Hadoop's long lines cost most).
_SHORT_SYSTEMS = ("Apache", "BGL", "Linux", "OpenSSH", "Spark", "Zookeeper")


@pytest.mark.real_model
@pytest.mark.soak  # a whole run of the README's main job (1.5 min); CI also runs `attnstore demo` as its first step
def test_demo_builds_a_store_and_serves_held_out_lines_with_map_hits_and_every_row_faithful(tmp_path, capsys):
    if not (DATA / "loghub").is_dir():
        pytest.skip(f"no evaluation data at {DATA}")
    (tmp_path / "data" / "loghub").mkdir(parents=True)
    for system in _SHORT_SYSTEMS:
        (tmp_path / "data" / "loghub" / f"{system}.tsv").symlink_to(DATA / "loghub" / f"{system}.tsv")
    argv = ["demo", "--data", str(tmp_path / "data"), "--store", str(tmp_path / "store"), "--queries", "40",
            "--no-progress", "--plot", str(tmp_path / "demo.png")]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert re.search(r"^fidelity gate: 4 candidates per query", out, re.M)
    rows = int(re.search(r"AttnCache, row by row \((\d+) rows", out).group(1))
    assert rows == 40 * len(_SHORT_SYSTEMS)
    kinds = {kind: (int(count), float(least)) for count, least, kind in
             re.findall(r"^\s+(\d+)\s+(\S+)\s+\S+\s+\S+%\s+(exact|map|computed)", out, re.M)}
    assert sum(count for count, _ in kinds.values()) == rows and "fallback" not in out
    assert kinds["exact"][0] > 0  # log lines repeat across a system's halves
    assert kinds["map"][0] > 0 and kinds["map"][1] >= 0.99  # the gate held on held-out lines: every hit faithful
    assert kinds["exact"][1] >= 0.9999 and kinds["computed"][1] >= 0.9999
    assert re.search(r"^\s+1-8\s+\d+\s+\d+\s+", out, re.M)  # the cost model's choice per length band
    table = dict(re.findall(r"^\| (AttnCache|sentence-transformers \+ dict|sentence-transformers)\s+\|.*\|\s+(\S+)%"
                            r" \|\s+\S+ \|$", out, re.M))
    assert set(table) == {"AttnCache", "sentence-transformers + dict", "sentence-transformers"}
    assert float(table["sentence-transformers + dict"]) == 100.0 and float(table["AttnCache"]) == 100.0
    assert (tmp_path / "demo.png").stat().st_size > 0
    assert main(argv) == 0  # a second run reuses the namespace
    assert "reusing namespace 'demo'" in capsys.readouterr().out
