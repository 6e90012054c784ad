"""The prefix and chunk tiers on the GPU give the full forward's outputs (the exact tier: test_gpu_cache)."""

from __future__ import annotations

import torch

from attnstore.index import ExactIndex
from attnstore.service import AttnStoreService
from attnstore.store import MemoryMapStore
from attnstore_client.cache import AttnCache
from attnstore_client.call.settings import ChunkSettings
from attnstore_client.connection.local import LocalConnection
from tests.support.caches import fill_namespace, plain_hidden, tiny_loaded
from tests.support.prefixes import SHARED_A, SHARED_B, fill_prefix_namespace, plain_rows, prefix_rows

INSTRUCTION = "w2 w3 w4 w5 w6"
CHUNKS = ["w20 w21 w22 w23 w24 w25", "w30 w31 w32", "w40 w41 w42 w43 w44 w45 w46"]
PROMPTS = [[INSTRUCTION, CHUNKS[0], CHUNKS[1], "w7 w8"], [INSTRUCTION, CHUNKS[2], CHUNKS[0], "w9"]]


def test_the_prefix_tier_on_the_gpu_equals_the_full_forward(device, tmp_path) -> None:
    with AttnStoreService.open(tmp_path / "store", create=True) as service:
        fill_prefix_namespace(service, tiny_loaded("llama"), prefix_rows([5], seed=1, prefix=SHARED_A)
                              + prefix_rows([3], seed=2, prefix=SHARED_B))
        queries = prefix_rows([3, 17], seed=5, prefix=SHARED_A) + prefix_rows([6], seed=6, prefix=SHARED_B)
        cache = AttnCache(tiny_loaded("llama"), LocalConnection("local:memory", service), exact=False,
                          prefix_min_tokens=16, device=device)
        hidden = cache.hidden_states(queries, batch_size=2)
        assert cache.last_row_kinds == ("prefix",) * 3
    for got, want in zip(hidden, plain_rows(tiny_loaded("llama"), queries), strict=True):
        assert got.device.type == device.type and torch.allclose(got.cpu(), want, atol=1e-4)


def test_the_chunk_tier_on_the_gpu_equals_the_full_forward(device) -> None:
    service = AttnStoreService(MemoryMapStore(), make_index=ExactIndex)
    fill_namespace(service, tiny_loaded("llama"), ["w60 w61"])
    exact = ChunkSettings(method="a3", ratio=1.0, recent=0, dtype="float32")
    cache = AttnCache(tiny_loaded("llama"), LocalConnection("local:memory", service), exact=False, chunks=exact,
                      device=device)
    first = cache.last_hidden_states(PROMPTS)  # captures the chunks
    again = cache.last_hidden_states(PROMPTS)  # fuses them
    assert cache.last_row_kinds == ("chunk",) * 2 and cache.last_stats.chunk_hits == 2
    want = torch.stack([h[-1] for h in plain_hidden(tiny_loaded("llama"), [" ".join(p) for p in PROMPTS])])
    assert torch.allclose(first.cpu(), want, atol=1e-4) and torch.allclose(again.cpu(), want, atol=1e-4)
