"""A real ``attnstore node`` over a store ``attnstore build`` made, for the adapter classes no other node test starts
(issue 49's acceptance): DistilBERT's and ModernBERT's (``/v1/embeddings`` equal to ``SentenceTransformer.encode``)
and Qwen3's (``/v1/score`` equal to the plain forward's label probabilities, rows served from the prefix blocks the
build stored). The other classes have theirs: BERT's and RoBERTa's, MPNet's and Llama's (``test_node_pipelines``,
``test_node_openai``, ``test_node_score``), the model's own forward (``test_node_generic``)."""

from __future__ import annotations

from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
from sentence_transformers import SentenceTransformer
from transformers import AutoModelForCausalLM, AutoTokenizer

from attnstore_tools.cli import main
from tests.support.adapters import save_tiny_family
from tests.support.nodes import API_KEY, NodeProcess
from tests.support.vectors import row_cosines

HEADERS = {"Authorization": f"Bearer {API_KEY}"}
CORPUS = [f"Failed password for {user} from 10.0.0.{host} port 22 ssh2"
          for user in ("root", "admin", "guest", "oracle") for host in range(1, 10)] + [
    "A man is playing a guitar.", "the quick brown fox", "Stocks fell sharply today in early trading.", "ok"]
TEXTS = [CORPUS[0], "A man is playing a guitar.", "hi", "The quick brown fox jumps over the lazy dog again.",
         CORPUS[7], "hi"]
rng = np.random.default_rng(49)
WORDS = ["alpha", "beta", "gamma", "delta", "river", "stone", "light", "north", "field", "cloud", "answer", "paris"]
# Longer than the prefix tier's 64 tokens, so a stored prefix pays.
QUERY = "Here are questions with their answers . " + " ".join(rng.choice(WORDS, size=80)) + " . The answer is"
ITEMS = [f" item {i} " + " ".join(rng.choice(WORDS, size=int(rng.integers(2, 6)))) for i in range(20)]
LABELS = [1037, 1038, 2003]
TOLERANCE = 1e-4


def _build(folder: Path, lines: list[str], workdir: Path, *args: str) -> str:
    """``attnstore build`` of ``lines`` into a store folder; its ``local:`` URL."""
    corpus = workdir / "corpus.txt"
    corpus.write_text("\n".join(lines), encoding="utf-8")
    store = workdir / "store"
    assert main(["build", "--model", str(folder), "--corpus", str(corpus), "--store", str(store), "--no-progress",
                 "--no-calibration", "--train-limit", "16", *args]) == 0
    return f"local:{store}"


def _rows_of(node: NodeProcess, tier: str) -> float:
    return node.metric(f'attnstore_node_rows_total{{tier="{tier}"}}')


@pytest.mark.parametrize(("family", "pooling"), [("distilbert", "mean"), ("modernbert", "cls")])
def test_an_encoder_node_over_a_built_store_answers_as_sentence_transformers(
    family: str, pooling: str, tmp_path: Path
) -> None:
    folder = save_tiny_family(family, tmp_path / "model", pooling=pooling)
    expected = SentenceTransformer(str(folder), device="cpu").encode(TEXTS)
    node = NodeProcess(str(folder), _build(folder, CORPUS, tmp_path), tmp_path, keys=True,
                       args=("--no-warmup", "--max-wait-ms", "20")).start()
    try:
        with node.counting():
            answer = httpx.post(f"{node.url}/v1/embeddings", json={"input": TEXTS, "model": str(folder)},
                                headers=HEADERS, timeout=60).raise_for_status().json()
        vectors = np.array([item["embedding"] for item in answer["data"]], np.float32)
        assert row_cosines(vectors, expected).min() >= 0.9999
        assert _rows_of(node, "store_exact") == 3, node.log()  # the corpus's three lines, served from the store
    finally:
        assert node.stop() == 0, node.log()


