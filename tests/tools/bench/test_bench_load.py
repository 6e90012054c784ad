"""``attnstore bench load``: a short run of two client processes against its own daemon."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from attnstore_tools.bench.load import DaemonCaps, LoadSpec, synthetic_entry
from attnstore_tools.cli import main as cli_main


def test_synthetic_entries_are_valid_maps_and_repeatable() -> None:
    spec = LoadSpec(length=6, layers=2, heads=3)
    entry = synthetic_entry(spec, 7)
    maps = entry.maps.astype("float32")  # (layers, heads, L, L)
    assert entry.maps.shape == (2, 3, 6, 6) and abs(maps.sum(-1) - 1).max() < 1e-2
    assert (maps[..., 0, 1:] == 0).all()  # causal: row 0 sees only token 0
    assert synthetic_entry(spec, 7).token_hash == entry.token_hash != synthetic_entry(spec, 8).token_hash


def test_anon_budget_is_overhead_plus_dram_plus_staging() -> None:
    caps = DaemonCaps(dram_bytes=10, max_ingest_bytes=3, max_ingest_streams=4, fixed_overhead=100)
    assert caps.anon_budget == 122


@pytest.mark.soak
def test_short_load_run_has_no_errors_and_reports_latency_and_daemon_rss(tmp_path: Path) -> None:
    out = tmp_path / "load.json"
    code = cli_main(["bench", "load", "--clients", "2", "--duration", "2", "--entries", "16",
                     "--json", str(out)])
    report = json.loads(out.read_text())
    assert code == 0 and report["errors_total"] == 0, report["errors"]
    assert report["rpcs"]["Lookup"]["calls"] > 0 and report["rpcs"]["Lookup"]["p99_ms"] > 0
    assert report["rows"]["map"] > 0 and report["rows"]["exact"] > 0 and report["rows"]["miss"] > 0
    daemon = report["daemon"]
    assert daemon["anon_within_budget"] and daemon["samples"] and daemon["rss_idle"]["rss"] > 0


@pytest.mark.soak
def test_a_short_load_run_on_two_daemons_sharing_a_redis_cluster_has_no_errors(redis_cluster, tmp_path: Path) -> None:
    out = tmp_path / "load.json"
    code = cli_main(["bench", "load", "--clients", "2", "--duration", "3", "--entries", "16", "--daemons", "2",
                     "--ingest-fraction", "0.5", "--store", redis_cluster.url(), "--json", str(out)])
    report = json.loads(out.read_text())
    assert code == 0 and report["errors_total"] == 0, report["errors"]
    assert report["daemons"] == 2 and report["store"].startswith("redis://")
    assert report["rows"]["map"] > 0 and report["rows"]["exact"] > 0 and report["rpcs"]["Ingest"]["calls"] > 0


def test_several_daemons_need_a_shared_redis_store() -> None:
    with pytest.raises(SystemExit, match="needs a shared store"):
        cli_main(["bench", "load", "--daemons", "2"])


@pytest.mark.soak
def test_a_fault_run_sigkills_one_of_two_daemons_mid_load_and_the_lookups_go_on_without_errors(
    redis_cluster, tmp_path: Path
) -> None:
    out = tmp_path / "load.json"
    code = cli_main(["bench", "load", "--clients", "2", "--duration", "4", "--entries", "16", "--daemons", "2",
                     "--ingest-fraction", "0", "--kill-daemon-after", "1.5", "--store", redis_cluster.url(),
                     "--json", str(out)])
    report = json.loads(out.read_text())
    assert code == 0 and report["errors_total"] == 0, report["errors"]
    assert report["killed_daemon_after_s"] == 1.5 and report["rows"]["map"] > 0 and report["rows"]["exact"] > 0


@pytest.mark.parametrize("args", [["--kill-daemon-after", "1"], ["--kill-daemon-after", "1", "--target", "h:1",
                                                                  "--token", "t", "--daemons", "2"]])
def test_a_fault_run_needs_two_daemons_of_its_own(args: list[str]) -> None:
    with pytest.raises(SystemExit, match="--kill-daemon-after needs --daemons 2 or more"):
        cli_main(["bench", "load", *args])
