"""``attnstore bench search``: the smoke run prints a table and writes complete JSON."""

from __future__ import annotations

import json
from pathlib import Path

import faiss
import pytest

from attnstore_tools.cli import main


def test_bench_search_smoke_writes_latencies_for_hnsw_and_flat(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "search.json"
    threads = faiss.omp_get_max_threads()
    args = ["--n", "2000", "--dim", "16", "--queries", "40", "--batch", "8", "--runs", "2", "--json", str(out)]
    code = main(["bench", "search", *args])
    assert code == 0
    assert faiss.omp_get_max_threads() == threads  # the search-thread setting does not leak
    report = json.loads(out.read_text())
    assert report["n"] == 2000 and report["cores"] >= 1 and report["torch_threads"] >= 1
    for name in ("hnsw", "flat"):
        row = report["results"][name]
        assert 0 < row["single_p50_ms"] <= row["single_p99_ms"]
        assert 0 < row["batch_p50_ms"] <= row["batch_p99_ms"]
        assert row["build_s"] >= 0
    assert report["results"]["flat"]["recall_at_1"] == 1.0
    assert report["results"]["hnsw"]["recall_at_1"] >= 0.9
    assert isinstance(report["meets_target"], bool)
    table = capsys.readouterr().out
    assert "hnsw" in table and "flat" in table and "1q p50 ms" in table


def test_bench_search_rejects_a_non_positive_size(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["bench", "search", "--n", "0"])
    assert "--n" in capsys.readouterr().err
