"""``AttnCache(..., device="cuda")``: hits and misses equal the CPU path's outputs (same weights), for both
families, and all-MiniLM-L6-v2 on the GPU against sentence-transformers on the CPU."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from attnstore.index import ExactIndex
from attnstore.service import AttnStoreService
from attnstore.store import MemoryMapStore
from attnstore_client.cache import AttnCache
from attnstore_client.connection.local import LocalConnection
from tests.support.caches import fill_namespace, sentences, tiny_loaded

STORED = sentences(6, seed=3)
QUERIES = [*STORED[:4], *sentences(4, seed=4), STORED[0]]  # 5 stored rows (one repeated), 4 unseen


def _service(kind: str) -> AttnStoreService:
    service = AttnStoreService(MemoryMapStore(), make_index=ExactIndex)
    fill_namespace(service, tiny_loaded(kind), STORED)
    return service


@pytest.mark.parametrize("exact", [False, True], ids=["map-hits", "exact-hits"])
def test_an_encoder_on_the_gpu_gives_the_cpu_path_outputs_for_hits_and_misses(device, exact) -> None:
    service = _service("bert")
    on_cpu = AttnCache(tiny_loaded("bert"), LocalConnection("local:memory", service), exact=exact)
    on_gpu = AttnCache(tiny_loaded("bert"), LocalConnection("local:memory", service), exact=exact, device=device)
    want = on_cpu.encode(QUERIES, batch_size=4)
    got = on_gpu.encode(QUERIES, batch_size=4)
    assert on_gpu.last_row_kinds == on_cpu.last_row_kinds
    assert on_gpu.last_row_kinds.count("miss") == 4
    assert on_gpu.last_row_kinds.count("exact" if exact else "map") == 5
    np.testing.assert_allclose(got, want, atol=1e-4)


def test_a_decoder_on_the_gpu_gives_the_cpu_path_hidden_states_for_hits_and_misses(device) -> None:
    service = _service("llama")
    on_cpu = AttnCache(tiny_loaded("llama"), LocalConnection("local:memory", service), exact=False)
    on_gpu = AttnCache(tiny_loaded("llama"), LocalConnection("local:memory", service), exact=False, device=device)
    rows = [on_cpu.loaded.tokenizer(text)["input_ids"] for text in QUERIES]
    want = on_cpu.hidden_states(rows, batch_size=3)
    got = on_gpu.hidden_states(rows, batch_size=3)
    assert on_gpu.last_row_kinds == on_cpu.last_row_kinds and on_gpu.last_row_kinds.count("map") == 5
    for mine, theirs in zip(got, want, strict=True):
        assert mine.device.type == device.type
        assert torch.allclose(mine.cpu(), theirs, atol=1e-4)


def test_on_cuda_hits_and_misses_match_sentence_transformers_on_the_cpu(device, minilm_path) -> None:
    from attnstore_client.models import load_model

    texts = ["A man is playing a guitar.", "A cat sits on the mat.", "Stocks fell sharply today."]
    queries = [*texts, "Someone plays a guitar.", "A dog runs in the park.", texts[0]]
    reference_model = load_model(minilm_path)
    service = AttnStoreService(MemoryMapStore(), make_index=ExactIndex)
    fill_namespace(service, reference_model, texts)
    cache = AttnCache(load_model(minilm_path), LocalConnection("local:memory", service), device=device, exact=False)
    embeddings = cache.encode(queries, batch_size=4)
    assert cache.last_row_kinds.count("map") == 4  # stored maps replayed on the GPU
    reference = reference_model.sentence_transformer.encode(queries, batch_size=4)
    cosine = np.sum(embeddings * reference, axis=1) / (
        np.linalg.norm(embeddings, axis=1) * np.linalg.norm(reference, axis=1))
    assert cosine.min() >= 0.999
