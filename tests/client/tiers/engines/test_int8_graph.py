"""int8 on OpenVINO (``tiers.engines.int8``): the plan's graph layers in int8, and int8 rows computed on it."""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from attnstore.errors import ConfigError
from attnstore.index import ExactIndex
from attnstore.projector.int8_plan import Int8Plan
from attnstore.service import AttnStoreService
from attnstore.store import MemoryMapStore
from attnstore_client.adapters import adapter_for
from attnstore_client.adapters.batch import batch_from_ids
from attnstore_client.cache import AttnCache
from attnstore_client.connection.local import LocalConnection
from attnstore_client.int8 import int8_candidates
from attnstore_client.models import LoadedModel
from attnstore_client.tiers.engines.choice import check_int8_graph
from attnstore_client.tiers.engines.graphs import CACHE_ENV
from attnstore_client.tiers.engines.int8 import DYNAMIC_GROUP, export_int8_graph
from attnstore_client.tiers.engines.runtimes import INT8_RUNTIME_CACHE, OpenVinoEngine
from tests.support.caches import fill_namespace, mean_pooled, sentences, tiny_loaded
from tests.support.vectors import row_cosines

pytest.importorskip("openvino")
pytest.importorskip("nncf")

TEXTS = sentences(16, seed=7, max_words=30)
STORED = TEXTS[:4]


def _plan(loaded: LoadedModel, graph_linears: tuple[str, ...]) -> Int8Plan:
    attention = tuple(name for name in int8_candidates(adapter_for(loaded)) if ".attention." in name)
    return Int8Plan(attention, fidelity=0.99, target=0.995, share=1.0, rows=8, flops_share=0.5,
                    graph_linears=graph_linears, graph_share=1.0 if graph_linears else 0.0)


def _connection(loaded: LoadedModel, plan: Int8Plan) -> LocalConnection:
    service = AttnStoreService(MemoryMapStore(), make_index=ExactIndex)
    fill_namespace(service, loaded, STORED, int8=plan)
    return LocalConnection("local:memory", service)


def test_the_int8_graph_quantises_the_named_layers_once_and_stays_close_to_fp32(
    bert: LoadedModel, graphs: Path
) -> None:
    linears = tuple(int8_candidates(adapter_for(bert)))
    path = export_int8_graph(bert, linears, cache_dir=graphs)
    assert export_int8_graph(bert, linears, cache_dir=graphs) == path  # made once, read after
    import openvino

    weights = {op.get_output_element_type(0).get_type_name() for op in openvino.Core().read_model(str(path)).get_ops()
               if op.get_type_name() == "Constant"}
    assert "u8" in weights  # int8 weights (asymmetric: unsigned, with zero points)
    engine = OpenVinoEngine(path, threads=1, dynamic_group=DYNAMIC_GROUP)
    # The runtime state of a few batch shapes kept, not of 5,000: an int8 graph keeps about 1 MiB a shape.
    assert engine.config["CPU_RUNTIME_CACHE_CAPACITY"] == INT8_RUNTIME_CACHE
    batch = batch_from_ids([[5 + i for i in range(n)] for n in (7, 30, 12)], bert.tokenizer.pad_token_id)
    with torch.inference_mode():
        expected = adapter_for(bert).forward(batch)
    got = engine.forward(batch)
    for row, length in enumerate(batch.lengths):
        a, b = got[row, :length].flatten(), expected[row, :length].flatten()
        assert not torch.allclose(a, b, atol=1e-5) and float(torch.cosine_similarity(a, b, dim=0)) > 0.99
    other = export_int8_graph(bert, linears[:2], cache_dir=graphs)
    assert other != path and other.is_file()  # other layers: another graph


def test_a_layer_the_graph_lacks_is_refused_naming_it(bert: LoadedModel, graphs: Path) -> None:
    with pytest.raises(ConfigError, match=r"no MatMul of \['encoder.layer.99.output.dense'\]"):
        export_int8_graph(bert, ["encoder.layer.99.output.dense"], cache_dir=graphs)
    with pytest.raises(ConfigError, match="no linear layers"):
        export_int8_graph(bert, [], cache_dir=graphs)


