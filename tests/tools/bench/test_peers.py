"""The peers (ONNX Runtime fp32, O3, int8; OpenVINO fp32) on a tiny random BERT with MiniLM's
sentence-transformers configuration: each equals the torch pipeline within its precision, the cache is reused,
and ``bench encode`` runs them in its children."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from attnstore.errors import ConfigError
from attnstore_client.models import LoadedModel, load_model
from attnstore_tools.bench import peers_export
from attnstore_tools.bench.peers import PEERS, load_peer, open_peer, weightless_pipeline
from attnstore_tools.bench.peers_export import export_graph
from attnstore_tools.cli import main as cli_main
from tests.support.adapters import save_tiny_family
from tests.support.data import small_data
from tests.support.vectors import row_cosines

for _module in ("onnx", "onnxruntime", "openvino"):
    pytest.importorskip(_module, reason=f"{_module} is not installed: the peers extra (pip install -e '.[peers]')")

TEXTS = [
    "a short one",
    "Receiving block blk_-1608999687919862906 src: /10.250.19.102:54106 dest: /10.250.19.102:50010",
    "x",
    "the peers sort the texts by length and give the vectors back in input order",
    "a short one",  # a repeat
    "Failed password for invalid user admin from 183.62.140.253 port 51184 ssh2",
    "",
]
# fp32 graphs: the same arithmetic in another order; O3 swaps GELU for its tanh approximation.
TOLERANCE = {"onnx_fp32": 1e-5, "onnx_o3": 1e-3, "openvino_fp32": 1e-5}


@pytest.fixture(scope="module")
def tiny(tiny_minilm: Path) -> Path:
    """The tiny random BERT with MiniLM's tokenizer and sentence-transformers modules (``conftest.tiny_minilm``)."""
    return tiny_minilm


@pytest.fixture(scope="module")
def loaded(tiny: Path) -> LoadedModel:
    return load_model(str(tiny))


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("peers-cache")


@pytest.mark.parametrize("name", PEERS)
def test_each_peer_equals_the_torch_pipeline_within_its_precision(
    name: str, loaded: LoadedModel, cache: Path,
) -> None:
    pipeline = loaded.sentence_transformer
    assert pipeline is not None
    expected = pipeline.encode(TEXTS, batch_size=3, show_progress_bar=False)
    peer = open_peer(name, export_graph(name, loaded, cache_dir=cache), pipeline, threads=1)
    got = peer.encode(TEXTS, batch_size=3)  # batches of mixed lengths, sorted and put back in order
    assert got.shape == expected.shape and got.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)  # the pipeline's Normalize ran
    if name == "onnx_int8":
        assert row_cosines(got, expected).min() >= 0.9
    else:
        assert np.abs(got - expected).max() <= TOLERANCE[name]
    np.testing.assert_array_equal(got[0], got[4])  # a repeat gets the same vector
    assert peer.encode([], batch_size=3).shape == (0, expected.shape[1])


@pytest.mark.parametrize("name", ["onnx_fp32", "openvino_fp32"])
def test_a_model_whose_tokenizer_gives_no_token_types_exports_with_the_inputs_it_takes(
    name: str, tmp_path: Path,
) -> None:
    # MPNet (all-mpnet-base-v2) and DistilBERT take input ids and a mask only.
    loaded = load_model(str(save_tiny_family("mpnet", tmp_path / "mpnet", pooling="mean")))
    pipeline = loaded.sentence_transformer
    assert pipeline is not None and "token_type_ids" in pipeline.preprocess(["a"])  # MiniLM's tokenizer gives them
    peer = open_peer(name, export_graph(name, loaded, cache_dir=tmp_path / "cache"), pipeline, threads=1)
    assert peer.input_names == ["input_ids", "attention_mask"]
    expected = pipeline.encode(TEXTS, batch_size=3, show_progress_bar=False)
    assert np.abs(peer.encode(TEXTS, batch_size=3) - expected).max() <= TOLERANCE[name]


def test_a_peer_on_a_weightless_pipeline_equals_one_on_the_loaded_pipeline(
    tiny: Path, loaded: LoadedModel, cache: Path,
) -> None:
    graph = export_graph("onnx_fp32", loaded, cache_dir=cache)
    assert loaded.sentence_transformer is not None
    bare = weightless_pipeline(str(tiny))
    assert next(bare[0].parameters()).device.type == "meta"  # the torch weights were never read
    np.testing.assert_array_equal(
        open_peer("onnx_fp32", graph, bare, threads=1).encode(TEXTS),
        open_peer("onnx_fp32", graph, loaded.sentence_transformer, threads=1).encode(TEXTS),
    )


