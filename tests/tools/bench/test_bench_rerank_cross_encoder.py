"""``bench rerank`` with a cross-encoder: the bench's own model built once, the baseline servers' scores equal to
``CrossEncoder.predict``'s, the node's speedups naming the fastest peer behind a dict, and (soak) the whole bench
on a tiny random BERT cross-encoder."""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path

import numpy as np
import pytest

from attnstore.errors import ConfigError
from attnstore_tools.bench.cross_encoder_server import CrossEncoderEmbedder
from attnstore_tools.bench.rerank import _methods, _speedups, cross_minilm
from attnstore_tools.cli import main as cli_main

PAIRS = [("A man is playing a guitar.", "A man plays the guitar in the park."), ("A woman slices onions.", "Dogs run."),
         ("A man is playing a guitar.", "Dogs run.")]


@pytest.fixture(scope="module")
def tiny_cross_encoder(tiny_minilm: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny random BERT as ``cross_minilm`` builds all-MiniLM-L6-v2: one logit, a seeded head."""
    return cross_minilm(tmp_path_factory.mktemp("cross") / "cross-tiny", source=str(tiny_minilm))


def _scores(embedder: CrossEncoderEmbedder, activation: str | None = "model") -> np.ndarray:
    embedder.start()
    deadline = time.monotonic() + 120
    while embedder.info is None and embedder.failure is None and time.monotonic() < deadline:
        time.sleep(0.05)
    try:
        assert embedder.failure is None and embedder.info is not None and embedder.info.classes == ("LABEL_0",)
        first = asyncio.run(embedder.classify(PAIRS, activation=activation, truncate=True,  # type: ignore[arg-type]
                                              max_input_tokens=512))
        again = asyncio.run(embedder.classify(PAIRS, activation=activation, truncate=True,  # type: ignore[arg-type]
                                              max_input_tokens=512))
    finally:
        embedder.stop()
    assert first.vectors.shape == (len(PAIRS), 1) and first.tokens > 0
    np.testing.assert_array_equal(first.vectors, again.vectors)
    return first.vectors


def test_the_bench_model_is_built_once_alike_and_loads_as_a_cross_encoder_of_one_logit(
    tiny_minilm: Path, tiny_cross_encoder: Path, tmp_path: Path,
) -> None:
    from safetensors.torch import load_file

    from attnstore_client.models import load_model

    again = cross_minilm(tmp_path / "again", source=str(tiny_minilm))
    ours, theirs = load_file(tiny_cross_encoder / "model.safetensors"), load_file(again / "model.safetensors")
    assert set(ours) == set(theirs) and all(bool((ours[k] == theirs[k]).all()) for k in ours)
    stamp = (again / "config.json").stat().st_mtime_ns
    assert cross_minilm(again, source="no-such-model") == again and (again / "config.json").stat().st_mtime_ns == stamp
    loaded = load_model(str(tiny_cross_encoder))
    assert loaded.classifier is not None and loaded.classifier.num_labels == 1


def test_the_cached_server_answers_as_crossencoder_predict(tiny_cross_encoder: Path) -> None:
    from sentence_transformers import CrossEncoder

    expected = CrossEncoder(str(tiny_cross_encoder), local_files_only=True, device="cpu").predict(PAIRS)
    scores = _scores(CrossEncoderEmbedder(str(tiny_cross_encoder), cached=True, threads=1))
    np.testing.assert_allclose(scores[:, 0], expected, atol=1e-6)


def test_a_peer_server_takes_token_types_and_answers_as_crossencoder_predict(
    tiny_cross_encoder: Path, tmp_path: Path,
) -> None:
    pytest.importorskip("onnxruntime", reason="the peers extra is not installed")
    pytest.importorskip("onnx", reason="the peers extra is not installed")
    import onnxruntime
    from sentence_transformers import CrossEncoder

    from attnstore_client.models import load_model
    from attnstore_tools.bench.cross_encoder_peers import pair_graphs

    (graph,) = pair_graphs(load_model(str(tiny_cross_encoder)), ["onnx_fp32"], tmp_path).values()
    assert "token_type_ids" in [i.name for i in onnxruntime.InferenceSession(str(graph)).get_inputs()]
    model = CrossEncoder(str(tiny_cross_encoder), local_files_only=True, device="cpu")
    scores = _scores(CrossEncoderEmbedder(str(tiny_cross_encoder), cached=True, threads=1, peer="onnx_fp32",
                                          graph=graph), activation=None)
    np.testing.assert_allclose(scores[:, 0], model.predict(PAIRS, activation_fn=lambda x: x), atol=1e-5)


def test_the_node_speedups_name_the_fastest_peer_behind_a_dict() -> None:
    def row(method: str, rate: float) -> dict[str, object]:
        return {"method": method, "clients": 32, "items_per_s": rate, "p99_ms": 1000 / rate}

    report = {"results": {m: [row(m, rate)] for m, rate in
                          (("node", 400.0), ("plain", 100.0), ("onnx_o3_dict", 200.0), ("openvino_dict", 250.0))}}
    (line,) = _speedups(report)
    assert line["fastest_peer_dict"] == "openvino_dict" and line["x_fastest_peer_dict"] == pytest.approx(1.6)
    assert line["x_plain"] == pytest.approx(4.0) and "x_node" not in line


def test_a_decoder_refuses_the_peer_servers() -> None:
    args = argparse.Namespace(methods=["node", "onnx_o3_dict"], model="smollm2")
    with pytest.raises(ConfigError, match="onnx_o3_dict"):
        _methods(args, cross_encoder=False)
    assert _methods(argparse.Namespace(methods=None, model="x"), cross_encoder=False) == ["node", "plain", "cached"]


@pytest.mark.soak
def test_the_node_plain_and_a_peer_behind_a_dict_rank_every_request_alike(
    tiny_cross_encoder: Path, tmp_path: Path, capsys,
) -> None:
    pytest.importorskip("onnxruntime", reason="the peers extra is not installed")
    out = tmp_path / "rerank.json"
    code = cli_main(["bench", "rerank", "--model", str(tiny_cross_encoder), "--methods", "node", "plain",
                     "onnx_fp32_dict", "--clients", "2", "--requests", "2", "--min-documents", "3", "--max-documents",
                     "4", "--threads", "1", "--peers-cache", str(tmp_path / "peers"), "--json", str(out)])
    report = json.loads(out.read_text())
    assert code == 0 and report["cross_encoder"] is True and list(report["peer_graphs"]) == ["onnx_fp32"]
    for method, (result,) in report["results"].items():
        assert (result["clients"], result["requests"], result["errors"]) == (2, 2, 0), method
        assert result["same_ranking"] is True and result["max_diff"] < 1e-4, method
    (speedup,) = report["speedups"]
    assert speedup["fastest_peer_dict"] == "onnx_fp32_dict" and speedup["x_plain"] > 0
    assert "fastest peer behind a dict's (onnx_fp32_dict)" in capsys.readouterr().out
