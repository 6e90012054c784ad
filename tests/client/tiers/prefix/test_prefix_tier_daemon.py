"""The prefix tier through the real daemon (a subprocess on a free loopback port, real LMDB); with write-back, a
prefix a call's rows share is stored and later calls, of this cache and of another, start from it."""

from __future__ import annotations

import logging
import re

import pytest
import torch

from attnstore.errors import FingerprintMismatchError
from attnstore.protocol.prefix import DEFAULT_BLOCK_SIZE, chain_hashes
from attnstore.service import AttnStoreService
from attnstore.store.lmdb.prefix_blocks import part_key
from attnstore_client.cache import AttnCache
from attnstore_client.connection import connect
from attnstore_client.keys import model_fingerprint
from attnstore_tools.admin.cold_start import create_exact_namespace
from tests.support.caches import tiny_loaded
from tests.support.daemon import ADMIN_TOKEN, READ_TOKEN, WRITE_TOKEN, DaemonProcess
from tests.support.prefixes import BLOCK, SHARED_A, SHARED_B, fill_prefix_namespace, plain_rows, prefix_rows
from tests.support.wait import wait_until

SHARED_C = prefix_rows([24], seed=12)[0]


@pytest.fixture(scope="module")
def llama():
    return tiny_loaded("llama")


@pytest.fixture(scope="module")
def daemon(tmp_path_factory, llama):
    process = _start_daemon(tmp_path_factory.mktemp("prefix-daemon"), llama)
    yield process
    process.stop()


def _start_daemon(workdir, llama) -> DaemonProcess:
    """A daemon on a store holding the prefix blocks of SHARED_A, SHARED_B and SHARED_C (one block damaged)."""
    with AttnStoreService.open(workdir / "store", create=True) as service:
        fill_prefix_namespace(service, llama, [SHARED_A + [7, 8], SHARED_B + [9], SHARED_C])
        store = service.store.inner  # the LMDB store behind the service's DRAM cache
        with store._live.write() as (gen, txn):  # bit rot in SHARED_C's second block, layer 1
            key = part_key("default", chain_hashes(SHARED_C, BLOCK)[1], 1)
            raw = bytearray(txn.get(key, db=gen.db.prefix))
            raw[3] ^= 0x10
            txn.put(key, bytes(raw), db=gen.db.prefix)
    return DaemonProcess(workdir / "store", workdir).start()


def test_rows_served_through_the_daemon_equal_the_full_forward(llama, daemon):
    queries = prefix_rows([3, 17], seed=5, prefix=SHARED_A) + prefix_rows([6], seed=6, prefix=SHARED_B)
    with AttnCache(llama, f"grpc://{daemon.target}", token=READ_TOKEN, exact=False, prefix_min_tokens=16) as cache:
        hidden = cache.hidden_states(queries)
        assert cache.last_row_kinds == ("prefix", "prefix", "prefix")
        assert cache.last_stats.prefix_tokens == 40 + 40 + 16 and cache.last_stats.bytes_fetched > 0
    for got, want in zip(hidden, plain_rows(llama, queries), strict=True):
        assert torch.allclose(got, want, atol=2e-5)


def test_a_request_of_another_block_size_or_fingerprint_is_failed_precondition(llama, daemon):
    fingerprint = model_fingerprint(llama.model, llama.tokenizer)
    with connect(f"grpc://{daemon.target}", token=READ_TOKEN) as connection:
        assert connection.namespace("default").prefix.block_size == BLOCK
        assert connection.match_prefix("default", fingerprint, BLOCK, [chain_hashes(SHARED_A, BLOCK)],
                                       timeout=10) == [5]
        with pytest.raises(FingerprintMismatchError, match="16"):
            connection.match_prefix("default", fingerprint, 16, [chain_hashes(SHARED_A, 16)], timeout=10)
        with pytest.raises(FingerprintMismatchError):
            connection.match_prefix("default", "0" * 64, BLOCK, [chain_hashes(SHARED_A, BLOCK)], timeout=10)