def test_a_second_export_reuses_the_cached_graph(
    tiny: Path, loaded: LoadedModel, cache: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    first = {name: export_graph(name, loaded, cache_dir=cache) for name in PEERS}
    stamps = {name: path.stat().st_mtime_ns for name, path in first.items()}

    def refuse(*args: object) -> None:
        raise AssertionError("exported again")

    for exporter in ("_export_onnx", "_optimize_o3", "_quantize_avx2", "_convert_openvino"):
        monkeypatch.setattr(peers_export, exporter, refuse)
    again = load_model(str(tiny))  # another load of the same weights: the same fingerprint
    assert {name: export_graph(name, again, cache_dir=cache) for name in PEERS} == first
    assert {name: path.stat().st_mtime_ns for name, path in first.items()} == stamps
    assert load_peer("onnx_o3", str(tiny), threads=1, cache_dir=cache).graph == first["onnx_o3"]
    # One folder per peer, no scratch folder left behind.
    assert sorted(p.name.split("-")[0] for p in first["onnx_fp32"].parent.parent.iterdir()) == sorted(PEERS)


def test_a_failed_export_leaves_nothing_in_the_cache(
    loaded: LoadedModel, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    def fail(*args: object) -> None:
        raise RuntimeError("export failed")

    monkeypatch.setattr(peers_export, "_export_onnx", fail)
    with pytest.raises(RuntimeError, match="export failed"):
        export_graph("onnx_fp32", loaded, cache_dir=tmp_path)
    assert [p for p in tmp_path.rglob("*") if p.is_file()] == []


def test_an_unknown_peer_is_refused_naming_the_peers(loaded: LoadedModel, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"peer 'onnx_fp16' is not one of \['onnx_fp32', 'onnx_o3'"):
        export_graph("onnx_fp16", loaded, cache_dir=tmp_path)


@pytest.mark.soak
def test_bench_encode_runs_the_peers_in_children_with_fidelity_and_speedups_against_the_fastest_exact_peer(
    tiny: Path, cache: Path, tmp_path: Path,
) -> None:
    data, out = small_data(tmp_path / "data", 20), tmp_path / "encode.json"
    methods = "dict,onnx_o3_dict,onnx_int8,openvino_dict"  # bare and behind the dict; OpenVINO and ONNX Runtime
    code = cli_main(["bench", "encode", "--model", str(tiny), "--data-dir", str(data), "--rows", "30",
                     "--repeats", "1", "--threads", "1", "--methods", methods, "--work-dir", str(tmp_path / "work"),
                     "--peers-cache", str(cache), "--json", str(out)])
    report = json.loads(out.read_text())
    result = report["results"][0]
    assert code == 0 and list(result["methods"]) == methods.split(",")
    assert result["fidelity_reference"] == "dict"  # sentence-transformers' vectors, stored or computed
    assert result["fastest_exact_peer_dict"] in ("onnx_o3_dict", "openvino_dict")
    for method, entry in result["methods"].items():
        assert entry["seconds"] > 0 and entry["peak_rss_bytes"] > 50 * 2**20
        if method != "dict":
            assert entry["speedup_vs_dict"] > 0 and "frac_cos_099" in entry
        if method != result["fastest_exact_peer_dict"]:
            assert entry["speedup_vs_fastest_exact_peer_dict"] > 0
    assert all(result["methods"][m]["frac_cos_099"] == 1.0 for m in ("onnx_o3_dict", "openvino_dict"))
    assert result["methods"]["onnx_int8"]["min_cos"] >= 0.9
    assert set(report["peer_graphs"]) == {"onnx_o3", "onnx_int8", "openvino_fp32"}
    assert not list((tmp_path / "work" / "logs").glob("store-*"))  # no AttnCache method: no store built


def test_bench_encode_refuses_the_peers_on_another_device_before_building_anything(
    tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    assert cli_main(["bench", "encode", "--methods", "dict,onnx_o3_dict", "--device", "cuda",
                     "--work-dir", str(tmp_path)]) != 0
    assert "the peers run on the CPU only; --device 'cuda'" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())