def test_a_qwen3_node_over_a_built_store_scores_as_the_plain_forward(tmp_path: Path) -> None:
    folder = save_tiny_family("qwen3", tmp_path / "model", causal_lm=True)
    store = _build(folder, [QUERY + item for item in ITEMS[:16]], tmp_path, "--prefix-block-size", "8")
    node = NodeProcess(str(folder), store, tmp_path, keys=True, args=("--no-warmup", "--max-wait-ms", "20")).start()
    try:
        items = ITEMS[16:]  # not in the corpus: their query's blocks are
        with node.counting():
            answer = httpx.post(f"{node.url}/v1/score", json={"query": QUERY, "items": items,
                                                              "label_token_ids": LABELS}, headers=HEADERS, timeout=120)
            assert answer.status_code == 200, answer.text
        tokenizer = AutoTokenizer.from_pretrained(folder)
        reference = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        with torch.inference_mode():
            expected = [torch.softmax(reference(**tokenizer(QUERY + item, return_tensors="pt")).logits[0, -1], -1)
                        [LABELS].numpy() for item in items]
        assert np.abs(np.array(answer.json()["scores"]) - np.array(expected)).max() < TOLERANCE
        assert _rows_of(node, "prefix") == len(items), node.log()
    finally:
        assert node.stop() == 0, node.log()


def test_an_embeddinggemma_node_over_a_built_store_answers_as_sentence_transformers(tmp_path: Path) -> None:
    """EmbeddingGemma's shape: a bidirectional Gemma 3 (``BidirectionalGemma3Adapter``) under mean pooling, two Dense
    layers and Normalize."""
    folder = save_tiny_family("gemma3_text", tmp_path / "model", pooling="mean", bidirectional=True, dense=(64, 32))
    expected = SentenceTransformer(str(folder), device="cpu").encode(TEXTS)
    node = NodeProcess(str(folder), _build(folder, CORPUS, tmp_path), tmp_path, keys=True,
                       args=("--no-warmup", "--max-wait-ms", "20")).start()
    try:
        with node.counting():
            answer = httpx.post(f"{node.url}/v1/embeddings", json={"input": TEXTS, "model": str(folder)},
                                headers=HEADERS, timeout=60).raise_for_status().json()
        vectors = np.array([item["embedding"] for item in answer["data"]], np.float32)
        assert vectors.shape == expected.shape == (len(TEXTS), 32)
        assert row_cosines(vectors, expected).min() >= 0.9999
        assert _rows_of(node, "store_exact") == 3, node.log()  # the corpus's three lines, served from the store
    finally:
        assert node.stop() == 0, node.log()


def test_a_gemma3_node_over_a_built_store_scores_as_the_plain_forward(tmp_path: Path) -> None:
    """Gemma 3 (``Gemma3Adapter``): its sliding-window layers leave it no prefix tier, so the build stores no
    prefix blocks and every row is scored by its own forward."""
    folder = save_tiny_family("gemma3_text", tmp_path / "model", causal_lm=True)
    store = _build(folder, [QUERY + item for item in ITEMS[:16]], tmp_path, "--prefix-block-size", "8")
    node = NodeProcess(str(folder), store, tmp_path, keys=True, args=("--no-warmup", "--max-wait-ms", "20")).start()
    try:
        items = ITEMS[14:]
        with node.counting():
            answer = httpx.post(f"{node.url}/v1/score", json={"query": QUERY, "items": items,
                                                              "label_token_ids": LABELS}, headers=HEADERS, timeout=120)
            assert answer.status_code == 200, answer.text
        tokenizer = AutoTokenizer.from_pretrained(folder)
        reference = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        with torch.inference_mode():
            expected = [torch.softmax(reference(**tokenizer(QUERY + item, return_tensors="pt")).logits[0, -1], -1)
                        [LABELS].numpy() for item in items]
        assert np.abs(np.array(answer.json()["scores"]) - np.array(expected)).max() < TOLERANCE
        assert _rows_of(node, "prefix") == 0, node.log()
    finally:
        assert node.stop() == 0, node.log()
