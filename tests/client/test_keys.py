"""Namespace fingerprint and exact-tier token hash."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import BertConfig, BertModel, BertTokenizerFast

from attnstore_client.keys import model_fingerprint, token_hash


@pytest.fixture()
def tiny_tokenizer(tmp_path) -> BertTokenizerFast:
    vocab = tmp_path / "vocab.txt"
    vocab.write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "a", "b", "c"]) + "\n")
    return BertTokenizerFast(vocab_file=str(vocab))


def _tiny_bert(seed: int) -> BertModel:
    torch.manual_seed(seed)
    config = BertConfig(vocab_size=8, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=32, max_position_embeddings=32)
    return BertModel(config).eval()


def test_fingerprint_is_stable_across_loads_and_attention_implementations(tiny_tokenizer) -> None:
    model = _tiny_bert(0)
    same = _tiny_bert(0)
    same.config._attn_implementation = "eager"
    assert model_fingerprint(model, tiny_tokenizer) == model_fingerprint(same, tiny_tokenizer)


def test_fingerprint_changes_with_weights(tiny_tokenizer) -> None:
    assert model_fingerprint(_tiny_bert(0), tiny_tokenizer) != model_fingerprint(_tiny_bert(1), tiny_tokenizer)


def test_fingerprint_changes_with_config(tiny_tokenizer) -> None:
    model = _tiny_bert(0)
    before = model_fingerprint(model, tiny_tokenizer)
    model.config.layer_norm_eps = 1e-6
    assert model_fingerprint(model, tiny_tokenizer) != before


def test_token_hash_ignores_container_type() -> None:
    ids = [101, 7592, 2088, 102]
    assert token_hash(ids) == token_hash(torch.tensor(ids)) == token_hash(np.array(ids, dtype=np.int32))
    assert len(token_hash(ids)) == 32


def test_token_hash_differs_for_different_rows() -> None:
    assert token_hash([1, 2, 3]) != token_hash([1, 2, 4])
    assert token_hash([1, 2, 3]) != token_hash([1, 2, 3, 0])


def test_token_hash_rejects_a_batch() -> None:
    with pytest.raises(ValueError, match="one row"):
        token_hash(np.zeros((2, 3), dtype=np.int64))
