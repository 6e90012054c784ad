"""``attnstore bench store`` runs end to end on a tiny entry and writes the agreed JSON keys."""

from __future__ import annotations

import json

from attnstore_tools.cli import main


def test_bench_store_writes_a_table_and_json(tmp_path, capsys):
    out = tmp_path / "bench.json"
    code = main(
        ["bench", "store", "--json", str(out), "--dir", str(tmp_path), "--layers", "2", "--heads", "2",
         "--length", "16", "--entries", "2", "--runs", "2", "--warmup", "1"]
    )
    assert code == 0
    result = json.loads(out.read_text())
    required = ("dram_ms", "pagecache_ms", "cold_ms", "memcpy_ms", "bytes_fp16", "bytes_q8_zstd")
    required += ("cores", "torch_threads", "ingest_entries_per_s", "ingest_mb_per_s")
    assert set(required) <= set(result)
    assert result["bytes_fp16"] == 2 * 2 * 16 * 16 * 2
    assert result["q8_within_bound"] and result["q8_zstd_within_bound"]
    assert "page cache" in capsys.readouterr().out
