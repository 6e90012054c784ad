"""The store changing under a running client (real processes): the rows it touches are computed, never raised.

A daemon on a real Redis serves a namespace with a projector; an ``AttnCache`` encodes
through it (map hits). Redis is then flushed and the namespace made again without a
projector (``admin create-namespace``'s code): the client's next search is told the
projector changed, reads the namespace again and finds none. Its rows must be computed
(counted as fallbacks) and the view adopted without a projector, never an assertion.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from attnstore_client import namespace as namespace_module
from attnstore_client.cache import AttnCache
from attnstore_tools.admin.cold_start import create_exact_namespace
from attnstore_tools.build.namespace_layout import token_limits
from tests.support.caches import capture_entries, plain_hidden, sentences, tiny_loaded
from tests.support.daemon import ADMIN_TOKEN, READ_TOKEN, DaemonProcess
from tests.support.redis_servers import RedisServer, unique_prefix
from tests.support.wait import wait_until


def _cosines(loaded, texts: list[str], embeddings: np.ndarray) -> list[float]:
    expected = torch.stack([h.mean(dim=0) for h in plain_hidden(loaded, texts)])  # (n, hidden)
    got = torch.from_numpy(embeddings).float()
    return torch.nn.functional.cosine_similarity(got, expected, dim=1).tolist()


def test_a_namespace_replaced_without_a_projector_under_a_running_client_computes_its_rows(
    redis: RedisServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    loaded = tiny_loaded("bert")
    stored = sentences(6, seed=70, min_words=8, max_words=8)
    # Same length as the stored rows, other words: near-duplicates only, so every row goes to the map tier.
    queries = sentences(6, seed=71, min_words=8, max_words=8)
    captured = capture_entries(loaded, stored)
    daemon = DaemonProcess(redis.url(unique_prefix()), tmp_path).start()
    try:
        with daemon.client(ADMIN_TOKEN) as admin:
            admin.create_namespace("default", model=loaded.name, fingerprint=captured.fingerprint,
                                   layout=captured.layout, projector=captured.projector.to_safetensors_bytes(),
                                   limits=token_limits(loaded))
            admin.ingest("default", captured.fingerprint, captured.entries)
            with AttnCache(loaded, f"grpc://{daemon.target}", token=READ_TOKEN, max_distance=1e9) as cache:
                cache.encode(queries[:3])
                assert cache.last_stats.map_hits == 3  # the projector is in use

                with redis.client() as raw:
                    raw.flushall()
                wait_until(lambda: create_exact_namespace(admin, loaded, "default").projector == b"", 60.0,
                           what="the namespace made again, without a projector", poll=0.1)

                embeddings = cache.encode(queries)
                assert min(_cosines(loaded, queries, embeddings)) >= 0.9999
                assert cache.last_stats.map_hits == 0
                assert set(cache.last_row_kinds) <= {"fallback", "miss"}
                assert "fallback" in cache.last_row_kinds  # the rows the search could not serve

                again = cache.encode(queries)  # the view without a projector was adopted: exact tiers only
                assert min(_cosines(loaded, queries, again)) >= 0.9999
                assert cache.last_stats.map_hits == 0 and set(cache.last_row_kinds) == {"miss"}

                # A projector installed again is taken up at the next read of the namespace (not waited for here).
                monkeypatch.setattr(namespace_module, "NAMESPACE_RETRY_SECONDS", 0.0)
                admin.create_namespace("default", model=loaded.name, fingerprint=captured.fingerprint,
                                       layout=captured.layout, projector=captured.projector.to_safetensors_bytes(),
                                       limits=token_limits(loaded))
                admin.ingest("default", captured.fingerprint, captured.entries)
                fresh = sentences(3, seed=72, min_words=8, max_words=8)  # none in the node's own exact tier
                resumed = cache.encode(fresh)
                assert cache.last_stats.map_hits == 3
                assert min(_cosines(loaded, fresh, resumed)) >= 0.9
    finally:
        assert daemon.stop() == 0, daemon.log()
