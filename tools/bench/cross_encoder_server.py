"""The cross-encoder baseline servers of ``attnstore bench rerank``: the node's own HTTP app (``/v1/rerank``,
``/rerank``, ``/predict``...), each request's (query, document) pairs scored one request at a time by

- ``plain``: sentence-transformers' ``CrossEncoder.predict`` (batches of 32, longest pairs first);
- ``cached``: the same with a dict of pair -> logits in front;
- ``<peer>_dict`` (``onnx_fp32_dict``, ``onnx_o3_dict``, ``openvino_dict``...): a dict of pair -> logits in front
  of a peer (``bench.cross_encoder_peers``): the base transformer's exported graph in ONNX Runtime or OpenVINO,
  then the cross-encoder's own head in torch.

    python -m attnstore_tools.bench.cross_encoder_server --method plain|cached|onnx_o3_dict --model FOLDER \
        --listen 127.0.0.1:0 --ready-file F [--graph GRAPH.onnx] [--threads 2]

Every server answers with the model's own activation as ``CrossEncoder`` chooses it (the one its folder saved,
else Sigmoid for one label), or the logits when a request asks for raw scores. Requests run one after another on
one worker thread, as torch and the runtimes run best on these cores.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from attnstore_node.engine import Embedded, Embedder
from attnstore_node.errors import bad_request
from attnstore_node.schema import Activation, Input, ModelInfo

log = logging.getLogger(__name__)

Pair = tuple[str, str]
_WARMUP = [("a warm-up query", "a warm-up passage of a few more words")] * 4


class CrossEncoderEmbedder(Embedder):
    """Each request's pairs through ``CrossEncoder.predict`` or a peer, one request at a time; with ``cached``, a
    dict of pair -> logits in front.

    Args:
        model: a cross-encoder folder (a ``*ForSequenceClassification`` model, or a ``CrossEncoder`` one).
        cached: keep each pair's logits and answer repeats from them.
        threads: torch threads (a peer's runtime threads too).
        peer: a peer (``bench.peers.PEERS``) that runs the base transformer instead of torch, on ``graph``.
        graph: the peer's exported graph of the base model (``cross_encoder_peers.pair_graphs``).

    Raises:
        ValueError: ``peer`` without ``graph`` or the other way round.
    """

    def __init__(self, model: str, cached: bool, threads: int, *, peer: str | None = None,
                 graph: Path | None = None) -> None:
        if (peer is None) != (graph is None):
            raise ValueError(f"CrossEncoderEmbedder(): peer and graph go together, got peer={peer!r}, graph={graph!r}")
        self._name = model
        self._cache: dict[Pair, np.ndarray] | None = {} if cached else None
        self._threads = threads
        self._peer = peer
        self._graph = graph
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="cross-encoder")
        self._info: ModelInfo | None = None
        self._failure: BaseException | None = None
        self._logits: Callable[[list[Pair]], np.ndarray] | None = None  # pairs -> (n, labels) float32
        self._activation: Callable[[np.ndarray], np.ndarray] | None = None
        self._tokenizer: Any = None

    @property
    def info(self) -> ModelInfo | None:
        """See :meth:`Embedder.info`."""
        return self._info

    @property
    def failure(self) -> BaseException | None:
        """See :meth:`Embedder.failure`."""
        return self._failure

    def start(self) -> None:
        """See :meth:`Embedder.start`: loads on the worker thread."""
        self._pool.submit(self._load)

    def _load(self) -> None:
        try:
            import torch

            torch.set_num_threads(self._threads)
            if self._peer is None:
                self._load_cross_encoder()
            else:
                self._load_peer()
            assert self._logits is not None
            self._logits(list(_WARMUP))
        except BaseException as exc:
            log.exception("event=load_failed")
            self._failure = exc

    def _load_cross_encoder(self) -> None:
        import torch
        from sentence_transformers import CrossEncoder

        model = CrossEncoder(self._name, local_files_only=True, device="cpu")
        identity = torch.nn.Identity()
        self._logits = lambda pairs: np.asarray(model.predict(
            pairs, batch_size=32, activation_fn=identity, convert_to_numpy=True, show_progress_bar=False),
            np.float32).reshape(len(pairs), -1)
        activation = model.activation_fn
        self._activation = lambda logits: _through(activation, logits)
        self._tokenizer = model.tokenizer
        config = model.model.config if model.model is not None else None
        labels = int(model.num_labels)
        names = dict(getattr(config, "id2label", None) or {})
        self._info = ModelInfo(self._name, int(getattr(config, "hidden_size", 0)), int(model.tokenizer.vocab_size),
                               int(model.max_seq_length or model.tokenizer.model_max_length),
                               classes=tuple(str(names.get(k, f"LABEL_{k}")) for k in range(labels)))

    def _load_peer(self) -> None:
        from attnstore_client.models import load_model
        from attnstore_client.sentence.cross_encoder import classifier_of, default_activation
        from attnstore_tools.bench.cross_encoder_peers import open_pair_peer, pair_logits

        assert self._peer is not None and self._graph is not None
        loaded = load_model(self._name)
        classifier = classifier_of(loaded, "bench rerank")
        peer = open_pair_peer(self._peer, self._graph, loaded, threads=self._threads)
        self._logits = lambda pairs: pair_logits(peer, pairs)
        activation = default_activation(classifier)
        self._activation = lambda logits: _through(activation, logits)
        self._tokenizer = loaded.tokenizer
        config = loaded.model.config
        names = dict(classifier.model.config.id2label or {})
        self._info = ModelInfo(self._name, int(config.hidden_size), int(config.vocab_size),
                               int(loaded.tokenizer.model_max_length),
                               classes=tuple(str(names.get(k, f"LABEL_{k}")) for k in range(classifier.num_labels)))

    def stop(self) -> None:
        """See :meth:`Embedder.stop`."""
        self._pool.shutdown(wait=True)

    async def embed(self, inputs: Sequence[Input], *, truncate: bool, max_input_tokens: int,
                    prompt_name: str | None = None) -> Embedded:
        """See :meth:`Embedder.embed`: this baseline only scores pairs."""
        raise bad_request("this baseline server only scores (query, document) pairs", "unsupported_route")

    async def classify(self, inputs: Sequence[Input | tuple[str, str]], *, activation: Activation | None,
                       truncate: bool, max_input_tokens: int) -> Embedded:
        """See :meth:`Embedder.classify`: pairs only, through the model's own activation (``"model"``) or none
        (the logits); the pairs are cut to the model's limit as ``CrossEncoder`` cuts them, whatever ``truncate``."""
        pairs = [item for item in inputs if isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str)]
        if len(pairs) != len(inputs):
            raise bad_request("this baseline server takes (query, document) pairs only", "invalid_input", "inputs")
        if activation not in (None, "model"):
            raise bad_request(f"this baseline server applies the model's own activation or none, not {activation!r}",
                              "invalid_input")
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, self._classify, [(str(a), str(b)) for a, b in pairs],
                                          activation)

    def _classify(self, pairs: list[Pair], activation: Activation | None) -> Embedded:
        assert self._logits is not None and self._activation is not None
        if self._cache is None:
            logits = self._logits(pairs)  # (n, labels)
        else:
            cache = self._cache
            misses = list(dict.fromkeys(pair for pair in pairs if pair not in cache))
            if misses:
                for pair, row in zip(misses, self._logits(misses), strict=True):
                    cache[pair] = row
            logits = np.stack([cache[pair] for pair in pairs])  # (n, labels)
        scores = logits if activation is None else self._activation(logits)
        tokens = sum(len(ids) for ids in self._tokenizer([a for a, _ in pairs], [b for _, b in pairs],
                                                         truncation="longest_first")["input_ids"])
        return Embedded(np.asarray(scores, np.float32), tokens)


