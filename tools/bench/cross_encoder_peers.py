"""The peers (``bench.peers``: ONNX Runtime, OpenVINO) as a cross-encoder's users run them: the exported graph of
its base transformer, then the cross-encoder's own head (BERT's pooler and classifier) in torch.

A ``*ForSequenceClassification`` folder's base model (``LoadedModel.model``, a ``BertModel`` for
ms-marco-MiniLM-L6-v2's shape) is exported as ``peers_export`` exports a sentence-transformers model's
transformer (the same graphs, kept in the same cache, keyed by the base model's fingerprint); a pair is
tokenized as ``CrossEncoder`` tokenizes it (the two texts as a text pair, ``longest_first`` to the
model's limit, token types included: BERT's embeddings add them, so the graph must take them as an
input, which ``open_pair_peer`` checks), the graph gives the last hidden states and the model's head,
through ``SequenceClassifier``, the logits. ``PairPipeline`` is the pipeline ``Peer`` runs: the graph
in place of its first module, the head after it, so the runtimes are set up exactly as ``bench node``'s.

    graphs = pair_graphs(loaded, ["onnx_o3"], cache_dir)
    peer = open_pair_peer("onnx_o3", graphs["onnx_o3"], loaded, threads=2)
    logits = pair_logits(peer, [("a query", "a passage"), ...])  # (n, num_labels) float32
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch
from torch import nn

from attnstore.errors import ConfigError
from attnstore_client.classifier import SequenceClassifier
from attnstore_client.models import LoadedModel
from attnstore_client.sentence.cross_encoder import classifier_of, max_pair_length
from attnstore_tools.bench.peers import Peer, open_peer
from attnstore_tools.bench.peers_export import PeerName, export_graph

Pair = tuple[str, str]
BATCH = 32  # pairs per forward, as CrossEncoder.predict's default batch_size


class _Logits(nn.Module):
    """The cross-encoder's head as a pipeline module: the graph's states (``token_embeddings``) to its logits
    (``sentence_embedding``, the key ``Peer`` reads)."""

    def __init__(self, classifier: SequenceClassifier) -> None:
        super().__init__()
        self.classifier = classifier

    def forward(self, features: dict[str, Any]) -> dict[str, Any]:
        states = features["token_embeddings"]  # (B, T, hidden)
        features["sentence_embedding"] = self.classifier(states, features["input_ids"],
                                                         features["attention_mask"])  # (B, num_labels)
        return features


class PairPipeline(nn.Sequential):
    """What ``Peer`` runs for a cross-encoder: pairs tokenized as ``CrossEncoder`` tokenizes them, a stand-in for
    the transformer (the graph runs instead) and the model's head.

    Args:
        loaded: the cross-encoder (``load_model`` of a ``*ForSequenceClassification`` folder).

    Raises:
        UnsupportedModelError: the model has no classifier head.
    """

    def __init__(self, loaded: LoadedModel) -> None:
        classifier = classifier_of(loaded, "PairPipeline()")
        super().__init__(nn.Identity(), _Logits(classifier))
        self.tokenizer = loaded.tokenizer
        self.max_length = max_pair_length(classifier, int(loaded.tokenizer.model_max_length))

    def preprocess(self, inputs: Sequence[Pair | str]) -> dict[str, torch.Tensor]:
        """The batch's features: pairs as text pairs (a lone text, as the export's examples are, alone), padded."""
        pairs = [(item, None) if isinstance(item, str) else item for item in inputs]
        seconds = [second for _, second in pairs]
        encoded = self.tokenizer([first for first, _ in pairs], None if None in seconds else seconds, padding=True,
                                 truncation="longest_first", max_length=self.max_length, return_tensors="pt")
        return dict(encoded)


def pair_graphs(loaded: LoadedModel, peers: Sequence[PeerName], cache_dir: Path) -> dict[PeerName, Path]:
    """Each peer's exported graph of the cross-encoder's base model, exported once into ``cache_dir`` (progress
    lines on stderr, as ``bench.encode.peer_graphs``'s).

    Raises:
        ConfigError: an unknown peer, or the ``peers`` extra not installed.
        UnsupportedModelError: the model has no classifier head.
    """

    def progress(line: str) -> None:
        print(f"bench rerank: {line}", file=sys.stderr, flush=True)

    # export_graph reads the pipeline for its two example inputs only: the pair pipeline tokenizes them.
    shim = dataclasses.replace(loaded, sentence_transformer=cast(Any, PairPipeline(loaded)))
    return {peer: export_graph(peer, shim, cache_dir=cache_dir, progress=progress) for peer in peers}


def open_pair_peer(name: str, graph: Path, loaded: LoadedModel, *, threads: int) -> Peer:
    """The peer ``name`` on the cross-encoder's exported base ``graph``, its head after it.

    Raises:
        ConfigError: an unknown peer, threads < 1, or a graph without ``token_type_ids`` for a model whose
            embeddings take token types (a pair's second text would be read as its first).
        UnsupportedModelError: the model has no classifier head.
    """
    peer = open_peer(name, graph, cast(Any, PairPipeline(loaded)), threads=threads)
    types = int(getattr(loaded.model.config, "type_vocab_size", 0) or 0) > 1
    if types and "token_type_ids" not in peer.input_names:
        raise ConfigError(f"{name}: graph {graph} takes {peer.input_names}, not token_type_ids, which a pair of"
                          f" {loaded.name!r} needs")
    return peer


def pair_logits(peer: Peer, pairs: Sequence[Pair]) -> np.ndarray:
    """The pairs' logits ``(n, num_labels)`` float32 in input order, longest pairs first in batches of ``BATCH``
    (as ``CrossEncoder.predict`` sorts them; ``Peer.encode`` keeps an order it cannot measure)."""
    order = np.argsort([-(len(query) + len(document)) for query, document in pairs], kind="stable")
    logits = peer.encode(cast(Any, [pairs[i] for i in order]), batch_size=BATCH)  # (n, labels), sorted
    out = np.empty_like(logits)
    out[order] = logits
    return out
