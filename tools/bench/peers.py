"""The peers users run instead of us, as the benches run them: ONNX Runtime (fp32, O3, int8) and OpenVINO.

A ``Peer`` runs one exported graph (``peers_export``) in place of the model's transformer and keeps the rest of
its sentence-transformers pipeline: the same tokenisation (``preprocess``, ``max_seq_length``), then the
pipeline's own modules after the transformer on the graph's ``last_hidden_state`` (for all-MiniLM-L6-v2 mean
pooling and normalisation), as sentence-transformers' ``backend="onnx"`` and ``backend="openvino"`` do. ``encode``
sorts the texts by length, longest first, encodes them in batches of ``batch_size`` and returns the vectors in
input order, as ``SentenceTransformer.encode`` does.

    peer = load_peer("onnx_o3", "minilm", threads=2)
    vectors = peer.encode(texts, batch_size=32)  # (N, 384) float32

A bench child builds its peer with ``open_peer`` on a pipeline whose transformer weights were never read
(``weightless_pipeline``), so its peak memory is the runtime's and the graph's, not the torch model's too.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from attnstore.errors import ConfigError
from attnstore_client.models import load_model, resolve_model_path
from attnstore_tools.bench.peers_export import PEERS, PeerName, check_peer, export_graph

if TYPE_CHECKING:
    from sentence_transformers import SentenceTransformer

logger = logging.getLogger(__name__)

__all__ = ["PEERS", "OnnxRuntimePeer", "OpenVinoPeer", "Peer", "PeerName", "load_peer", "open_peer",
           "weightless_pipeline"]


class Peer(ABC):
    """One peer: a graph in place of the pipeline's transformer, the pipeline's other modules after it.

    Args:
        name: the peer (one of ``PEERS``).
        graph: its exported graph file.
        pipeline: the model's sentence-transformers pipeline (its transformer's weights are not used).
        threads: the runtime's intra-op threads (the bench's ``--threads``).
    """

    def __init__(self, name: PeerName, graph: Path, pipeline: SentenceTransformer, *, threads: int) -> None:
        if threads < 1:
            raise ConfigError(f"{type(self).__name__}(): threads must be >= 1, got {threads}")
        self.name = name
        self.graph = graph
        self.threads = threads
        self._pipeline = pipeline
        self._head = list(pipeline)[1:]  # the modules after the transformer: pooling, normalisation...

    def encode(self, texts: Sequence[str], batch_size: int = 32) -> np.ndarray:
        """The texts' embeddings, ``(len(texts), dim)`` float32 in input order.

        Raises:
            ConfigError: ``batch_size`` < 1.
        """
        if batch_size < 1:
            raise ConfigError(f"{type(self).__name__}.encode(): batch_size must be >= 1, got {batch_size}")
        order = np.argsort([-len(text) for text in texts], kind="stable")  # longest first: less padding
        parts = []
        for start in range(0, len(texts), batch_size):
            parts.append(self._encode_batch([texts[i] for i in order[start : start + batch_size]]))
        if not parts:
            return np.zeros((0, self._pipeline.get_embedding_dimension() or 0), dtype=np.float32)
        vectors = np.concatenate(parts)
        out = np.empty_like(vectors)
        out[order] = vectors
        return out

    def _encode_batch(self, texts: list[str]) -> np.ndarray:
        features: dict[str, Any] = dict(self._pipeline.preprocess(texts))
        inputs = {key: features[key].numpy() for key in self.input_names}
        hidden = self._forward(inputs)  # (B, T, hidden)
        features["token_embeddings"] = torch.from_numpy(np.ascontiguousarray(hidden, dtype=np.float32))
        with torch.inference_mode():
            for module in self._head:
                features = module(features)
        return features["sentence_embedding"].numpy()  # (B, dim)

    @property
    @abstractmethod
    def input_names(self) -> list[str]:
        """The graph's inputs, a subset of what the tokenizer gives."""

    @abstractmethod
    def _forward(self, inputs: dict[str, np.ndarray]) -> np.ndarray:
        """The graph's ``last_hidden_state`` for one batch, ``(B, T, hidden)``."""


