"""``attnstore build`` on the BERT-like families of issue 49 item 1 (XLM-RoBERTa, DistilBERT, MPNet): a store with
maps, outputs and a projector, which a cache serves with exact and map hits equal to the plain forward's rows."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from sentence_transformers import SentenceTransformer

from attnstore.protocol.projector_blob import has_embedding_layer
from attnstore.service import AttnStoreService
from attnstore_client.cache import AttnCache
from attnstore_tools.cli import main
from tests.support.adapters import save_tiny_family

CORPUS = [f"Failed password for {user} from 10.0.0.{host} port 22 ssh2" for user in ("root", "admin", "guest")
          for host in range(1, 9)] + ["A man is playing a guitar.", "the quick brown fox"]
QUERIES = [CORPUS[0], CORPUS[5], "A man is playing a guitar.", "something not in the corpus at all", CORPUS[0]]


def _cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return np.sum(a * b, axis=1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))


@pytest.mark.parametrize("family", ["xlm-roberta", "distilbert", "mpnet"])
def test_a_built_store_serves_exact_and_map_hits_equal_to_the_plain_forward(family: str, tmp_path: Path) -> None:
    folder = save_tiny_family(family, tmp_path / "model", pooling="mean")
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(CORPUS), encoding="utf-8")
    store = tmp_path / "store"
    assert main(["build", "--model", str(folder), "--corpus", str(corpus), "--store", str(store), "--no-progress",
                 "--no-calibration"]) == 0
    with AttnStoreService.open(store) as service:
        namespace = service.get_namespace("default")
        assert namespace.projector is not None and has_embedding_layer(namespace.projector)
        assert not namespace.layout.causal and service.stats().entries == len(CORPUS)
    expected = SentenceTransformer(str(folder), device="cpu").encode(QUERIES)
    for exact in (True, False):
        with AttnCache(str(folder), store=f"local:{store}", exact=exact, max_distance=1e-6,
                       exact_cache_bytes=0) as cache:
            assert cache.tiers.maps, cache.tiers.absent
            served = cache.encode(QUERIES)
            kinds = cache.last_row_kinds
        assert ("exact" if exact else "map") in kinds and "miss" in kinds, kinds
        assert _cosines(served, expected).min() >= 0.9999, (kinds, _cosines(served, expected))
