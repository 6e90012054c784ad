"""The daemon on the machine's CPU (a real ``attnstore serve`` over loopback, LMDB) feeding a cache on the GPU:
map hits, exact hits and misses equal the plain model's outputs."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from attnstore.service import AttnStoreService
from attnstore_client.cache import AttnCache
from tests.support.caches import fill_namespace, plain_hidden, sentences, tiny_loaded
from tests.support.daemon import READ_TOKEN, DaemonProcess

STORED = sentences(8, seed=21)
QUERIES = [*STORED, *sentences(4, seed=22)]


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory):
    workdir = tmp_path_factory.mktemp("gpu-daemon")
    with AttnStoreService.open(workdir / "store", create=True) as service:
        fill_namespace(service, tiny_loaded("bert"), STORED)
    process = DaemonProcess(workdir / "store", workdir, create=False).start()
    yield process
    assert process.stop() == 0, process.log()


@pytest.mark.parametrize("exact", [False, True], ids=["map-hits", "exact-hits"])
def test_a_gpu_cache_fed_by_a_cpu_daemon_over_loopback_gives_the_plain_outputs(daemon, device, exact) -> None:
    with AttnCache(tiny_loaded("bert"), f"grpc://{daemon.target}", token=READ_TOKEN, exact=exact,
                   device=device) as cache:
        embeddings = cache.encode(QUERIES)
        kinds = cache.last_row_kinds
        fetched = cache.last_stats.bytes_fetched
    expected = torch.stack([h.mean(dim=0) for h in plain_hidden(tiny_loaded("bert"), QUERIES)]).numpy()
    np.testing.assert_allclose(embeddings, expected, atol=2e-3)
    assert kinds.count("exact" if exact else "map") == len(STORED) and kinds.count("miss") == 4
    assert exact or fetched > 0
