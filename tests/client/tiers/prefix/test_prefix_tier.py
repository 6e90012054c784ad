"""The prefix tier end to end in process: a real LMDB store, a tiny random Llama, the client's forward on suffixes."""

from __future__ import annotations

import pytest
import torch

from attnstore.errors import MapsUnavailableError
from attnstore.service import AttnStoreService
from attnstore_client.cache import AttnCache
from attnstore_client.connection import PrefixStream
from attnstore_client.connection.local import LocalConnection
from tests.support.caches import tiny_loaded
from tests.support.prefixes import BLOCK, SHARED_A, SHARED_B, fill_prefix_namespace, plain_rows, prefix_rows


@pytest.fixture(scope="module")
def llama():
    return tiny_loaded("llama")


@pytest.fixture
def service(tmp_path, llama):
    """A real LMDB store whose namespace holds the prefix blocks of four prompts over two shared prefixes."""
    with AttnStoreService.open(tmp_path / "store", create=True) as opened:
        stored = prefix_rows([5, 9], seed=1, prefix=SHARED_A) + prefix_rows([3], seed=2, prefix=SHARED_B)
        fill_prefix_namespace(opened, llama, stored)
        yield opened


def test_rows_of_several_prefix_lengths_in_one_call_equal_the_full_forward(llama, service):
    queries = (prefix_rows([3, 17, 1], seed=5, prefix=SHARED_A) + prefix_rows([6], seed=6, prefix=SHARED_B)
               + prefix_rows([30], seed=7))
    cache = AttnCache(llama, LocalConnection("local:memory", service), exact=False, prefix_min_tokens=16)
    hidden = cache.hidden_states(queries, batch_size=2)
    for got, want in zip(hidden, plain_rows(llama, queries), strict=True):
        assert got.shape == want.shape and torch.allclose(got, want, atol=2e-5)
    assert cache.last_row_kinds == ("prefix", "prefix", "prefix", "prefix", "miss")
    # 40 + 3 -> 5 blocks, 40 + 17 -> 5 (a 6th is not stored), 40 + 1 -> 5 (one token left), 20 + 6 -> 2 blocks
    assert cache.last_stats.prefix_hits == 4 and cache.last_stats.prefix_tokens == 3 * 40 + 16


def test_a_prefix_shorter_than_the_minimum_is_not_fetched(llama, service):
    cache = AttnCache(llama, LocalConnection("local:memory", service), exact=False)  # default minimum: 64 tokens
    queries = prefix_rows([6], seed=6, prefix=SHARED_B)
    cache.hidden_states(queries)
    assert cache.last_row_kinds == ("miss",) and cache.last_stats.bytes_fetched == 0


def test_the_prefix_tier_can_be_turned_off(llama, service):
    cache = AttnCache(llama, LocalConnection("local:memory", service), exact=False, prefix_min_tokens=16)
    cache.prefix = False
    cache.hidden_states(prefix_rows([3], seed=5, prefix=SHARED_A))
    assert cache.last_row_kinds == ("miss",)


def test_a_corrupt_block_computes_that_row_normally_as_a_fallback_and_verify_names_it(llama, service):
    from attnstore.protocol.prefix import chain_hashes
    from attnstore.store.lmdb.prefix_blocks import part_key

    store = service.store.inner  # the LMDB store behind the service's DRAM cache
    bad = chain_hashes(SHARED_A, BLOCK)[2]
    with store._live.write() as (gen, txn):
        raw = bytearray(txn.get(part_key("default", bad, 1), db=gen.db.prefix))
        raw[7] ^= 0x55
        txn.put(part_key("default", bad, 1), bytes(raw), db=gen.db.prefix)
    queries = prefix_rows([3, 4], seed=5, prefix=SHARED_A) + prefix_rows([50], seed=9, prefix=SHARED_B)
    cache = AttnCache(llama, LocalConnection("local:memory", service), exact=False, prefix_min_tokens=16)
    hidden = cache.hidden_states(queries)
    for got, want in zip(hidden, plain_rows(llama, queries), strict=True):
        assert torch.allclose(got, want, atol=2e-5)
    assert cache.last_row_kinds == ("fallback", "fallback", "prefix")
    assert cache.last_stats.fallbacks == {"checksum": 2}
    assert any(bad.hex() in problem for problem in service.store.verify().problems)


class _Outage(LocalConnection):
    """The store goes away after the first layers of a prefix have arrived."""

    def fetch_prefix(self, *args, **kwargs) -> PrefixStream:
        inner = super().fetch_prefix(*args, **kwargs)

        class Broken(PrefixStream):
            def layer(self, row, layer):
                if layer >= 2:
                    raise MapsUnavailableError("daemon gone", row=row, cause="outage")
                return inner.layer(row, layer)

            def hidden(self, row):
                return inner.hidden(row)

        return Broken()


def test_an_outage_mid_stream_computes_the_rows_normally_with_unchanged_results(llama, service):
    queries = prefix_rows([3, 4], seed=5, prefix=SHARED_A)
    cache = AttnCache(llama, _Outage("local:memory", service), exact=False, prefix_min_tokens=16)
    hidden = cache.hidden_states(queries)
    for got, want in zip(hidden, plain_rows(llama, queries), strict=True):
        assert torch.allclose(got, want, atol=2e-5)
    assert cache.last_row_kinds == ("fallback", "fallback")
    assert cache.last_stats.fallbacks == {"outage": 2}


@pytest.mark.parametrize("kind", ["qwen2", "qwen3"])
def test_qwen_rows_over_stored_prefixes_equal_the_full_forward(tmp_path, kind):
    # Qwen2 runs Llama's adapter with its own biases; Qwen3's keys are stored after the per-head key norm and RoPE,
    # as its own forward caches them.
    loaded = tiny_loaded(kind)
    with AttnStoreService.open(tmp_path / "store", create=True) as service:
        fill_prefix_namespace(service, loaded, prefix_rows([5], seed=1, prefix=SHARED_A)
                              + prefix_rows([3], seed=2, prefix=SHARED_B))
        queries = (prefix_rows([3, 17], seed=5, prefix=SHARED_A) + prefix_rows([6], seed=6, prefix=SHARED_B)
                   + prefix_rows([30], seed=7))
        cache = AttnCache(loaded, LocalConnection("local:memory", service), exact=False, prefix_min_tokens=16)
        hidden = cache.hidden_states(queries, batch_size=2)
        for got, want in zip(hidden, plain_rows(loaded, queries), strict=True):
            assert got.shape == want.shape and torch.allclose(got, want, atol=2e-5)
        assert cache.last_row_kinds == ("prefix", "prefix", "prefix", "miss")
        assert cache.last_stats.prefix_tokens == 2 * 40 + 16