def _through(activation: Callable[..., Any], logits: np.ndarray) -> np.ndarray:
    """``activation`` (a torch module) on numpy logits ``(n, labels)``."""
    import torch

    with torch.inference_mode():
        return np.asarray(activation(torch.from_numpy(logits)).float().numpy(), np.float32)


def main(argv: Sequence[str] | None = None) -> int:
    """Run one baseline server until SIGTERM; returns its exit code."""
    from attnstore_tools.bench.encode import peer_method

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--method", required=True, help="plain, cached or <peer>_dict (onnx_o3_dict...)")
    parser.add_argument("--model", required=True, help="a cross-encoder folder")
    parser.add_argument("--listen", default="127.0.0.1:0")
    parser.add_argument("--ready-file", type=Path, required=True)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--graph", type=Path, help="a peer method's exported graph of the base model")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    peer = peer_method(args.method) if args.method.endswith("_dict") else None
    if args.method not in ("plain", "cached") and peer is None:
        parser.error(f"--method {args.method!r}: one of plain, cached or <peer>_dict")
    if (peer is None) != (args.graph is None):
        parser.error("a <peer>_dict method takes --graph, and only it")
    from attnstore_node.app import create_app
    from attnstore_node.server import bind, serve

    embedder = CrossEncoderEmbedder(args.model, args.method != "plain", args.threads, peer=peer, graph=args.graph)
    return serve(create_app(embedder), bind(args.listen), ready_file=args.ready_file)


if __name__ == "__main__":
    raise SystemExit(main())