class OnnxRuntimePeer(Peer):
    """An ONNX graph in an ONNX Runtime CPU session: ``threads`` intra-op threads, one inter-op thread, ONNX
    Runtime's default graph optimisations (what sentence-transformers' ``backend="onnx"`` runs)."""

    def __init__(self, name: PeerName, graph: Path, pipeline: SentenceTransformer, *, threads: int) -> None:
        super().__init__(name, graph, pipeline, threads=threads)
        import onnxruntime

        options = onnxruntime.SessionOptions()
        options.intra_op_num_threads = threads
        options.inter_op_num_threads = 1
        self._session = onnxruntime.InferenceSession(str(graph), options, providers=["CPUExecutionProvider"])
        self._inputs = [i.name for i in self._session.get_inputs()]

    @property
    def input_names(self) -> list[str]:
        return self._inputs

    def _forward(self, inputs: dict[str, np.ndarray]) -> np.ndarray:
        return self._session.run(["last_hidden_state"], inputs)[0]


class OpenVinoPeer(Peer):
    """An OpenVINO model compiled for the CPU: ``threads`` inference threads, the latency hint optimum-intel sets,
    and fp32 inference asked for (OpenVINO's CPU default is bf16 where the CPU has it, AVX-512 BF16 or AMX)."""

    def __init__(self, name: PeerName, graph: Path, pipeline: SentenceTransformer, *, threads: int) -> None:
        super().__init__(name, graph, pipeline, threads=threads)
        import openvino

        config = {"INFERENCE_NUM_THREADS": threads, "PERFORMANCE_HINT": "LATENCY", "INFERENCE_PRECISION_HINT": "f32"}
        self._compiled = openvino.Core().compile_model(str(graph), "CPU", config)
        self._inputs = [i.get_any_name() for i in self._compiled.inputs]
        self._request = self._compiled.create_infer_request()

    @property
    def input_names(self) -> list[str]:
        return self._inputs

    def _forward(self, inputs: dict[str, np.ndarray]) -> np.ndarray:
        return self._request.infer(inputs)[0].copy()  # the request's buffer is reused by the next batch


def open_peer(name: str, graph: Path, pipeline: SentenceTransformer, *, threads: int) -> Peer:
    """The peer ``name`` on an exported ``graph`` (``peers_export.export_graph``).

    Raises:
        ConfigError: an unknown peer, or threads < 1.
    """
    peer = check_peer(name)
    cls = OpenVinoPeer if peer == "openvino_fp32" else OnnxRuntimePeer
    return cls(peer, graph, pipeline, threads=threads)


def load_peer(name: str, model: str = "minilm", *, threads: int = 2, cache_dir: Path | None = None) -> Peer:
    """The peer ``name`` of ``model`` (an alias or a local sentence-transformers folder), its graph exported on
    first use (see ``peers_export``).

    Raises:
        ConfigError: an unknown peer or model, a model without a sentence-transformers configuration, or the
            ``peers`` extra not installed.
    """
    loaded = load_model(model)
    graph = export_graph(name, loaded, cache_dir=cache_dir)
    assert loaded.sentence_transformer is not None  # export_graph refuses a model without one
    return open_peer(name, graph, loaded.sentence_transformer, threads=threads)


def weightless_pipeline(model: str) -> SentenceTransformer:
    """``model``'s sentence-transformers pipeline with its transformer's weights left unread (on the meta
    device): the tokenizer and the modules after the transformer, which is all a peer uses of it.

    Raises:
        ConfigError: an unknown model, or one without a sentence-transformers configuration.
    """
    from sentence_transformers import SentenceTransformer

    folder = resolve_model_path(model)
    if not (folder / "modules.json").is_file():
        raise ConfigError(f"peers: model {model!r} has no sentence-transformers configuration (modules.json)")
    pipeline = SentenceTransformer(str(folder), local_files_only=True, model_kwargs={"device_map": "meta"})
    return pipeline.eval()

