"""Fixtures of the bench tests: a tiny random BERT with all-MiniLM-L6-v2's sentence-transformers pipeline, and a
tiny data folder (a few Loghub-shaped lines, a few STS-B sentences)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

TINY_HIDDEN = 32  # the tiny BERT's width, its embeddings' dimension


@pytest.fixture(scope="session")
def tiny_minilm(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random BERT saved with all-MiniLM-L6-v2's tokenizer and sentence-transformers modules (mean pooling,
    normalisation): a model folder any bench takes as ``--model``."""
    import torch
    from transformers import BertConfig, BertModel

    from attnstore_client.models import resolve_model_path

    folder = tmp_path_factory.mktemp("tiny-minilm")
    source = resolve_model_path("minilm")
    for name in ("modules.json", "sentence_bert_config.json", "config_sentence_transformers.json",
                 "tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json"):
        shutil.copy(source / name, folder / name)
    (folder / "1_Pooling").mkdir()
    pooling = json.loads((source / "1_Pooling" / "config.json").read_text())
    pooling["word_embedding_dimension"] = TINY_HIDDEN
    (folder / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
    if (source / "2_Normalize").is_dir():
        shutil.copytree(source / "2_Normalize", folder / "2_Normalize")
    torch.manual_seed(0)
    config = BertConfig(vocab_size=30522, hidden_size=TINY_HIDDEN, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=48, max_position_embeddings=512)
    BertModel(config).eval().save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def tiny_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A data folder: ``loghub/`` with two systems of 40 lines (templated, with repeats) and ``stsb_dev.tsv``."""
    root = tmp_path_factory.mktemp("tiny-data")
    (root / "loghub").mkdir()
    for system in ("Alpha", "Beta"):
        rows = "".join(f"{i}\tE{i % 3}\t{system} block blk_{i % 7} served to 10.0.0.{i % 5} in {i % 4} ms\n"
                       for i in range(40))
        (root / "loghub" / f"{system}.tsv").write_text("line_id\tevent_id\tcontent\n" + rows, encoding="utf-8")
    sentences = "".join(f"4.0\tA person number {i} is walking a dog.\tSomeone walks a dog.\n" for i in range(16))
    (root / "stsb_dev.tsv").write_text("score\tsentence1\tsentence2\n" + sentences, encoding="utf-8")
    return root
