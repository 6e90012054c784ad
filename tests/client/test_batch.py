"""Right-padded batches from token ids and from text."""

from __future__ import annotations

import pytest
import torch

from attnstore.errors import ConfigError
from attnstore_client.batch import batch_from_ids, tokenize


def test_batch_from_ids_pads_on_the_right_and_keeps_lengths():
    batch = batch_from_ids([[5, 6, 7], [8]], pad_id=0)
    assert batch.lengths == (3, 1) and batch.size == 2 and batch.padded_length == 3
    assert batch.input_ids.tolist() == [[5, 6, 7], [8, 0, 0]]
    assert batch.attention_mask.tolist() == [[1, 1, 1], [1, 0, 0]]
    assert batch.input_ids.dtype == torch.long
    assert batch.row_ids(1).tolist() == [8]


@pytest.mark.parametrize("rows", [[], [[1], []]])
def test_batch_from_ids_refuses_empty_input(rows):
    with pytest.raises(ConfigError):
        batch_from_ids(rows, pad_id=0)


@pytest.mark.real_model
def test_tokenize_adds_special_tokens_truncates_and_refuses_a_bare_string(minilm_model):
    tokenizer = minilm_model.tokenizer
    batch = tokenize(tokenizer, ["a cat", "a cat sat on the mat today"], max_length=5)
    assert batch.lengths == (4, 5)
    assert batch.input_ids[0, 0].item() == tokenizer.cls_token_id
    assert batch.input_ids[0, 3].item() == tokenizer.sep_token_id
    assert batch.input_ids[0, 4].item() == tokenizer.pad_token_id
    with pytest.raises(ConfigError, match="single str"):
        tokenize(tokenizer, "a cat")
