"""An exported graph (``graphs``) in its runtime, on the CPU: right-padded batches in, last hidden states out.

Forwards run side by side as torch's do (``forward_pool``): ``streams`` at once, each on its share of ``threads``.
OpenVINO is compiled with ``threads`` inference threads in ``streams`` streams and fp32 inference asked for (its CPU
default is bf16 where the CPU has it: not the model's rows); each thread that runs a forward has its own infer
request (a request is not thread-safe; the compiled model runs one per stream at once). ONNX Runtime runs one CPU
session of ``threads / streams`` intra-op threads at its default graph optimisations, whose ``run`` several threads
may call at once.

OpenVINO maps its weights file and reads all of it as it compiles: its CPU plugin keeps its own copy of the
linear layers' weights and reads the file again only for the embedding rows of the tokens a forward sees. The
file's pages it read stay in the process's resident memory (86 MiB for all-MiniLM-L6-v2) until given back
(``GraphEngine.drop_mapped_pages``, ``attnstore.protocol.mapped_pages``): after the compile, and after each
window's forwards (``EngineSelection.drop_mapped_pages``).
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType

import numpy as np
import torch

from attnstore.errors import ConfigError
from attnstore.protocol.mapped_pages import drop_mapped_pages
from attnstore_client.adapters.batch import Batch
from attnstore_client.tiers.engines.graphs import GraphEngineName

# Batch shapes an int8 OpenVINO graph keeps its runtime state for (OpenVINO's default: 5,000). It keeps about 1 MiB
# for each new shape: 16 held 196 MiB over 166 shapes instead of 247, and the logs call ran as fast
# (docs/BENCHMARKS.md, "Engines").
INT8_RUNTIME_CACHE = 16


class GraphEngine(ABC):
    """One graph in its runtime.

    Args:
        graph: the graph file (``export_graph``).
        threads: the runtime's threads (the torch threads the model's forwards use).
        streams: forwards run at once (``TierContext.side_by_side``), each on ``threads / streams`` threads.
    """

    name: GraphEngineName

    def __init__(self, graph: Path, *, threads: int, streams: int = 1) -> None:
        if threads < 1 or not 1 <= streams <= threads:
            raise ConfigError(f"{type(self).__name__}(): threads must be >= 1 and streams within 1..threads, got"
                              f" {threads} threads, {streams} streams")
        self.graph = graph
        self.threads = threads
        self.streams = streams

    @property
    @abstractmethod
    def input_names(self) -> tuple[str, ...]:
        """The graph's inputs: ``input_ids``, ``attention_mask`` and, for a model that takes them,
        ``token_type_ids``."""

    @property
    def takes_token_types(self) -> bool:
        """Whether the graph is fed token types (a row with them cannot run on a graph that is not)."""
        return "token_type_ids" in self.input_names

    def drop_mapped_pages(self) -> None:
        """Give back this process's resident pages of the graph's files a runtime mapped (none for a runtime
        that reads them into its own memory); the pages a later forward reads are mapped again, unchanged."""
        drop_mapped_pages(self.graph.parent)

    def forward(self, batch: Batch) -> torch.Tensor:
        """The last hidden states of ``batch``'s rows, ``(B, P, hidden)`` fp32 (pad positions: unread values)."""
        if batch.token_type_ids is not None and not self.takes_token_types:
            raise ConfigError(f"{self.name} graph {self.graph}: a row has token types and the graph takes none")
        types = batch.token_type_ids if batch.token_type_ids is not None else torch.zeros_like(batch.input_ids)
        given = {"input_ids": batch.input_ids, "attention_mask": batch.attention_mask, "token_type_ids": types}
        inputs = {name: given[name].cpu().numpy() for name in self.input_names}
        hidden = self._run(inputs)
        return torch.from_numpy(np.ascontiguousarray(hidden, dtype=np.float32))

    @abstractmethod
    def _run(self, inputs: dict[str, np.ndarray]) -> np.ndarray:
        """The graph's ``last_hidden_state``, its own array (not a buffer the next forward reuses)."""

    def _first_forward(self) -> None:
        """One forward of one token, on the thread that opened the graph. The runtimes' bindings (pybind11) set up
        their numpy conversions on first use, and two threads meeting there at once can deadlock on the GIL: a
        process whose first forwards ran side by side hung in it (OpenVINO 2026.4). After this one they never
        run again."""
        one = np.zeros((1, 1), dtype=np.int64)
        self._run({name: np.ones_like(one) if name == "attention_mask" else one for name in self.input_names})


class OpenVinoEngine(GraphEngine):
    """An OpenVINO graph compiled for the CPU; ``dynamic_group``: an int8 graph's activations quantised per that
    many values as it runs (``engines.int8``)."""

    name: GraphEngineName = "openvino"

    def __init__(self, graph: Path, *, threads: int, streams: int = 1, dynamic_group: int = 0) -> None:
        super().__init__(graph, threads=threads, streams=streams)
        import openvino

        config: dict[str, int | str] = {
            "INFERENCE_NUM_THREADS": threads, "NUM_STREAMS": streams, "INFERENCE_PRECISION_HINT": "f32",
            "DYNAMIC_QUANTIZATION_GROUP_SIZE": dynamic_group}
        if dynamic_group:
            config["CPU_RUNTIME_CACHE_CAPACITY"] = INT8_RUNTIME_CACHE
        self.config: Mapping[str, int | str] = MappingProxyType(config)  # what the graph was compiled with
        self._compiled = openvino.Core().compile_model(str(graph), "CPU", config)
        self._inputs = tuple(port.get_any_name() for port in self._compiled.inputs)
        self._requests = threading.local()  # each forwarding thread's own request
        self._first_forward()
        self.drop_mapped_pages()  # compiling read every weight; the plugin keeps its own copy of most

    @property
    def input_names(self) -> tuple[str, ...]:
        return self._inputs

    def _run(self, inputs: dict[str, np.ndarray]) -> np.ndarray:
        request = getattr(self._requests, "request", None)
        if request is None:
            request = self._requests.request = self._compiled.create_infer_request()
        return request.infer(inputs)[0].copy()  # the request's buffer is reused by its next forward


class OnnxRuntimeEngine(GraphEngine):
    """An ONNX graph in an ONNX Runtime CPU session."""

    name: GraphEngineName = "onnxruntime"

    def __init__(self, graph: Path, *, threads: int, streams: int = 1) -> None:
        super().__init__(graph, threads=threads, streams=streams)
        import onnxruntime

        options = onnxruntime.SessionOptions()
        options.intra_op_num_threads = threads // streams
        options.inter_op_num_threads = 1
        self._session = onnxruntime.InferenceSession(str(graph), options, providers=["CPUExecutionProvider"])
        self._inputs = tuple(node.name for node in self._session.get_inputs())
        self._first_forward()

    @property
    def input_names(self) -> tuple[str, ...]:
        return self._inputs

    def _run(self, inputs: dict[str, np.ndarray]) -> np.ndarray:
        return self._session.run(["last_hidden_state"], inputs)[0]


def open_engine(name: GraphEngineName, graph: Path, *, threads: int, streams: int = 1) -> GraphEngine:
    """The engine ``name`` on ``graph``, running ``streams`` forwards at once on ``threads`` threads.

    Raises:
        ConfigError: an unknown engine, threads < 1, or streams outside 1..threads.
    """
    engines: dict[str, type[GraphEngine]] = {"openvino": OpenVinoEngine, "onnxruntime": OnnxRuntimeEngine}
    if name not in engines:
        raise ConfigError(f"engine {name!r} is not one of {sorted(engines)}")
    return engines[name](graph, threads=threads, streams=streams)
