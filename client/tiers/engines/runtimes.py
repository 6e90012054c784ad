"""An exported graph (``graphs``) in its runtime, on the CPU: right-padded batches in, last hidden states out.

OpenVINO is compiled with ``threads`` inference threads, the latency hint and fp32 inference asked for (its CPU
default is bf16 where the CPU has it: not the model's rows). ONNX Runtime runs a CPU session of ``threads`` intra-op
threads and one inter-op thread at its default graph optimisations. Neither is thread-safe per request, so a
forward holds the engine's lock: forwards run side by side (``forward_pool``) take turns on a graph, each with all
its threads.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from pathlib import Path

import numpy as np
import torch

from attnstore.errors import ConfigError
from attnstore_client.adapters.batch import Batch
from attnstore_client.tiers.engines.graphs import GraphEngineName


class GraphEngine(ABC):
    """One graph in its runtime.

    Args:
        graph: the graph file (``export_graph``).
        threads: the runtime's threads (the torch threads the model's forwards use).
    """

    name: GraphEngineName

    def __init__(self, graph: Path, *, threads: int) -> None:
        if threads < 1:
            raise ConfigError(f"{type(self).__name__}(): threads must be >= 1, got {threads}")
        self.graph = graph
        self.threads = threads
        self._lock = threading.Lock()

    @property
    @abstractmethod
    def input_names(self) -> tuple[str, ...]:
        """The graph's inputs: ``input_ids``, ``attention_mask`` and, for a model that takes them,
        ``token_type_ids``."""

    @property
    def takes_token_types(self) -> bool:
        """Whether the graph is fed token types (a row with them cannot run on a graph that is not)."""
        return "token_type_ids" in self.input_names

    def forward(self, batch: Batch) -> torch.Tensor:
        """The last hidden states of ``batch``'s rows, ``(B, P, hidden)`` fp32 (pad positions: unread values)."""
        if batch.token_type_ids is not None and not self.takes_token_types:
            raise ConfigError(f"{self.name} graph {self.graph}: a row has token types and the graph takes none")
        types = batch.token_type_ids if batch.token_type_ids is not None else torch.zeros_like(batch.input_ids)
        given = {"input_ids": batch.input_ids, "attention_mask": batch.attention_mask, "token_type_ids": types}
        inputs = {name: given[name].cpu().numpy() for name in self.input_names}
        with self._lock:
            hidden = self._run(inputs)
        return torch.from_numpy(np.ascontiguousarray(hidden, dtype=np.float32))

    @abstractmethod
    def _run(self, inputs: dict[str, np.ndarray]) -> np.ndarray:
        """The graph's ``last_hidden_state``, its own array (not a buffer the next forward reuses)."""


class OpenVinoEngine(GraphEngine):
    """An OpenVINO graph compiled for the CPU."""

    name: GraphEngineName = "openvino"

    def __init__(self, graph: Path, *, threads: int) -> None:
        super().__init__(graph, threads=threads)
        import openvino

        config = {"INFERENCE_NUM_THREADS": threads, "PERFORMANCE_HINT": "LATENCY", "INFERENCE_PRECISION_HINT": "f32"}
        self._compiled = openvino.Core().compile_model(str(graph), "CPU", config)
        self._inputs = tuple(port.get_any_name() for port in self._compiled.inputs)
        self._request = self._compiled.create_infer_request()

    @property
    def input_names(self) -> tuple[str, ...]:
        return self._inputs

    def _run(self, inputs: dict[str, np.ndarray]) -> np.ndarray:
        return self._request.infer(inputs)[0].copy()  # the request's buffer is reused by the next forward


class OnnxRuntimeEngine(GraphEngine):
    """An ONNX graph in an ONNX Runtime CPU session."""

    name: GraphEngineName = "onnxruntime"

    def __init__(self, graph: Path, *, threads: int) -> None:
        super().__init__(graph, threads=threads)
        import onnxruntime

        options = onnxruntime.SessionOptions()
        options.intra_op_num_threads = threads
        options.inter_op_num_threads = 1
        self._session = onnxruntime.InferenceSession(str(graph), options, providers=["CPUExecutionProvider"])
        self._inputs = tuple(node.name for node in self._session.get_inputs())

    @property
    def input_names(self) -> tuple[str, ...]:
        return self._inputs

    def _run(self, inputs: dict[str, np.ndarray]) -> np.ndarray:
        return self._session.run(["last_hidden_state"], inputs)[0]


def open_engine(name: GraphEngineName, graph: Path, *, threads: int) -> GraphEngine:
    """The engine ``name`` on ``graph``.

    Raises:
        ConfigError: an unknown engine, or threads < 1.
    """
    engines: dict[str, type[GraphEngine]] = {"openvino": OpenVinoEngine, "onnxruntime": OnnxRuntimeEngine}
    if name not in engines:
        raise ConfigError(f"engine {name!r} is not one of {sorted(engines)}")
    return engines[name](graph, threads=threads)
