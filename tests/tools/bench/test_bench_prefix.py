"""``attnstore bench prefix`` end to end on a tiny local decoder."""

from __future__ import annotations

import json

from attnstore_tools.cli import main
from tests.support.adapters import save_tiny_decoder


def test_bench_prefix_prints_a_table_and_writes_the_json(tmp_path, capsys):
    model_dir = save_tiny_decoder(tmp_path / "tiny")
    out = tmp_path / "bench.json"
    argv = ["bench", "prefix", "--model", str(model_dir), "--prefixes", "16,32", "--suffixes", "4", "--block-size",
            "8", "--batch", "2", "--warmup", "0", "--json", str(out)]
    assert main(argv) == 0
    report = json.loads(out.read_text())
    assert [(r["prefix"], r["suffix"]) for r in report["results"]] == [(16, 4), (32, 4)]
    for result in report["results"]:
        assert result["full_ms"] > 0 and result["prefix_ms"] > 0 and result["bytes_per_row"] > 0
        # The ratio of the unrounded times; each time is rounded to 0.01 ms, the ratio to 0.001.
        full, prefix = result["full_ms"], result["prefix_ms"]
        assert (full - 0.005) / (prefix + 0.005) - 0.0005 <= result["speedup"] <= (full + 0.005) / max(
            prefix - 0.005, 1e-9) + 0.0005
    assert "prefix ms" in capsys.readouterr().out


def test_bench_prefix_refuses_prefixes_that_are_not_whole_blocks(capsys):
    assert main(["bench", "prefix", "--model", "smollm2", "--prefixes", "100", "--block-size", "32"]) == 2
    assert "multiples of --block-size" in capsys.readouterr().err