@pytest.mark.parametrize("engine", ["openvino", "auto"])
def test_int8_rows_run_on_the_plans_graph_close_to_fp32_and_kept_nowhere(engine: str, bert: LoadedModel) -> None:
    plan = _plan(bert, tuple(int8_candidates(adapter_for(bert))))
    with AttnCache(bert, _connection(bert, plan), maps=False, int8=True, engine=engine) as cache:
        got = cache.encode(TEXTS, batch_size=4)
        stats = cache.last_stats
        assert (stats.exact_hits, stats.misses, stats.int8_rows) == (4, 12, 12)
        choice = cache.int8_engines
        assert choice is not None and set(choice.seconds) == {"torch", "openvino"}
        if engine == "openvino":
            assert set(choice.engines) == {"openvino"}
        cache.encode(TEXTS, batch_size=4)
        assert cache.last_stats.local_hits == 0  # int8 rows enter no exact tier
    expected = mean_pooled(bert, TEXTS[4:])
    assert not np.allclose(got[4:], expected, atol=1e-5) and row_cosines(got[4:], expected).min() > 0.99


def test_a_plan_without_graph_layers_keeps_int8_rows_on_torch(bert: LoadedModel, graphs: Path) -> None:
    plan = _plan(bert, ())
    before = sorted(graphs.rglob("openvino-int8-*"))
    with AttnCache(bert, _connection(bert, plan), maps=False, int8=True, engine="openvino") as cache:
        got = cache.encode(TEXTS, batch_size=4)
        assert cache.last_stats.int8_rows == 12 and cache.int8_engines is None
    assert sorted(graphs.rglob("openvino-int8-*")) == before
    assert row_cosines(got[4:], mean_pooled(bert, TEXTS[4:])).min() > 0.99


def test_torch_and_onnxruntime_keep_int8_rows_on_torch(bert: LoadedModel) -> None:
    plan = dataclasses.replace(_plan(bert, ()), graph_linears=tuple(int8_candidates(adapter_for(bert))),
                               graph_share=1.0)
    for engine in ("torch", "onnxruntime"):
        with AttnCache(bert, _connection(bert, plan), maps=False, int8=True, engine=engine) as cache:
            cache.encode(TEXTS, batch_size=4)
            assert cache.last_stats.int8_rows == 12 and cache.int8_engines is None, engine


def test_an_int8_graph_of_other_weights_fails_its_check_and_an_explicit_engine_says_why(
    bert: LoadedModel, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(CACHE_ENV, str(tmp_path))  # a cache of its own: its graph is replaced below
    other = tiny_loaded("bert", seed=1)
    linears = tuple(int8_candidates(adapter_for(other)))
    foreign = export_int8_graph(other, linears, cache_dir=tmp_path)
    reason = check_int8_graph(adapter_for(bert), OpenVinoEngine(foreign, threads=1, dynamic_group=DYNAMIC_GROUP), 0.99)
    assert reason is not None and "cosine" in reason
    own = export_int8_graph(bert, linears, cache_dir=tmp_path)
    assert check_int8_graph(adapter_for(bert), OpenVinoEngine(own, threads=1, dynamic_group=DYNAMIC_GROUP), 0.99) \
        is None
    for name in ("openvino_model.xml", "openvino_model.bin"):  # bert's int8 graph overwritten by the other's
        shutil.copyfile(foreign.parent / name, own.parent / name)
    plan = _plan(bert, linears)
    with AttnCache(bert, _connection(bert, plan), maps=False, int8=True, engine="openvino") as cache:
        with pytest.raises(ConfigError, match="the plan's int8 graph .*cosine"):
            cache.encode(TEXTS, batch_size=4)
    with AttnCache(bert, _connection(bert, plan), maps=False, int8=True, engine="auto") as cache:
        got = cache.encode(TEXTS, batch_size=4)  # auto: the int8 rows stay on torch's int8 model
        assert cache.last_stats.int8_rows == 12 and cache.int8_engines is None
    assert row_cosines(got[4:], mean_pooled(bert, TEXTS[4:])).min() > 0.99
