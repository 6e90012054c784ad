"""``attnstore node --engine``: a node whose compute tier runs on a graph answers as sentence-transformers."""

from __future__ import annotations

from pathlib import Path

import httpx
import numpy as np
import pytest
from sentence_transformers import SentenceTransformer

from attnstore_tools.cli import main
from tests.support.adapters import save_tiny_family
from tests.support.nodes import API_KEY, NodeProcess

pytest.importorskip("openvino")

HEADERS = {"Authorization": f"Bearer {API_KEY}"}
CORPUS = [f"Failed password for {user} from 10.0.0.{host} port 22 ssh2" for user in ("root", "admin") for host in
          range(1, 9)]
TEXTS = [CORPUS[0], "A man is playing a guitar.", "hi", "The quick brown fox jumps over the lazy dog again.", "ok"]


def test_a_node_computing_on_openvino_answers_as_sentence_transformers(tmp_path: Path) -> None:
    folder = save_tiny_family("bert", tmp_path / "model", pooling="mean")
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(CORPUS), encoding="utf-8")
    assert main(["build", "--model", str(folder), "--corpus", str(corpus), "--store", str(tmp_path / "store"),
                 "--no-progress", "--no-calibration", "--train-limit", "16"]) == 0
    expected = SentenceTransformer(str(folder), device="cpu").encode(TEXTS)
    node = NodeProcess(str(folder), f"local:{tmp_path / 'store'}", tmp_path, keys=True,
                       args=("--no-warmup", "--engine", "openvino"),
                       env={"ATTNSTORE_ENGINES_CACHE": str(tmp_path / "engines")}).start()
    try:
        answer = httpx.post(f"{node.url}/v1/embeddings", json={"model": str(folder), "input": TEXTS},
                            headers=HEADERS, timeout=120)
        assert answer.status_code == 200, answer.text
        got = np.array([item["embedding"] for item in answer.json()["data"]])
        np.testing.assert_allclose(got[1:], expected[1:], atol=1e-5)  # computed on the graph
        assert float(got[0] @ expected[0]) > 0.9999  # served from the store (fp16 outputs)
        assert list((tmp_path / "engines").glob("*/openvino-*/openvino_model.xml"))  # the graph it ran on
    finally:
        assert node.stop() == 0, node.log()
