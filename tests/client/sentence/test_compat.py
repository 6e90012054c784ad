"""Code written for ``SentenceTransformer`` runs unchanged on an ``AttnCache`` of the same model (all-MiniLM-L6-v2).

Each call is made on both and the results compared; what a cache does not offer
raises ``NotImplementedError`` naming what to do instead.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from attnstore.index import ExactIndex
from attnstore.service import AttnStoreService
from attnstore.store import MemoryMapStore
from attnstore_client.cache import AttnCache
from attnstore_client.connection.local import LocalConnection
from tests.support.caches import fill_namespace

pytestmark = pytest.mark.real_model

STORED = ["A man is playing a guitar.", "A cat sits on the mat."]
QUERIES = ["Someone plays a guitar.", "A dog runs in the park.", "The market dropped sharply.", STORED[1]]
CORPUS = ["A guitarist performs on stage.", "Dogs love parks.", "Stocks fell today.", "Cats sleep a lot."]


@pytest.fixture(scope="module")
def pair(minilm_model):
    service = AttnStoreService(MemoryMapStore(), make_index=ExactIndex)
    fill_namespace(service, minilm_model, STORED)
    return AttnCache(minilm_model, LocalConnection("local:memory", service)), minilm_model.sentence_transformer


def _close(a, b, atol: float = 2e-3) -> None:
    a = a.cpu().numpy() if isinstance(a, torch.Tensor) else np.asarray(a)
    b = b.cpu().numpy() if isinstance(b, torch.Tensor) else np.asarray(b)
    assert a.shape == b.shape and a.dtype == b.dtype
    np.testing.assert_allclose(a.astype(np.float64), b.astype(np.float64), atol=atol)


@pytest.mark.parametrize("kwargs", [
    {}, {"normalize_embeddings": True}, {"truncate_dim": 64}, {"convert_to_tensor": True}, {"prompt": "query: "},
    {"batch_size": 1}, {"output_value": None},
])
def test_encode_gives_what_sentence_transformers_gives(pair, kwargs) -> None:
    cache, model = pair
    got, want = cache.encode(QUERIES, **kwargs), model.encode(QUERIES, **kwargs)
    if kwargs.get("output_value", "") is None:
        for mine, theirs in zip(got, want, strict=True):
            assert set(mine) >= {"sentence_embedding", "token_embeddings"}
            _close(mine["sentence_embedding"], theirs["sentence_embedding"])
            length = len(mine["token_embeddings"])  # sentence-transformers leaves them padded to their batch here
            _close(mine["token_embeddings"], theirs["token_embeddings"][:length], atol=5e-3)
        return
    _close(got, want)


@pytest.mark.parametrize("precision", ["int8", "uint8", "binary", "ubinary"])
def test_quantized_embeddings_of_computed_rows_equal_sentence_transformers(pair, precision: str) -> None:
    # Quantization ranges come from the call's own vectors: fp16 stored outputs would move them, so every row computes.
    cache, model = pair
    cache.maps = False
    try:
        computed = cache.encode(QUERIES[:3] + CORPUS, precision=precision)
    finally:
        cache.maps = True
    reference = model.encode(QUERIES[:3] + CORPUS, precision=precision)
    assert computed.shape == reference.shape and computed.dtype == reference.dtype
    # A dimension whose 7 values span almost nothing turns a 1e-6 difference into a different bucket.
    close = np.abs(computed.astype(np.int64) - reference.astype(np.int64)) <= 1
    assert close.mean() >= 0.99


def test_quantized_token_embeddings_are_quantized_over_the_whole_call_as_sentence_transformers_does(pair) -> None:
    # Found by the fuzz harness: token embeddings came back as floats whatever the precision.
    cache, model = pair
    got = cache.encode(QUERIES[:2], output_value="token_embeddings", precision="binary")
    want = model.encode(QUERIES[:2], output_value="token_embeddings", precision="binary")
    for mine, theirs in zip(got, want, strict=True):
        assert mine.dtype == theirs.dtype == np.int8 and mine.shape == theirs.shape


def test_one_text_gives_one_vector_and_no_texts_an_empty_array(pair) -> None:
    cache, model = pair
    _close(cache.encode(QUERIES[0]), model.encode(QUERIES[0]))
    empty, reference = cache.encode([]), model.encode([])
    assert isinstance(empty, np.ndarray) and empty.shape[0] == 0 and empty.shape[0] == len(reference)


def test_retrieval_api_similarity_and_semantic_search_match(pair) -> None:
    from sentence_transformers.util import semantic_search

    cache, model = pair
    queries, docs = cache.encode_query(QUERIES), cache.encode_document(CORPUS)
    _close(queries, model.encode_query(QUERIES))
    _close(docs, model.encode_document(CORPUS))
    _close(cache.similarity(queries, docs), model.similarity(queries, docs), atol=1e-5)
    _close(cache.similarity_pairwise(queries, docs), model.similarity_pairwise(queries, docs), atol=1e-5)
    hits = semantic_search(torch.from_numpy(queries), torch.from_numpy(docs), top_k=2)
    reference = semantic_search(torch.from_numpy(model.encode_query(QUERIES)),
                                torch.from_numpy(model.encode_document(CORPUS)), top_k=2)
    assert [[h["corpus_id"] for h in row] for row in hits] == [[h["corpus_id"] for h in row] for row in reference]


def test_what_the_model_is_reads_the_same(pair) -> None:
    cache, model = pair
    assert cache.get_sentence_embedding_dimension() == model.get_embedding_dimension() == 384
    assert cache.get_embedding_dimension() == 384
    assert cache.max_seq_length == model.max_seq_length == cache.get_max_seq_length()
    assert cache.similarity_fn_name == model.similarity_fn_name
    assert cache.prompts == {k: v for k, v in model.prompts.items() if v is not None}
    assert cache.tokenizer is model.tokenizer
    features = cache.tokenize(QUERIES)
    assert torch.equal(features["input_ids"], model.tokenize(QUERIES)["input_ids"])
    assert cache.eval() is cache


def test_truncate_embeddings_applies_within_its_block_only(pair) -> None:
    cache, model = pair
    with cache.truncate_embeddings(32), model.truncate_embeddings(32):
        _close(cache.encode(QUERIES), model.encode(QUERIES))
        with cache.truncate_sentence_embeddings(16):  # the older name
            assert cache.encode(QUERIES).shape == (len(QUERIES), 16)
        assert cache.encode(QUERIES).shape == (len(QUERIES), 32)
    assert cache.encode(QUERIES).shape == (len(QUERIES), 384)


def test_max_seq_length_is_settable_as_on_a_sentence_transformer(minilm_model) -> None:
    service = AttnStoreService(MemoryMapStore(), make_index=ExactIndex)
    fill_namespace(service, minilm_model, STORED)
    cache = AttnCache(minilm_model, LocalConnection("local:memory", service))
    model = minilm_model.sentence_transformer
    try:
        cache.max_seq_length = 8
        assert model.max_seq_length == 8  # the pipeline it shares truncates there too
        _close(cache.encode(QUERIES), model.encode(QUERIES))
    finally:
        cache.max_seq_length = 256


@pytest.mark.parametrize("name", ["start_multi_process_pool", "encode_multi_process", "fit", "save", "push_to_hub"])
def test_what_a_cache_does_not_offer_raises_naming_what_to_do_instead(pair, name: str) -> None:
    cache, _ = pair
    with pytest.raises(NotImplementedError, match=f"AttnCache.{name}\\(\\) is not offered by a cache: "):
        getattr(cache, name)()


def test_encode_with_a_process_pool_raises_naming_what_to_do_instead(pair) -> None:
    cache, _ = pair
    with pytest.raises(NotImplementedError, match="one AttnCache per process"):
        cache.encode(QUERIES, pool={"processes": []})
    _close(cache.encode(QUERIES, pool=None, chunk_size=None), pair[1].encode(QUERIES))
