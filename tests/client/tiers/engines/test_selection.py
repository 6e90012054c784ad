"""``AttnCache(engine=...)``: computed rows on the chosen engine equal the model's own, and what stays on torch."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from attnstore.errors import ConfigError
from attnstore.index import ExactIndex
from attnstore.service import AttnStoreService
from attnstore.store import MemoryMapStore
from attnstore_client.cache import AttnCache
from attnstore_client.connection.local import LocalConnection
from attnstore_client.models import LoadedModel
from attnstore_client.tiers.compute import GRAPH_PADDING
from tests.support.caches import WORDS, fill_namespace, mean_pooled, sentences
from tests.support.mapped import resident_bytes

pytest.importorskip("openvino")
pytest.importorskip("onnxruntime")

TEXTS = sentences(24, seed=5, max_words=30)
STORED = TEXTS[:4]


def _connection(loaded: LoadedModel) -> LocalConnection:
    service = AttnStoreService(MemoryMapStore(), make_index=ExactIndex)
    fill_namespace(service, loaded, STORED)
    return LocalConnection("local:memory", service)


@pytest.mark.parametrize("engine", ["openvino", "onnxruntime"])
def test_rows_computed_on_a_graph_equal_the_models_own(engine: str, bert: LoadedModel) -> None:
    with AttnCache(bert, _connection(bert), maps=False, engine=engine) as cache:
        assert cache.engines is None  # chosen on the first call that computes a row
        got = cache.encode(TEXTS, batch_size=4)
        assert cache.engines is not None and set(cache.engines.engines) == {engine}
        stats = cache.last_stats
        assert (stats.exact_hits, stats.misses) == (4, 20)
        # The graph's batches are padded (torch's packed are not), each within GRAPH_PADDING of its rows' tokens.
        assert stats.forward_tokens <= stats.forwarded_tokens <= (1 + GRAPH_PADDING) * stats.forward_tokens
    np.testing.assert_allclose(got[4:], mean_pooled(bert, TEXTS[4:]), atol=1e-5)


def test_auto_chooses_per_band_from_torch_and_the_graphs_and_keeps_the_choice(bert: LoadedModel, graphs: Path) -> None:
    with AttnCache(bert, _connection(bert), maps=False, engine="auto") as cache:
        got = cache.encode(TEXTS, batch_size=4)
        choice = cache.engines
    assert choice is not None and set(choice.seconds) == {"torch", "openvino", "onnxruntime"}
    assert set(choice.engines) <= {"torch", "openvino", "onnxruntime"}
    np.testing.assert_allclose(got[4:], mean_pooled(bert, TEXTS[4:]), atol=1e-5)
    saved = list(graphs.glob("*/choice-auto-*.json"))
    assert len(saved) == 1
    with AttnCache(bert, _connection(bert), maps=False, engine="auto") as again:
        again.encode(TEXTS[4:8])
        assert again.engines == choice  # read back, not timed again


def test_a_named_engine_leaves_torchs_own_forwards_without_onednns_copy_of_the_weights(bert: LoadedModel) -> None:
    with AttnCache(bert, _connection(bert), engine="openvino") as cache:  # maps on: replays run on torch
        cache.encode(TEXTS, batch_size=4)
        assert cache.adapter.fused_linears is False and cache.adapter.linear_kernels == "torch"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="mapped pages are read from /proc/self/smaps")
def test_a_call_on_openvino_leaves_none_of_the_graphs_weights_file_resident(bert: LoadedModel, graphs: Path) -> None:
    with AttnCache(bert, _connection(bert), maps=False, engine="openvino") as cache:
        cache.encode(TEXTS, batch_size=4)  # the graph's forwards read embedding rows of the file, given back after
        assert cache.last_stats.misses == 20 and resident_bytes(graphs, ".bin") == 0


def test_torch_is_the_default_and_exports_nothing(bert: LoadedModel, graphs: Path) -> None:
    before = sorted(graphs.rglob("*"))
    with AttnCache(bert, _connection(bert), maps=False) as cache:
        cache.encode(TEXTS)
        assert cache.settings.engine == "torch" and cache.engines is None
        assert cache.adapter.fused_linears == "auto"  # oneDNN's kernels where they pay: torch computes the rows
        assert cache.last_stats.forwarded_tokens == cache.last_stats.forward_tokens  # packed: nothing padded
    assert sorted(graphs.rglob("*")) == before


def test_an_unknown_engine_is_refused_naming_the_engines(bert: LoadedModel) -> None:
    with pytest.raises(ConfigError, match="engine must be one of.*'tensorrt'"):
        AttnCache(bert, _connection(bert), engine="tensorrt")  # type: ignore[arg-type]


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(texts=st.lists(st.lists(st.sampled_from(WORDS), min_size=1, max_size=60).map(" ".join), min_size=1,
                      max_size=20),
       batch_size=st.integers(1, 16), packed=st.booleans())
def test_generated_calls_on_openvino_equal_the_models_rows(
    bert: LoadedModel, texts: list[str], batch_size: int, packed: bool
) -> None:
    with AttnCache(bert, _connection(bert), maps=False, exact_cache_bytes=0, engine="openvino",
                   packed=packed) as cache:
        got = cache.encode(texts, batch_size=batch_size)
    np.testing.assert_allclose(got, mean_pooled(bert, texts), atol=1e-5)
