"""encode()'s results shaped as sentence-transformers shapes them (``sentence.outputs``), on made-up states."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from attnstore.errors import ConfigError
from attnstore_client.sentence.outputs import OutputOptions, shape_outputs

SENTENCES = torch.tensor([[3.0, 4.0], [0.0, 2.0]])  # (2, 2): norms 5 and 2
TOKENS = [torch.tensor([[1.0, -1.0], [0.5, 0.25]]), torch.tensor([[-2.0, 1.0]])]


def test_output_value_none_leaves_the_sentence_embeddings_unnormalised_as_sentence_transformers_does() -> None:
    # Found by the fuzz harness: sentence-transformers applies normalize_embeddings to sentence embeddings
    # alone; with output_value=None it hands back the model's features as they are.
    rows = shape_outputs(SENTENCES, TOKENS, OutputOptions(output_value=None, normalize_embeddings=True), single=False)
    torch.testing.assert_close(torch.stack([row["sentence_embedding"] for row in rows]), SENTENCES)
    normalised = shape_outputs(SENTENCES, None, OutputOptions(normalize_embeddings=True), single=False)
    np.testing.assert_allclose(np.linalg.norm(normalised, axis=1), [1.0, 1.0], rtol=1e-6)


def test_output_value_none_with_a_precision_is_refused_naming_the_output_values_that_take_one() -> None:
    with pytest.raises(ConfigError, match="precision 'int8' needs output_value"):
        shape_outputs(SENTENCES, TOKENS, OutputOptions(output_value=None, precision="int8"), single=False)


def test_token_embeddings_are_quantised_over_the_whole_call() -> None:
    # Found by the fuzz harness: token embeddings came back as floats whatever the precision.
    rows = shape_outputs(None, TOKENS, OutputOptions(output_value="token_embeddings", precision="ubinary"),
                         single=False)
    assert [row.dtype for row in rows] == [np.uint8, np.uint8]
    assert [int(row[0, 0]) for row in rows] == [0b10000000, 0b01000000]  # the signs, packed: (+, -) and (-, +)
    ranged = shape_outputs(None, TOKENS, OutputOptions(output_value="token_embeddings", precision="uint8"),
                           single=False)
    # One set of ranges over every row's tokens: the call's least value of a dimension is bucket 0, its greatest
    # the top bucket (254 or 255: sentence-transformers floors the bucket).
    stacked = np.concatenate(ranged)
    assert stacked.min(axis=0).tolist() == [0, 0] and (stacked.max(axis=0) >= 254).all()
