"""The store's exact tier when the store fails part-way through a call: the windows it answered are exact hits,
the rest of the call's rows are computed as fallbacks, and every row equals the plain model's."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from attnstore.errors import UnavailableError
from attnstore.index import ExactIndex
from attnstore.service import AttnStoreService
from attnstore.store import MemoryMapStore
from attnstore_client.adapters import adapter_for
from attnstore_client.call.settings import CallSettings
from attnstore_client.call.sinks import RowStates
from attnstore_client.call.sources import TokenRows
from attnstore_client.call.state import Call
from attnstore_client.connection.local import LocalConnection
from attnstore_client.keys import model_fingerprint
from attnstore_client.namespace import NamespaceReader
from attnstore_client.prefill import Prefill
from attnstore_client.resilience import CircuitBreaker, RetryPolicy
from attnstore_client.tiers.base import TierContext
from attnstore_client.tiers.compute import ComputeTier
from attnstore_client.tiers.cost_model import CostModel, CostSettings
from attnstore_client.tiers.local_exact import LocalExactTier, LocalOutputs
from attnstore_client.tiers.store_exact import StoreExactTier
from tests.support.caches import fill_namespace, plain_hidden, sentences, tiny_loaded

TOLERANCE = 2e-3  # fp16 outputs
TEXTS = sentences(7, seed=71, min_words=5, max_words=5)  # one length: taken in input order
STORED = TEXTS[:4]


class _GoesAway(LocalConnection):
    """A real embedded connection that answers its first exact-tier call, then is unreachable."""

    def __init__(self, service: AttnStoreService) -> None:
        super().__init__("local:memory", service)
        self.calls = 0

    def exact(self, namespace: str, fingerprint: str, hashes: Sequence[bytes], lengths: Sequence[int], *,
              timeout: float | None) -> dict[int, np.ndarray]:
        self.calls += 1
        if self.calls > 1:
            raise UnavailableError("daemon gone")
        return super().exact(namespace, fingerprint, hashes, lengths, timeout=timeout)


def test_a_store_gone_after_answering_a_window_leaves_the_later_windows_to_the_compute_tier() -> None:
    bert = tiny_loaded("bert")
    service = AttnStoreService(MemoryMapStore(), make_index=ExactIndex)
    fill_namespace(service, bert, STORED)
    connection = _GoesAway(service)
    cost_model = CostModel(CostSettings(min_samples=10**9))
    context = TierContext(adapter_for(bert), connection, model_fingerprint(bert.model, bert.tokenizer),
                          CircuitBreaker(), lambda: cost_model)
    namespace = NamespaceReader(connection, "default", context.fingerprint, model=bert.name, causal=False,
                                device=context.device).read()
    local = LocalExactTier(context, LocalOutputs(1 << 20, admit_after=1))
    ids = bert.tokenizer(TEXTS)["input_ids"]
    settings = CallSettings("default", max_distance=1e-3, maps=False, window=2, retry=RetryPolicy(attempts=1))
    sink = RowStates(len(ids))
    call = Call(settings, namespace, sink, len(ids))
    Prefill([local, StoreExactTier(context, local), ComputeTier(context, local)]).run(TokenRows(ids), call)
    for got, want in zip(sink.result(), plain_hidden(bert, TEXTS), strict=True):
        assert (got - want).abs().max().item() < TOLERANCE
    assert connection.calls == 2  # the store is not asked again in the call
    assert call.kinds == ["exact"] * 2 + ["fallback"] * 5
    assert call.counts.exact_hits == 2 and call.counts.fallbacks == {"unavailable": 5}


class _WrongShapes(LocalConnection):
    """A real embedded connection whose store answers each stored row with outputs one token short."""

    def exact(self, namespace: str, fingerprint: str, hashes: Sequence[bytes], lengths: Sequence[int], *,
              timeout: float | None) -> dict[int, np.ndarray]:
        found = super().exact(namespace, fingerprint, hashes, lengths, timeout=timeout)
        return {position: array[:-1] for position, array in found.items()}


def test_stored_outputs_of_another_shape_than_their_row_are_computed_as_bad_data_not_served() -> None:
    from attnstore_client.cache import AttnCache

    bert = tiny_loaded("bert")
    service = AttnStoreService(MemoryMapStore(), make_index=ExactIndex)
    fill_namespace(service, bert, STORED)
    cache = AttnCache(bert, _WrongShapes("local:memory", service), exact_cache_bytes=0)
    cache.maps = False
    embeddings = cache.encode(TEXTS)
    assert cache.last_row_kinds == ("fallback",) * len(STORED) + ("miss",) * (len(TEXTS) - len(STORED))
    assert cache.last_stats.fallbacks == {"bad_data": len(STORED)}
    expected = torch.stack([h.mean(dim=0) for h in plain_hidden(bert, TEXTS)]).numpy()
    np.testing.assert_allclose(embeddings, expected, atol=TOLERANCE)
