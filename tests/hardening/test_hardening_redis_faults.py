"""A daemon whose Redis fills up or goes down (real Redis server, real daemon, a real client).

Full: the refusal a client sees (and the log line) names the Redis command that
failed, never its binary arguments; lookups go on. Down: the daemon answers
UNAVAILABLE at once, not after waiting out a failover that is not coming, so a
client computes its rows within seconds.
"""

from __future__ import annotations

import re
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from attnstore.errors import StoreFullError, UnavailableError
from attnstore.protocol.records import NamespaceLayout
from attnstore.protocol.requests import exact_request
from attnstore_client.cache import AttnCache
from attnstore_tools.admin.cold_start import create_exact_namespace
from tests.support.caches import plain_hidden, sentences, tiny_loaded
from tests.support.daemon import ADMIN_TOKEN, READ_TOKEN, DaemonProcess
from tests.support.redis_servers import RedisServer, unique_prefix
from tests.support.server_fixtures import FP, LIMITS
from tests.support.stores import make_entry

# Entries of a few KiB: a handful fill the little room left below maxmemory.
LAYOUT = NamespaceLayout(layers=4, heads=4, causal=True, hidden=64, feature_dim=16)


def test_redis_full_is_resource_exhausted_naming_the_command_without_its_bytes_and_lookups_go_on(
    redis: RedisServer, tmp_path: Path
) -> None:
    daemon = DaemonProcess(redis.url(unique_prefix()), tmp_path).start()
    try:
        with daemon.client(ADMIN_TOKEN) as admin, redis.client() as raw:
            admin.create_namespace("ns", model="tiny-synthetic", fingerprint=FP, layout=LAYOUT, limits=LIMITS)
            (first,) = admin.ingest("ns", FP, [make_entry(LAYOUT, 32, 0)]).entry_ids
            raw.config_set("maxmemory", int(raw.info("memory")["used_memory"]) + 64 * 1024)
            with pytest.raises(StoreFullError) as refused:
                for seed in range(1, 200):
                    admin.ingest("ns", FP, [make_entry(LAYOUT, 32, seed)])
            message = str(refused.value)
            # Which write meets the full Redis depends on its memory then (other tests share the server): the
            # entry ids' counter, the pipeline of the entries' hashes (its command named, never its bytes) or the
            # script registering them.
            assert re.match(r"RESOURCE_EXHAUSTED: Redis is full while (allocating entry ids in 'ns' \(|writing entries"
                            r" into 'ns' \(HSET \(command 1 of a pipeline\): |registering entries in 'ns' \()"
                            r"command not allowed when used memory", message), message
            assert message.isprintable() and "\\x" not in message and len(message) < 600
            entry = make_entry(LAYOUT, 32, 0)
            hits = admin.lookup(exact_request("ns", FP, [entry.token_hash, bytes(32)], [32, 32]))  # counts a miss
            assert [m.entry_id for m in hits.matches] == [first, 0]
    finally:
        assert daemon.stop() == 0, daemon.log()
    lines = [line for line in daemon.log().splitlines() if "Redis is full" in line]
    assert lines and all("\\x" not in line and len(line) < 1000 for line in lines)


def test_a_daemon_whose_redis_is_down_answers_unavailable_at_once_and_a_client_computes_within_seconds(
    redis: RedisServer, tmp_path: Path
) -> None:
    daemon = DaemonProcess(redis.url(unique_prefix()), tmp_path).start()
    loaded = tiny_loaded("bert")
    texts = sentences(6, seed=7)
    try:
        with daemon.client(ADMIN_TOKEN) as admin:
            create_exact_namespace(admin, loaded, "default")
        with AttnCache(loaded, f"grpc://{daemon.target}", token=READ_TOKEN, exact_cache_bytes=0) as cache:
            cache.encode(texts[:2])
            redis.kill()
            start = time.monotonic()
            embeddings = cache.encode(texts)
            seconds = time.monotonic() - start
            assert seconds < 8.0, f"the client waited {seconds:.1f} s for a daemon whose Redis is down"
            assert cache.last_stats.fallbacks.get("unavailable", 0) + cache.last_stats.fallbacks.get(
                "circuit_open", 0) > 0
            expected = torch.stack([h.mean(dim=0) for h in plain_hidden(loaded, texts)]).numpy()
            np.testing.assert_allclose(embeddings, expected, atol=1e-5)
            with daemon.client(READ_TOKEN) as reader:  # every call of the daemon fails fast meanwhile
                start = time.monotonic()
                with pytest.raises(UnavailableError, match="UNAVAILABLE: Redis is unavailable"):
                    reader.get_namespace("default")
                assert time.monotonic() - start < 1.0
    finally:
        assert daemon.stop() == 0, daemon.log()
    assert "event=redis_down" in daemon.log()
