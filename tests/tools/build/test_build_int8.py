"""``attnstore build --int8``: the int8 plan chosen on the corpus, and stored with the projector."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import numpy as np
import pytest

from attnstore.errors import ConfigError
from attnstore.projector.blob import has_embedding_layer, int8_plan_from_projector
from attnstore.service import AttnStoreService
from attnstore_client.adapters import adapter_for
from attnstore_client.int8 import int8_candidates, linear_flops, quantized_model
from attnstore_client.tiers.engines.graphs import CACHE_ENV
from attnstore_client.tiers.engines.int8 import DYNAMIC_GROUP, export_int8_graph
from attnstore_client.tiers.engines.runtimes import OpenVinoEngine
from attnstore_tools.build.command import BuildConfig, BuildReport, build_namespace
from attnstore_tools.build.int8 import Int8Config, Int8Report, calibrate_int8, format_int8, graph_embeddings
from attnstore_tools.build.training import TrainConfig
from tests.support.caches import tiny_loaded
from tests.tools.build.test_build import corpus

_QUICK = TrainConfig(max_epochs=3, patience=1)
_SMALL = Int8Config(rows=16, target=0.9)


@pytest.fixture(scope="module")
def built(minilm_model, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[AttnStoreService, BuildReport]]:
    """A store whose namespace ``ns`` a build filled with an int8 plan (the projector's own calibration skipped)."""
    with pytest.MonkeyPatch.context() as patch, \
            AttnStoreService.open(tmp_path_factory.mktemp("int8") / "store", create=True) as service:
        patch.setenv(CACHE_ENV, str(tmp_path_factory.mktemp("engines")))  # the int8 graph checked, not ~/.cache's
        config = BuildConfig(namespace="ns", train=_QUICK, calibration=None, int8=_SMALL)
        yield service, build_namespace(minilm_model, corpus(), service, config, progress=False)


def test_the_plan_keeps_the_target_share_of_the_sample_faithful(minilm_model, built) -> None:
    report = built[1].int8
    assert report is not None
    plan = report.plan
    assert plan is not None and plan.rows == 16 and plan.share >= _SMALL.target
    kept = [point.linear for point in report.frontier if point.kept]
    assert sorted(plan.linears) == sorted(kept)
    assert all(point.share >= _SMALL.target for point in report.frontier if point.kept)
    assert all(point.share < _SMALL.target for point in report.frontier if not point.kept)
    candidates = int8_candidates(adapter_for(minilm_model))
    assert len(report.frontier) == len(candidates) == len(report.alone)
    assert plan.flops_share == pytest.approx(linear_flops(minilm_model.model, plan.linears)
                                             / linear_flops(minilm_model.model, candidates))
    # The plan's model, run apart from the calibration, keeps what the plan says on its sample.
    pipeline = minilm_model.sentence_transformer
    texts = sorted(set(corpus()))
    reference = pipeline.encode(texts, normalize_embeddings=True)
    transformer, fp32 = pipeline[0], pipeline[0].model
    transformer.model = quantized_model(fp32, plan.linears)
    try:
        int8 = pipeline.encode(texts, normalize_embeddings=True)
    finally:
        transformer.model = fp32
    cosines = np.sum(int8 * reference, axis=1)
    assert np.mean(cosines >= plan.fidelity) >= 0.8 and not np.allclose(int8, reference, atol=1e-5)


def test_the_plans_graph_layers_keep_the_target_on_the_openvino_graph(minilm_model, built) -> None:
    pytest.importorskip("openvino")
    pytest.importorskip("nncf")
    report = built[1].int8
    assert report is not None and report.plan is not None
    plan = report.plan
    # Every candidate or the plan's own layers, whichever first kept the target (on log-like text, every one).
    candidates = tuple(int8_candidates(adapter_for(minilm_model)))
    assert plan.graph_linears in (candidates, plan.linears) and plan.graph_share >= _SMALL.target
    assert f"int8 graph (OpenVINO): {len(plan.graph_linears)} linear layers" in format_int8(report)[1]
    # The graph, run apart from the calibration, keeps what the plan says on the corpus.
    pipeline = minilm_model.sentence_transformer
    texts = sorted(set(corpus()))
    graph = OpenVinoEngine(export_int8_graph(minilm_model, plan.graph_linears), threads=1,
                           dynamic_group=DYNAMIC_GROUP)
    cosines = np.sum(graph_embeddings(pipeline, graph, texts, 8) * pipeline.encode(texts, normalize_embeddings=True),
                     axis=1)
    assert np.mean(cosines >= plan.fidelity) >= 0.8 and cosines.min() < 0.99999  # int8: close, not equal


def test_a_model_without_a_sentence_transformers_pipeline_has_no_int8_plan() -> None:
    with pytest.raises(ConfigError, match="sentence-transformers pipeline"):
        calibrate_int8(tiny_loaded("bert"), corpus(), _SMALL, progress=False)


def test_a_build_asking_an_int8_plan_of_such_a_model_is_refused_before_anything_is_written(tmp_path) -> None:
    with AttnStoreService.open(tmp_path / "store", create=True) as service:
        with pytest.raises(ConfigError, match="sentence-transformers pipeline"):
            build_namespace(tiny_loaded("bert"), corpus(), service, BuildConfig(namespace="ns", int8=_SMALL),
                            progress=False)
        assert service.list_namespaces() == []


def test_the_report_says_when_no_layer_kept_the_target() -> None:
    assert "none" in format_int8(Int8Report(None))[0]


def test_build_stores_the_plan_in_a_new_namespace_and_adds_it_to_an_existing_one(minilm_model, built) -> None:
    service, fresh = built
    assert fresh.entries > 0 and fresh.int8 is not None and fresh.int8.plan is not None
    assert int8_plan_from_projector(service.get_namespace("ns").projector) == fresh.int8.plan
    quick = BuildConfig(namespace="other", train=_QUICK, calibration=None)
    build_namespace(minilm_model, corpus(), service, quick, progress=False)
    assert int8_plan_from_projector(service.get_namespace("other").projector) is None
    tiny = Int8Config(rows=4, target=0.5)
    report = build_namespace(minilm_model, corpus(), service, dataclasses.replace(quick, int8=tiny), progress=False)
    assert report.entries == 0 and report.int8 is not None and report.int8.plan is not None
    stored = service.get_namespace("other").projector
    assert int8_plan_from_projector(stored) == report.int8.plan and has_embedding_layer(stored)


def test_a_model_openvino_cannot_take_keeps_its_torch_plan_with_no_graph_layers(
    minilm_model, monkeypatch: pytest.MonkeyPatch
) -> None:
    def refused(*args: object, **kwargs: object) -> None:
        raise RuntimeError("this architecture does not convert")

    monkeypatch.setattr("attnstore_tools.build.int8.export_int8_graph", refused)
    report = calibrate_int8(minilm_model, corpus(), Int8Config(rows=8, rank_rows=4, target=0.5), progress=False)
    assert report.plan is not None and report.plan.linears  # the build goes on with its torch plan
    assert (report.plan.graph_linears, report.plan.graph_share) == ((), 0.0)
    assert "int8 graph (OpenVINO): none" in format_int8(report)[1]