def test_a_corrupt_block_served_by_the_daemon_computes_its_rows_normally_as_fallbacks(llama, daemon, caplog):
    queries = prefix_rows([5], seed=8, prefix=SHARED_C) + prefix_rows([3], seed=5, prefix=SHARED_A)
    with AttnCache(llama, f"grpc://{daemon.target}", token=READ_TOKEN, exact=False, prefix_min_tokens=16) as cache:
        with caplog.at_level(logging.WARNING):
            hidden = cache.hidden_states(queries)
        assert cache.last_row_kinds == ("fallback", "prefix")
        assert cache.last_stats.fallbacks == {"checksum": 1}
    # The client names the part the store reported, not the one its forward happened to wait for.
    reported = re.search(r"could not serve the prefix of row 0 \(part (\d+)\)", caplog.text)
    assert reported is not None, caplog.text
    assert f"could not serve its part {reported.group(1)}: DATA_LOSS" in caplog.text
    for got, want in zip(hidden, plain_rows(llama, queries), strict=True):
        assert torch.allclose(got, want, atol=2e-5)


def test_a_shared_prefix_written_back_serves_later_calls_of_this_cache_and_of_another(llama, tmp_path):
    # Its own (another test stops the module's); one writer's asks admit its blocks.
    daemon = DaemonProcess(tmp_path / "store", tmp_path, extra_args=("--admit-after", "1")).start()
    try:
        _written_back_prefix_is_served(llama, daemon)
    finally:
        assert daemon.stop() == 0, daemon.log()


def _written_back_prefix_is_served(llama, daemon: DaemonProcess) -> None:
    with daemon.client(ADMIN_TOKEN) as admin:  # a namespace without prefix blocks, with the model's layouts
        create_exact_namespace(admin, llama, "fresh")
        assert admin.get_namespace("fresh").prefix.block_size == DEFAULT_BLOCK_SIZE
    url, options = f"grpc://{daemon.target}", {"exact": False, "prefix_min_tokens": 16}
    with AttnCache(llama, url, "fresh", token=READ_TOKEN, **options) as reader, \
            AttnCache(llama, url, "fresh", token=WRITE_TOKEN, write_back=True, **options) as writer:
        writer.hidden_states(prefix_rows([3, 5, 7], seed=20, prefix=SHARED_A))
        assert writer.last_row_kinds == ("miss",) * 3 and writer.last_stats.prefix_tokens == 0  # computed once
        fingerprint, chain = model_fingerprint(llama.model, llama.tokenizer), chain_hashes(SHARED_A, DEFAULT_BLOCK_SIZE)
        with connect(url, token=READ_TOKEN) as connection:  # the prefix lands off the call's path
            wait_until(lambda: connection.prefix_layout("fresh") is not None and connection.match_prefix(
                "fresh", fingerprint, DEFAULT_BLOCK_SIZE, [chain], timeout=10) == [1], 30,
                "the shared prefix written back", poll=0.05)
        later = prefix_rows([4, 6], seed=21, prefix=SHARED_A)
        for cache in (writer, reader):  # both read the namespace before it had prefix blocks
            hidden = cache.hidden_states(later)
            assert cache.last_row_kinds == ("prefix", "prefix")
            assert cache.last_stats.prefix_tokens == 2 * DEFAULT_BLOCK_SIZE
            for got, want in zip(hidden, plain_rows(llama, later), strict=True):
                assert torch.allclose(got, want, atol=2e-5)


def test_with_the_daemon_gone_rows_are_computed_normally_with_unchanged_results(llama, tmp_path):
    daemon = _start_daemon(tmp_path, llama)  # its own: the module's daemon serves the other tests, in any order
    queries = prefix_rows([3], seed=5, prefix=SHARED_A)
    cache = AttnCache(llama, f"grpc://{daemon.target}", token=READ_TOKEN, exact=False, prefix_min_tokens=16,
                      timeout=2.0)
    daemon.stop()
    hidden = cache.hidden_states(queries)
    assert cache.last_row_kinds == ("fallback",)
    assert torch.allclose(hidden[0], plain_rows(llama, queries)[0], atol=2e-5)
    cache.close()
