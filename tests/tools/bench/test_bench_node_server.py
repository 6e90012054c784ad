"""``bench node``'s baseline servers: each request through ``SentenceTransformer.encode``, with and without a dict."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from attnstore_node.errors import ApiError
from attnstore_tools.bench.node.server import EncodeEmbedder
from tests.support.wait import wait_until

pytestmark = pytest.mark.real_model

TEXTS = ["Failed password for root from 10.0.0.1", "ok", "Failed password for root from 10.0.0.1", "new line"]


def _serve(embedder: EncodeEmbedder, requests: list[list]) -> list:
    embedder.start()

    def loaded() -> bool:
        assert embedder.failure is None, f"the model failed to load: {embedder.failure!r}"
        return embedder.info is not None

    wait_until(loaded, 300, "the baseline's model loaded", poll=0.05)

    async def send():
        return [await embedder.embed(r, truncate=True, max_input_tokens=512) for r in requests]

    try:
        return asyncio.run(send())
    finally:
        embedder.stop()


def test_both_baselines_answer_encodes_vectors_and_the_dict_keeps_what_it_computed(minilm_model) -> None:
    pipeline = minilm_model.sentence_transformer
    expected = pipeline.encode(TEXTS)
    tokens = sum(len(row) for row in pipeline.tokenizer(TEXTS)["input_ids"])
    plain = _serve(EncodeEmbedder("minilm", None, 1), [TEXTS])[0]
    np.testing.assert_allclose(plain.vectors, expected, atol=1e-5)
    assert plain.tokens == tokens
    cache = {TEXTS[1]: (expected[1], 0)}
    first, again = _serve(EncodeEmbedder("minilm", cache, 1), [TEXTS, TEXTS[:1]])
    np.testing.assert_allclose(first.vectors, expected, atol=1e-5)
    assert (first.tokens, again.tokens) == (tokens, len(pipeline.tokenizer(TEXTS[:1])["input_ids"][0]))
    assert set(cache) == set(TEXTS)


def test_the_baselines_take_texts_only(minilm_model) -> None:
    with pytest.raises(ApiError, match="texts only"):
        _serve(EncodeEmbedder("minilm", None, 1), [[[101, 102]]])
