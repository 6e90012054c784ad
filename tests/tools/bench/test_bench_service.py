"""``attnstore bench service`` end to end on a tiny local decoder and a real daemon subprocess."""

from __future__ import annotations

import json

import pytest

from attnstore_tools.cli import main
from tests.support.adapters import save_tiny_decoder


@pytest.mark.soak
def test_bench_service_times_every_path_and_writes_the_json(tmp_path, capsys):
    model_dir = save_tiny_decoder(tmp_path / "tiny")
    out = tmp_path / "bench.json"
    argv = ["bench", "service", "--model", str(model_dir), "--length", "12", "--batch", "3", "--warmup", "0",
            "--threads", "1", "--json", str(out)]
    assert main(argv) == 0
    report = json.loads(out.read_text())
    assert {"cpu_count", "torch_threads", "cpu_model", "load_average_before"} <= set(report)
    assert (report["length"], report["batch"], report["repeats"]) == (12, 3, 5)
    variants = {v["variant"]: v for v in report["variants"]}
    assert list(variants) == ["baseline", "replay_memory", "hit", "hit_dram", "hit_wait_all", "miss", "exact"]
    assert variants["hit"]["mib_fetched"] > 0 and variants["hit_dram"]["max_abs_diff"] < 1e-2
    assert variants["exact"]["forward_ms"] == 0
    assert variants["exact"]["speedup_excluding_retrieval"] is None
    assert variants["miss"]["max_abs_diff"] < 1e-5 and variants["hit"]["max_abs_diff"] < 1e-2
    assert len(variants["hit"]["total_ms_samples"]) == 5
    assert set(report["targets"]) == {"hit_vs_replay_memory", "miss_vs_baseline", "exact_speedup"}
    assert "hit_vs_replay_memory" in capsys.readouterr().out


def test_bench_service_refuses_fewer_than_five_repeats():
    assert main(["bench", "service", "--model", "minilm", "--repeats", "3"]) == 2
