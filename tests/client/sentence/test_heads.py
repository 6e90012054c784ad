"""all-MiniLM-L6-v2 through ``AttnCache`` gives what sentence-transformers gives, and its tools run on it."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from sentence_transformers import SentenceTransformer
from sentence_transformers.sentence_transformer.modules import Normalize, Pooling

from attnstore.errors import ConfigError
from attnstore.index import ExactIndex
from attnstore.service import AttnStoreService
from attnstore.store import MemoryMapStore
from attnstore_client.cache import AttnCache
from attnstore_client.call.rows import HiddenRows
from attnstore_client.connection.local import LocalConnection
from attnstore_client.sentence.heads import (
    MeanPoolHead,
    PromptEolHead,
    SentenceHead,
    TransformersPipelineHead,
    sentence_head,
)
from tests.support.caches import fill_namespace

pytestmark = pytest.mark.real_model

STORED = ["A man is playing a guitar.", "A cat sits on the mat.", "Stocks fell sharply today."]
_LINE = "the daemon restarted its worker after a timeout while the disk was full and the queue grew "
LONG = [(_LINE * 50)[start:end] for start, end in ((0, 1500), (13, 4000))]  # about 300 and 750 tokens
QUERIES = [*STORED, "Someone plays a guitar.", "A dog runs in the park.", "The market dropped.", *LONG, STORED[0]]


@pytest.fixture(scope="module")
def service(minilm_model) -> AttnStoreService:
    service = AttnStoreService(MemoryMapStore(), make_index=ExactIndex)
    fill_namespace(service, minilm_model, STORED)
    return service


def _cosine(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return np.sum(a * b, axis=1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))


def test_every_computed_row_matches_sentence_transformers_encode_also_past_its_256_token_limit(
    minilm_model, service
) -> None:
    cache = AttnCache(minilm_model, LocalConnection("local:memory", service))
    assert cache.max_seq_length == minilm_model.sentence_transformer.max_seq_length == 256
    assert len(minilm_model.tokenizer(LONG[1])["input_ids"]) > 512  # past the model's context, too
    embeddings = cache.encode(QUERIES, batch_size=4)
    reference = minilm_model.sentence_transformer.encode(QUERIES, batch_size=4)
    cosine = _cosine(embeddings, reference)
    kinds = cache.last_row_kinds
    assert kinds.count("exact") == 4 and kinds.count("miss") == 5
    computed = np.array([kind == "miss" for kind in kinds])
    assert cosine[computed].min() >= 0.9999
    assert cosine.min() >= 0.999  # exact hits are the stored fp16 outputs
    # The model's Normalize module: unit vectors, as sentence-transformers returns them.
    np.testing.assert_allclose(np.linalg.norm(embeddings, axis=1), 1.0, atol=1e-3)


def test_sentence_transformers_embedding_similarity_evaluator_runs_unchanged_on_an_attncache(
    minilm_model, service
) -> None:
    from sentence_transformers.sentence_transformer.evaluation import EmbeddingSimilarityEvaluator

    evaluator = EmbeddingSimilarityEvaluator(
        STORED + ["A dog runs in the park."], ["Someone plays a guitar.", "A dog sleeps.", "The market dropped.",
                                              "A puppy runs outside."],
        [0.9, 0.2, 0.8, 0.85], name="sts",
    )
    cache = AttnCache(minilm_model, LocalConnection("local:memory", service))
    with_cache = evaluator(cache)
    plain = evaluator(minilm_model.sentence_transformer)
    assert set(with_cache) == set(plain) == {"sts_pearson_cosine", "sts_spearman_cosine"}
    for metric, value in plain.items():
        assert with_cache[metric] == pytest.approx(value, abs=1e-3)


def test_device_is_taken_as_sentence_transformers_takes_it(minilm_model, service) -> None:
    cache = AttnCache(minilm_model, LocalConnection("local:memory", service), device="cpu")
    tensor = cache.encode(QUERIES[:4], convert_to_tensor=True, device="cpu")
    assert tensor.device.type == "cpu" and cache.device == torch.device("cpu")
    np.testing.assert_allclose(tensor.numpy(), cache.encode(QUERIES[:4]), atol=1e-4)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA device")
def test_a_cuda_device_on_a_machine_without_one_is_a_config_error(minilm_model, service) -> None:
    with pytest.raises(ConfigError, match="'cuda' asked for, but this machine has no CUDA device"):
        AttnCache(minilm_model, LocalConnection("local:memory", service), device="cuda")


def test_token_embeddings_match_sentence_transformers_row_by_row(minilm_model, service) -> None:
    cache = AttnCache(minilm_model, LocalConnection("local:memory", service), exact=False)
    cache.maps = False  # every row computed
    texts = QUERIES[3:6] + LONG[:1]
    got = cache.encode(texts, output_value="token_embeddings", batch_size=2)
    reference = minilm_model.sentence_transformer.encode(texts, output_value="token_embeddings", batch_size=2)
    assert len(got) == len(reference) == len(texts)
    for mine, theirs in zip(got, reference, strict=True):
        assert mine.shape == theirs.shape  # (L, hidden), no padding
        assert (mine - theirs).abs().max().item() < 1e-4


def _end_to_end(lengths: list[int], seed: int = 0) -> HiddenRows:
    generator = torch.Generator().manual_seed(seed)
    return HiddenRows.stacked([torch.randn((length, 384), generator=generator) for length in lengths])


def _pipeline(minilm_model, mode: str, include_prompt: bool = True, *after: torch.nn.Module) -> SentenceHead:
    transformer = minilm_model.sentence_transformer[0]
    modules = [transformer, Pooling(384, pooling_mode=mode, include_prompt=include_prompt), *after]
    return TransformersPipelineHead(SentenceTransformer(modules=modules, device="cpu"))


@pytest.mark.parametrize("mode", ["mean", "cls", "max", "weightedmean", "lasttoken", "mean_sqrt_len_tokens"])
@pytest.mark.parametrize("prompt_length", [0, 2])
def test_a_pipeline_pools_rows_end_to_end_as_it_pools_them_padded(minilm_model, mode: str, prompt_length: int) -> None:
    head = _pipeline(minilm_model, mode, False, Normalize())
    hidden = _end_to_end([5, 3, 9, 3, 17])
    torch.testing.assert_close(head.pool_rows(hidden, prompt_length), head.pool(*hidden.padded(), prompt_length))


def test_rows_with_gaps_between_them_are_pooled_padded(minilm_model) -> None:
    head = sentence_head(minilm_model)
    lengths = [4, 2, 6]
    values = torch.randn((15, 384))
    hidden = HiddenRows(values, lengths, [0, 6, 9])  # not end to end: tokens 4, 5, 8 and 15 belong to no row
    assert not hidden.end_to_end
    expected = torch.stack([values[start : start + length].mean(dim=0) for start, length in
                            zip([0, 6, 9], lengths, strict=True)])
    torch.testing.assert_close(head.pool_rows(hidden), torch.nn.functional.normalize(expected, dim=-1))


@pytest.mark.parametrize("make", [lambda loaded: MeanPoolHead(loaded, 128), lambda loaded: PromptEolHead(loaded, 128)])
def test_mean_and_last_token_heads_pool_rows_end_to_end_as_they_pool_them_padded(minilm_model, make) -> None:
    head = make(minilm_model)
    hidden = _end_to_end([7, 1, 12, 4])
    torch.testing.assert_close(head.pool_rows(hidden), head.pool(*hidden.padded()))
