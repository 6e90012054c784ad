"""Graph export (``tiers.engines.graphs``) and the runtimes that run the graphs (``tiers.engines.runtimes``)."""

from __future__ import annotations

import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from attnstore.errors import ConfigError
from attnstore_client.adapters import adapter_for
from attnstore_client.adapters.batch import batch_from_ids
from attnstore_client.models import LoadedModel
from attnstore_client.tiers.engines.graphs import ENGINE_NAMES, GRAPH_ENGINES, export_graph, graph_path
from attnstore_client.tiers.engines.runtimes import OpenVinoEngine, open_engine
from tests.support.caches import tiny_loaded
from tests.support.mapped import resident_bytes

pytest.importorskip("openvino")
pytest.importorskip("onnxruntime")


@pytest.mark.parametrize("engine", GRAPH_ENGINES)
def test_a_graph_computes_the_models_last_hidden_states_on_a_padded_batch(
    engine: str, bert: LoadedModel, tmp_path: Path
) -> None:
    graph = open_engine(engine, export_graph(engine, bert, cache_dir=tmp_path), threads=1)
    if isinstance(graph, OpenVinoEngine):  # fp32: the runtime's own cache of shapes (int8's is capped)
        assert "CPU_RUNTIME_CACHE_CAPACITY" not in graph.config
    batch = batch_from_ids([[5, 6, 7], [8, 9, 10, 11, 12, 13, 14], [15]], bert.tokenizer.pad_token_id)
    with torch.inference_mode():
        expected = adapter_for(bert).forward(batch)
    got = graph.forward(batch)
    assert got.shape == expected.shape and got.dtype == torch.float32
    for row, length in enumerate(batch.lengths):
        torch.testing.assert_close(got[row, :length], expected[row, :length], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("engine", GRAPH_ENGINES)
def test_forwards_run_at_once_on_a_graphs_streams_each_get_their_own_rows(
    engine: str, bert: LoadedModel, tmp_path: Path
) -> None:
    graph = open_engine(engine, export_graph(engine, bert, cache_dir=tmp_path), threads=2, streams=2)
    pad = bert.tokenizer.pad_token_id
    batches = [batch_from_ids([[5 + i + j for j in range(3 + 5 * i)]] * (1 + i % 3), pad) for i in range(8)]
    alone = [graph.forward(batch) for batch in batches]
    with ThreadPoolExecutor(2) as pool:  # two threads, each its own infer request or run, at once
        together = list(pool.map(graph.forward, batches))
    for one, other in zip(alone, together, strict=True):
        torch.testing.assert_close(one, other, atol=1e-6, rtol=0)
    with pytest.raises(ConfigError, match="streams within 1..threads, got 1 threads, 2 streams"):
        open_engine(engine, export_graph(engine, bert, cache_dir=tmp_path), threads=1, streams=2)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="mapped pages are read from /proc/self/smaps")
def test_an_openvino_graph_holds_none_of_its_weights_files_pages_once_compiled_or_given_back(
    bert: LoadedModel, tmp_path: Path
) -> None:
    graph = open_engine("openvino", export_graph("openvino", bert, cache_dir=tmp_path), threads=1)
    folder = graph.graph.parent
    assert resident_bytes(folder) == 0  # compiling read all of it: given back
    batch = batch_from_ids([[5, 6, 7], [8, 9, 10, 11, 12, 13, 14]], bert.tokenizer.pad_token_id)
    first = graph.forward(batch)
    assert resident_bytes(folder) > 0  # the embedding rows the forward read
    graph.drop_mapped_pages()
    assert resident_bytes(folder) == 0
    torch.testing.assert_close(graph.forward(batch), first, atol=0, rtol=0)  # read again, unchanged


_FIRST_FORWARDS_AT_ONCE = """
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from attnstore_client.adapters.batch import batch_from_ids
from attnstore_client.tiers.engines.runtimes import OpenVinoEngine, open_engine

graph = open_engine(sys.argv[1], Path(sys.argv[2]), threads=2, streams=2)
together = threading.Barrier(2)


def forward(first):
    together.wait()
    return tuple(graph.forward(batch_from_ids([[first, 6, 7, 8]] * 2, 0)).shape)


with ThreadPoolExecutor(2) as pool:
    print(list(pool.map(forward, [5, 9])))
"""


@pytest.mark.parametrize("engine", GRAPH_ENGINES)
def test_a_new_processs_first_forwards_on_a_graph_may_run_at_once(
    engine: str, bert: LoadedModel, tmp_path: Path
) -> None:
    # The runtimes' bindings set up their numpy conversions on first use; two threads there at once hung a
    # process (``GraphEngine._first_forward``). A child of its own: this process has run forwards already.
    graph = export_graph(engine, bert, cache_dir=tmp_path)
    child = subprocess.run([sys.executable, "-c", _FIRST_FORWARDS_AT_ONCE, engine, str(graph)], capture_output=True,
                           text=True, timeout=120, check=True)
    hidden = bert.model.config.hidden_size
    assert child.stdout.strip() == f"[(2, 4, {hidden}), (2, 4, {hidden})]"


def test_a_graph_is_exported_once_and_read_from_the_cache_after(bert: LoadedModel, tmp_path: Path) -> None:
    lines: list[str] = []
    first = export_graph("onnxruntime", bert, cache_dir=tmp_path, progress=lines.append)
    again = export_graph("onnxruntime", bert, cache_dir=tmp_path, progress=lines.append)
    assert first == again == graph_path("onnxruntime", bert, cache_dir=tmp_path) and first.is_file()
    assert len(lines) == 1 and "onnxruntime" in lines[0]
    assert not [path for path in first.parent.parent.iterdir() if path.name.startswith(".")]  # no scratch left


def test_another_models_weights_export_to_another_folder(bert: LoadedModel, tmp_path: Path) -> None:
    other = tiny_loaded("bert", seed=1)
    assert graph_path("openvino", bert, cache_dir=tmp_path) != graph_path("openvino", other, cache_dir=tmp_path)


def test_an_unknown_engine_is_refused_naming_the_engines(bert: LoadedModel, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="'tensorrt' is not one of"):
        export_graph("tensorrt", bert, cache_dir=tmp_path)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="'tensorrt' is not one of"):
        open_engine("tensorrt", tmp_path / "model.onnx", threads=1)  # type: ignore[arg-type]


def test_rows_with_token_types_are_refused_by_a_graph_that_takes_none(tmp_path: Path) -> None:
    distilbert = tiny_loaded("distilbert")  # takes no token types
    graph = open_engine("onnxruntime", export_graph("onnxruntime", distilbert, cache_dir=tmp_path), threads=1)
    assert not graph.takes_token_types
    batch = batch_from_ids([[5, 6, 7]], 0, token_types=[[0, 1, 1]])
    with pytest.raises(ConfigError, match="token types"):
        graph.forward(batch)


def test_the_nodes_engine_option_offers_every_engine() -> None:
    from attnstore_tools.node import ENGINES

    assert ENGINES == ENGINE_NAMES
