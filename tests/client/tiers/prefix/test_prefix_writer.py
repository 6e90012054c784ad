"""The prefix writer: a computed prefix is stored as its whole blocks (as a build cuts them), parents first, in
calls under its byte limit; duplicates are counted; a refused token or an embedded store turns it off, a refused
layout counts the prefix as refused (in-process store, tiny random Llama)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pytest
import torch
from transformers import DynamicCache

from attnstore.errors import AuthError
from attnstore.index import ExactIndex
from attnstore.protocol.prefix import PrefixBlock, PrefixLayout
from attnstore.service import AttnStoreService
from attnstore.store import MemoryMapStore
from attnstore_client.adapters import adapter_for
from attnstore_client.connection import PrefixPutCounts
from attnstore_client.connection.local import LocalConnection
from attnstore_client.keys import model_fingerprint
from attnstore_client.tiers.prefix import PrefixWriter, PrefixWriterSettings, capture_prefix_blocks, prefix_layout_of
from attnstore_client.tiers.prefix.shared import ComputedPrefix
from attnstore_tools.build.namespace_layout import exact_tier_layout
from tests.support.caches import tiny_loaded
from tests.support.prefixes import BLOCK, prefix_rows


@pytest.fixture(scope="module")
def llama():
    return tiny_loaded("llama")


class _Storing(LocalConnection):
    """An in-process store that takes prefix blocks as a daemon does; records each call's blocks."""

    def __init__(self, service: AttnStoreService, refuse: Exception | None = None) -> None:
        super().__init__("local:memory", service)
        self.calls: list[list[PrefixBlock]] = []
        self._refuse = refuse

    def put_prefix(self, namespace: str, fingerprint: str, layout: PrefixLayout, blocks: Sequence[PrefixBlock], *,
                   timeout: float | None) -> PrefixPutCounts:
        if self._refuse is not None:
            raise self._refuse
        self.calls.append(list(blocks))
        result = self._service.prefixes.put(namespace, fingerprint, layout, blocks)
        return PrefixPutCounts(result.stored, result.duplicates, result.not_admitted)


def _service(llama) -> tuple[AttnStoreService, str]:
    service = AttnStoreService(MemoryMapStore(), make_index=ExactIndex)
    fingerprint = model_fingerprint(llama.model, llama.tokenizer)
    service.create_namespace("default", model=llama.name, fingerprint=fingerprint, layout=exact_tier_layout(llama))
    return service, fingerprint


def _computed(llama, tokens: list[int]) -> ComputedPrefix:
    """The prefix as the shared tier computes it: one forward with the model's own cache."""
    cache = DynamicCache()
    with torch.inference_mode():
        out = llama.model(input_ids=torch.tensor([tokens]), past_key_values=cache, use_cache=True)
    return ComputedPrefix(tuple(tokens), tuple(layer.keys for layer in cache.layers),
                          tuple(layer.values for layer in cache.layers), out.last_hidden_state[0].float())


def test_a_computed_prefix_is_stored_as_a_build_cuts_it_parents_first_in_calls_under_the_byte_limit(llama):
    service, fingerprint = _service(llama)
    connection = _Storing(service)
    layout = prefix_layout_of(adapter_for(llama), block_size=BLOCK)
    tokens = prefix_rows([2 * BLOCK + 3], seed=3)[0]  # two whole blocks and three tokens more
    writer = PrefixWriter(connection, "default", fingerprint, PrefixWriterSettings(batch_bytes=layout.block_bytes))
    try:
        assert writer.layout is None
        assert writer.put(_computed(llama, tokens), layout) and writer.flush(30)
        assert not writer.put(_computed(llama, tokens[: BLOCK - 1]), layout)  # no whole block: nothing to store
        assert writer.put(_computed(llama, tokens), layout) and writer.flush(30)
        stats = writer.stats()
    finally:
        writer.close()
    assert (stats.queued, stats.stored, stats.duplicates, stats.refused, stats.disabled) == (2, 2, 2, 0, None)
    assert stats.layout == writer.layout == layout == service.prefixes.layout("default")
    assert [len(call) for call in connection.calls] == [1, 1, 1, 1]  # one block per call, the parent first
    (built,) = capture_prefix_blocks(adapter_for(llama), [tokens], layout, pad_id=0)
    for sent, want in zip([call[0] for call in connection.calls[:2]], built, strict=True):
        assert (sent.chain_hash, sent.parent) == (want.chain_hash, want.parent)
        np.testing.assert_allclose(sent.kv, want.kv, atol=1e-5)
        np.testing.assert_allclose(sent.hidden, want.hidden, atol=1e-5)


def test_a_refused_token_turns_the_writer_off_and_another_layout_is_counted_as_refused(llama):
    service, fingerprint = _service(llama)
    layout = prefix_layout_of(adapter_for(llama), block_size=BLOCK)
    prefix = _computed(llama, prefix_rows([BLOCK], seed=4)[0])
    refused = PrefixWriter(_Storing(service, AuthError("PERMISSION_DENIED: a read token")), "default", fingerprint)
    try:
        assert refused.put(prefix, layout) and refused.flush(30)
        assert not refused.put(prefix, layout)  # off: dropped at once, nothing sent
        stats = refused.stats()
    finally:
        refused.close()
    assert (stats.dropped_failed, stats.stored) == (2, 0) and "read token" in (stats.disabled or "")
    other = prefix_layout_of(adapter_for(llama), block_size=2 * BLOCK)
    writer = PrefixWriter(_Storing(service), "default", fingerprint)
    try:
        writer.put(_computed(llama, prefix_rows([2 * BLOCK], seed=5)[0]), other)
        writer.put(prefix, layout)
        writer.flush(30)
        stats = writer.stats()
    finally:
        writer.close()
    assert (stats.stored, stats.refused, stats.disabled) == (1, 1, None)  # the namespace took the first layout


def test_an_embedded_store_takes_no_prefix_blocks_and_turns_the_writer_off(llama):
    service, fingerprint = _service(llama)
    writer = PrefixWriter(LocalConnection("local:memory", service), "default", fingerprint)
    try:
        writer.put(_computed(llama, prefix_rows([BLOCK], seed=6)[0]), prefix_layout_of(adapter_for(llama)))
        writer.put(_computed(llama, prefix_rows([BLOCK * 4], seed=6)[0]), prefix_layout_of(adapter_for(llama)))
        writer.flush(30)
        assert "needs a daemon" in (writer.stats().disabled or "")
    finally:
        writer.close()
