"""The map tier when its store fails part-way: a map stream that breaks after some forwards replayed, or in the
middle of a forward once some layers arrived. The rows it served stay map hits; every other row is computed as a
fallback, and every row equals the plain model's."""

from __future__ import annotations

import numpy as np
import pytest

from attnstore.errors import MapsUnavailableError
from attnstore.index import ExactIndex
from attnstore.service import AttnStoreService
from attnstore.store import MemoryMapStore
from attnstore_client.adapters import adapter_for
from attnstore_client.call.settings import CallSettings
from attnstore_client.call.sinks import RowStates
from attnstore_client.call.sources import TokenRows
from attnstore_client.call.state import Call
from attnstore_client.connection import MapStream
from attnstore_client.connection.local import LocalConnection
from attnstore_client.keys import model_fingerprint
from attnstore_client.namespace import NamespaceReader
from attnstore_client.prefill import Prefill
from attnstore_client.resilience import CircuitBreaker
from attnstore_client.tiers.base import TierContext
from attnstore_client.tiers.compute import ComputeTier
from attnstore_client.tiers.cost_model import CostModel, CostSettings
from attnstore_client.tiers.local_exact import LocalExactTier, LocalOutputs
from attnstore_client.tiers.maps import MapTier
from tests.support.caches import fill_namespace, plain_hidden, sentences, tiny_loaded

TOLERANCE = 2e-3  # fp16 maps
STORED = sentences(4, seed=61, min_words=6, max_words=6)  # one length: replayed longest first in stored order
TEXTS = STORED + sentences(3, seed=62)


class _Broken(MapStream):
    """A stream whose store goes away once ``layers`` layers of every row arrived: every row fails from then on."""

    def __init__(self, inner: MapStream, rows: int, layers: int) -> None:
        super().__init__()
        self._inner, self._rows, self._layers = inner, rows, layers
        self._failed: dict[int, str] = {}

    def layer(self, row: int, layer: int) -> np.ndarray:
        if layer >= self._layers:
            self._failed = dict.fromkeys(range(self._rows), "outage")
            self.outage = ConnectionError("daemon gone")
            raise MapsUnavailableError(f"row {row}: daemon gone", row=row, cause="outage")
        return self._inner.layer(row, layer)

    def failed(self) -> dict[int, str]:
        return dict(self._failed)

    def wait(self) -> None:
        self._inner.wait()


class _GoesAway(LocalConnection):
    """A real embedded connection whose map streams after the first ``whole`` break after ``layers`` layers."""

    def __init__(self, service: AttnStoreService, *, whole: int, layers: int) -> None:
        super().__init__("local:memory", service)
        self._whole, self._layers, self.streams = whole, layers, 0

    def fetch_maps(self, namespace, fingerprint, rows, *, timeout) -> MapStream:
        inner = super().fetch_maps(namespace, fingerprint, rows, timeout=timeout)
        self.streams += 1
        return inner if self.streams <= self._whole else _Broken(inner, len(rows), self._layers)


@pytest.fixture(scope="module")
def bert():
    return tiny_loaded("bert")


def _call(bert, connection: LocalConnection) -> tuple[Call, RowStates, Prefill, list[list[int]]]:
    cost_model = CostModel(CostSettings(min_samples=10**9))
    context = TierContext(adapter_for(bert), connection, model_fingerprint(bert.model, bert.tokenizer),
                          CircuitBreaker(), lambda: cost_model)
    namespace = NamespaceReader(connection, "default", context.fingerprint, model=bert.name, causal=False,
                                device=context.device).read()
    local = LocalExactTier(context, LocalOutputs(0))
    ids = bert.tokenizer(TEXTS)["input_ids"]
    settings = CallSettings("default", max_distance=1e-3, exact=False, batch_size=2)  # two replay forwards
    sink = RowStates(len(ids))
    prefill = Prefill([MapTier(context), ComputeTier(context, local)])
    return Call(settings, namespace, sink, len(ids)), sink, prefill, ids


@pytest.mark.parametrize(("whole", "layers"), [(1, 0), (1, 1), (0, 1)])
def test_a_map_stream_broken_part_way_leaves_its_rows_to_the_compute_tier_and_every_row_plain(
    bert, whole: int, layers: int
) -> None:
    service = AttnStoreService(MemoryMapStore(), make_index=ExactIndex)
    fill_namespace(service, bert, STORED, outputs=False)
    connection = _GoesAway(service, whole=whole, layers=layers)
    call, sink, prefill, ids = _call(bert, connection)
    prefill.run(TokenRows(ids), call)
    for got, want in zip(sink.result(), plain_hidden(bert, TEXTS), strict=True):
        assert (got - want).abs().max().item() < TOLERANCE
    replayed = 2 * whole  # rows of the forwards whose stream held
    assert call.counts.map_hits == replayed and call.counts.fallbacks == {"outage": len(STORED) - replayed}
    assert sorted(call.kinds[: len(STORED)]) == sorted(["map"] * replayed + ["fallback"] * (len(STORED) - replayed))
    assert call.kinds[len(STORED):] == ["miss"] * (len(TEXTS) - len(STORED)) and not call.copies


def test_projection_batches_hold_no_more_padded_tokens_than_a_forward_may_and_rows_stay_plain(
    bert, monkeypatch: pytest.MonkeyPatch
) -> None:
    service = AttnStoreService(MemoryMapStore(), make_index=ExactIndex)
    fill_namespace(service, bert, STORED, outputs=False)
    connection = LocalConnection("local:memory", service)
    cost_model = CostModel(CostSettings(min_samples=10**9))
    context = TierContext(adapter_for(bert), connection, model_fingerprint(bert.model, bert.tokenizer),
                          CircuitBreaker(), lambda: cost_model)
    projected: list[int] = []  # padded tokens of each projection batch
    feature_source = context.adapter.feature_source

    def counted(batch):
        projected.append(batch.size * max(batch.lengths))
        return feature_source(batch)

    monkeypatch.setattr(context.adapter, "feature_source", counted)
    namespace = NamespaceReader(connection, "default", context.fingerprint, model=bert.name, causal=False,
                                device=context.device).read()
    ids = bert.tokenizer(TEXTS)["input_ids"]
    budget = 2 * max(len(row) for row in ids)  # two of the longest rows per forward
    settings = CallSettings("default", max_distance=1e-3, exact=False, batch_size=32, max_batch_tokens=budget)
    sink = RowStates(len(ids))
    call = Call(settings, namespace, sink, len(ids))
    prefill = Prefill([MapTier(context), ComputeTier(context, LocalExactTier(context, LocalOutputs(0)))])
    prefill.run(TokenRows(ids), call)
    assert len(projected) >= len(TEXTS) // 2 and max(projected) <= budget  # not one batch of 32 rows
    assert call.counts.map_hits == len(STORED)
    for got, want in zip(sink.result(), plain_hidden(bert, TEXTS), strict=True):
        assert (got - want).abs().max().item() < TOLERANCE
