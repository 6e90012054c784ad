"""Choosing an engine per length band (``tiers.engines.choice``): the check against torch, the timed choice."""

from __future__ import annotations

from pathlib import Path

import pytest

from attnstore.errors import ConfigError
from attnstore_client.adapters import adapter_for
from attnstore_client.models import LoadedModel
from attnstore_client.tiers.engines.choice import (
    MARGIN,
    TORCH,
    EngineChoice,
    bands_up_to,
    check_graph,
    choose_engines,
    pick_engines,
)
from attnstore_client.tiers.engines.graphs import export_graph
from attnstore_client.tiers.engines.runtimes import open_engine
from attnstore_client.tiers.forward_pool import ForwardPool
from tests.support.caches import tiny_loaded

pytest.importorskip("openvino")
pytest.importorskip("onnxruntime")


def test_a_graph_of_the_model_passes_its_check_and_one_of_other_weights_is_refused(
    bert: LoadedModel, tmp_path: Path
) -> None:
    adapter = adapter_for(bert)
    own = open_engine("openvino", export_graph("openvino", bert, cache_dir=tmp_path), threads=1)
    assert check_graph(adapter, own) is None
    other = tiny_loaded("bert", seed=1)
    foreign = open_engine("openvino", export_graph("openvino", other, cache_dir=tmp_path), threads=1)
    reason = check_graph(adapter, foreign)
    assert reason is not None and "differ from the model's" in reason


def test_a_refused_graph_never_takes_a_band_and_is_named_in_the_choice(bert: LoadedModel, tmp_path: Path) -> None:
    foreign = open_engine("onnxruntime", export_graph("onnxruntime", tiny_loaded("bert", seed=1), cache_dir=tmp_path),
                          threads=1)
    choice = choose_engines(adapter_for(bert), [foreign], ForwardPool(), side_by_side=1, max_length=40, tokens=64,
                            repeats=1)
    assert set(choice.engines) == {TORCH}
    assert "onnxruntime" in choice.refused and "onnxruntime" not in choice.seconds
    with pytest.raises(ConfigError, match="engine='onnxruntime'.*differ"):
        choose_engines(adapter_for(bert), [foreign], ForwardPool(), side_by_side=1, max_length=40, only="onnxruntime",
                       tokens=64, repeats=1)


def test_every_engine_is_timed_in_every_band_and_only_takes_every_band(bert: LoadedModel, tmp_path: Path) -> None:
    graph = open_engine("openvino", export_graph("openvino", bert, cache_dir=tmp_path), threads=1)
    pool = ForwardPool()
    try:
        choice = choose_engines(adapter_for(bert), [graph], pool, side_by_side=2, max_length=40, only="openvino",
                                tokens=64, repeats=1)
    finally:
        pool.close()
    assert choice.bands == (16, 32, 40)
    assert choice.engines == ("openvino",) * 3
    assert set(choice.seconds) == {TORCH, "openvino"}
    assert all(len(times) == 3 and min(times) > 0 for times in choice.seconds.values())
    assert "openvino" in str(choice).splitlines()[1]


def test_a_forwards_band_is_the_first_at_least_as_long_as_its_longest_row() -> None:
    choice = EngineChoice((16, 32, 64), ("torch", "openvino", "onnxruntime"))
    assert [choice.engine_for(n) for n in (1, 16, 17, 32, 33, 64, 500)] == [
        "torch", "torch", "openvino", "openvino", "onnxruntime", "onnxruntime", "onnxruntime"]
    assert choice.uses_graphs and not EngineChoice((16,), ("torch",)).uses_graphs
    assert EngineChoice.from_json(choice.to_json()) == choice


def test_the_bands_end_at_the_longest_row_a_call_gives() -> None:
    assert bands_up_to(256) == (16, 32, 64, 128, 256)
    assert bands_up_to(100) == (16, 32, 64, 100)
    assert bands_up_to(8) == (8,)
    assert bands_up_to(4096)[-2:] == (512, 4096)


def test_a_graph_takes_a_band_from_torch_only_when_it_wins_by_the_margin() -> None:
    seconds = {"torch": (1.0, 1.0, 1.0), "openvino": (1 - MARGIN / 2, 1 - 2 * MARGIN, 1.2),
               "onnxruntime": (1.1, 1 - 1.5 * MARGIN, 1.3)}
    assert pick_engines(seconds) == ("torch", "openvino", "torch")  # the fastest, by more than MARGIN
    assert pick_engines(seconds, only="onnxruntime") == ("onnxruntime",) * 3
