"""``attnstore build`` on every family's tiny model (issue 49's acceptance): a sentence-transformers folder of each
``model_type`` with an adapter (maps, outputs and a projector) or without one (an exact-tier store), built through
the CLI from a small corpus; a cache opened on the store serves computed, exact and map rows equal to
``SentenceTransformer.encode``'s."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from sentence_transformers import SentenceTransformer

from attnstore.projector.blob import has_embedding_layer
from attnstore.service import AttnStoreService
from attnstore_client.cache import AttnCache
from attnstore_tools.cli import main
from tests.support.adapters import save_tiny_family
from tests.support.vectors import row_cosines

# model_type: the pooling its users' sentence-transformers pipelines take (decoders pool their last token).
FAMILIES = {"bert": "cls", "roberta": "mean", "xlm-roberta": "cls", "distilbert": "mean", "mpnet": "mean",
            "modernbert": "cls", "llama": "lasttoken", "mistral": "mean", "qwen2": "lasttoken", "qwen3": "lasttoken",
            "gemma3_text": "lasttoken", "embeddinggemma": "mean", "deberta-v2": "mean", "electra": "mean"}
# Families built under a name of their own: the model_type and ``save_tiny_family``'s options (EmbeddingGemma: a
# bidirectional Gemma 3 under mean pooling, two Dense layers and Normalize).
VARIANTS = {"embeddinggemma": ("gemma3_text", {"bidirectional": True, "dense": (64, 32)})}
WITHOUT_ADAPTER = ("deberta-v2", "electra")
CAUSAL = ("llama", "mistral", "qwen2", "qwen3", "gemma3_text")
SLIDING = ("mistral", "gemma3_text")  # a window shorter than the rows: no prefix tier
CORPUS = [f"Failed password for {user} from 10.0.0.{host} port 22 ssh2"
          for user in ("root", "admin", "guest", "oracle") for host in range(1, 10)] + [
    "A man is playing a guitar.", "the quick brown fox", "Stocks fell sharply today in early trading.", "ok"]
QUERIES = [CORPUS[0], CORPUS[5], "A man is playing a guitar.", "something not in the corpus at all", CORPUS[0], "ok"]
COMPUTED_AND_EXACT = 0.9999  # cosine to sentence-transformers of a row computed here or served by an exact tier
MAP = 0.99  # of a row whose stored maps were replayed


@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_built_store_serves_rows_equal_to_sentence_transformers(family: str, tmp_path: Path) -> None:
    model_type, options = VARIANTS.get(family, (family, {}))
    folder = save_tiny_family(model_type, tmp_path / "model", pooling=FAMILIES[family],
                              padding_side="left" if family in CAUSAL else "right", **options)
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(CORPUS), encoding="utf-8")
    store = tmp_path / "store"
    assert main(["build", "--model", str(folder), "--corpus", str(corpus), "--store", str(store), "--no-progress",
                 "--no-calibration", "--train-limit", "16"]) == 0
    adapter = family not in WITHOUT_ADAPTER
    with AttnStoreService.open(store) as service:
        namespace = service.get_namespace("default")
        assert service.store.stats().entries == len(CORPUS)
        assert (namespace.projector is not None) is adapter
        assert namespace.projector is None or has_embedding_layer(namespace.projector)
    expected = SentenceTransformer(str(folder), device="cpu").encode(QUERIES)
    for exact in (True, False):
        with AttnCache(str(folder), store=f"local:{store}", exact=exact, max_distance=1e-6,
                       exact_cache_bytes=0) as cache:
            assert cache.tiers.maps is adapter, cache.tiers.absent
            # The prefix tier: causal models without a sliding window (the tiny Mistral's and Gemma's are shorter
            # than the rows).
            assert cache.tiers.prefix is (family in CAUSAL and family not in SLIDING), cache.tiers.absent
            assert family not in SLIDING or "sliding-window" in cache.tiers.absent["prefix"], cache.tiers.absent
            served = cache.encode(QUERIES)
            kinds = cache.last_row_kinds
        if exact or adapter:
            assert ("exact" if exact else "map") in kinds and "miss" in kinds, kinds
        cosines = row_cosines(served, expected)
        floors = np.array([MAP if kind == "map" else COMPUTED_AND_EXACT for kind in kinds])
        assert (cosines >= floors).all(), (kinds, cosines)
