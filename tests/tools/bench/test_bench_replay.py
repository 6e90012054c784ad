"""``attnstore bench replay`` end to end on a tiny local decoder."""

from __future__ import annotations

import json

import pytest

from attnstore_tools.cli import main
from tests.support.adapters import save_tiny_decoder


def test_bench_replay_prints_a_table_and_writes_the_json(tmp_path, capsys):
    model_dir = save_tiny_decoder(tmp_path / "tiny")
    out = tmp_path / "bench.json"
    argv = ["bench", "replay", "--model", str(model_dir), "--lengths", "8,24", "--batch", "2", "--warmup", "0"]
    assert main([*argv, "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert {"cores", "torch_threads", "torch", "cpu_model"} <= set(report["machine"])
    assert report["batch"] == 2 and [r["length"] for r in report["results"]] == [8, 24]
    for result in report["results"]:
        assert result["sdpa_ms"] > 0 and result["eager_ms"] > 0 and result["replay_ms"] > 0
        assert result["speedup_vs_sdpa"] == pytest.approx(result["sdpa_ms"] / result["replay_ms"], rel=0.01)
        assert 0 < result["attention_share"] < 1
    table = capsys.readouterr().out
    assert "x sdpa" in table and "attn share" in table


def test_bench_replay_refuses_bad_lengths(capsys):
    assert main(["bench", "replay", "--model", "minilm", "--lengths", "32,abc"]) == 2
    assert "--lengths" in capsys.readouterr().err
