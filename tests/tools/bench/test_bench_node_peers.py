"""``bench node``'s peer servers (ONNX Runtime O3 and int8, OpenVINO, bare or behind a dict) end to end on a tiny
random BERT: each answers every request through the node's HTTP app, its fidelity beside its speed."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from attnstore_tools.bench.node.command import _command, _ratios
from attnstore_tools.cli import main as cli_main

for _module in ("onnx", "onnxruntime", "openvino"):
    pytest.importorskip(_module, reason=f"{_module} is not installed: the peers extra (pip install -e '.[peers]')")

PEER_SERVERS = ("onnx_o3", "onnx_o3_dict", "onnx_int8_dict", "openvino_dict")


@pytest.mark.soak
def test_each_peer_server_answers_every_request_with_the_reference_vectors_within_its_precision(
    tiny_minilm: Path, tiny_data: Path, tmp_path: Path,
) -> None:
    out = tmp_path / "node.json"
    code = cli_main(["bench", "node", "--servers", ",".join(("sentence_transformers", *PEER_SERVERS)),
                     "--clients", "3", "--requests", "8", "--max-lines", "5", "--threads", "1",
                     "--model", str(tiny_minilm), "--data-dir", str(tiny_data), "--work-dir", str(tmp_path / "work"),
                     "--peers-cache", str(tmp_path / "peers"), "--json", str(out)])
    report = json.loads(out.read_text())
    assert code == 0 and set(report["peer_graphs"]) == {"onnx_o3", "onnx_int8", "openvino_fp32"}
    (point,) = report["results"]
    servers = point["servers"]
    assert list(servers) == ["sentence_transformers", *PEER_SERVERS]
    for name, result in servers.items():
        assert (result["errors"], result["exit_code"], result["rows"]) == (0, 0, report["rows"]), name
        assert "vectors" not in result and result["rows_per_s"] > 0
    # fp32 graphs: the same vectors within fp32 rounding (O3's GELU approximation included); int8 keeps direction.
    assert servers["sentence_transformers"]["min_cos"] > 0.99999
    for name in ("onnx_o3", "onnx_o3_dict", "openvino_dict"):
        assert servers[name]["frac_cos_099"] == 1.0 and servers[name]["min_cos"] > 0.9999, name
    assert servers["onnx_int8_dict"]["min_cos"] >= 0.9


def test_the_node_is_compared_with_every_server_and_the_fastest_exact_peer_behind_a_dict() -> None:
    point = {"servers": {
        "attnstore": {"rows_per_s": 300.0, "p99_ms": 50.0},
        "onnx_o3_dict": {"rows_per_s": 200.0, "p99_ms": 100.0},
        "openvino_dict": {"rows_per_s": 150.0, "p99_ms": 80.0},
        "onnx_int8_dict": {"rows_per_s": 600.0, "p99_ms": 20.0},  # faster, but not exact: not the baseline
    }}
    _ratios(point)
    assert point["fastest_exact_peer_dict"] == "onnx_o3_dict"
    assert point["rows_per_s_vs_fastest_exact_peer_dict"] == 1.5 and point["p99_vs_fastest_exact_peer_dict"] == 0.5
    assert point["rows_per_s_vs_onnx_int8_dict"] == 0.5 and point["rows_per_s_vs_openvino_dict"] == 2.0


def test_a_node_on_another_engine_is_compared_with_the_fastest_exact_peer_behind_a_dict() -> None:
    point = {"servers": {
        "attnstore_openvino": {"rows_per_s": 400.0, "p99_ms": 40.0},
        "onnx_o3_dict": {"rows_per_s": 200.0, "p99_ms": 100.0},
    }}
    _ratios(point)
    assert point["fastest_exact_peer_dict"] == "onnx_o3_dict"
    assert point["engines"]["attnstore_openvino"] == {"rows_per_s_vs_fastest_exact_peer_dict": 2.0,
                                                     "p99_vs_fastest_exact_peer_dict": 0.4}
    assert "rows_per_s_vs_fastest_exact_peer_dict" not in point  # the torch node's ratio: it did not run


def test_a_node_server_runs_attnstore_node_with_its_engine(tmp_path) -> None:
    args = argparse.Namespace(model="minilm", threads=2, node_args="--audit-rate 0")
    command = _command(args, "attnstore_onnxruntime", tmp_path / "store", tmp_path, None, {})
    assert command[command.index("--engine") + 1] == "onnxruntime" and command[-2:] == ["--audit-rate", "0"]
    torch_node = _command(args, "attnstore", tmp_path / "store", tmp_path, None, {})
    assert torch_node[torch_node.index("--engine") + 1] == "torch"


@pytest.mark.soak
def test_a_node_on_openvino_answers_every_request_with_the_reference_vectors_beside_its_peer(
    tiny_minilm: Path, tiny_data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("ATTNSTORE_ENGINES_CACHE", str(tmp_path / "engines"))  # the node's graphs, not ~/.cache's
    out = tmp_path / "node.json"
    code = cli_main(["bench", "node", "--servers", "attnstore_openvino,openvino_dict", "--clients", "3",
                     "--requests", "8", "--max-lines", "5", "--threads", "1", "--model", str(tiny_minilm),
                     "--data-dir", str(tiny_data), "--work-dir", str(tmp_path / "work"),
                     "--peers-cache", str(tmp_path / "peers"), "--json", str(out)])
    report = json.loads(out.read_text())
    (point,) = report["results"]
    node = point["servers"]["attnstore_openvino"]
    assert code == 0 and (node["errors"], node["exit_code"], node["rows"]) == (0, 0, report["rows"])
    assert node["frac_cos_099"] == 1.0 and node["min_cos"] > 0.999
    assert sum(node["node"]["rows_by_tier"].values()) >= report["rows"]  # the node's own metrics, read
    assert point["engines"]["attnstore_openvino"]["rows_per_s_vs_fastest_exact_peer_dict"] > 0
    assert list((tmp_path / "engines").glob("*/openvino-*/openvino_model.xml"))  # the graph it computed on
