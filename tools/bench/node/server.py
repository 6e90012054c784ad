"""The baseline servers of ``attnstore bench node``: the node's own HTTP app, each request through
``SentenceTransformer.encode`` or a peer's ``encode`` (``bench.peers``: ONNX Runtime, OpenVINO), with a dict cache
in front for ``dict``, one request at a time.

    python -m attnstore_tools.bench.node.server --method encode|dict --model minilm --listen 127.0.0.1:0 \
        --ready-file F [--stored TEXTS.json --stored-embeddings EMBEDDINGS.npy] [--threads 2] \
        [--peer onnx_o3 --graph GRAPH.onnx]

The HTTP layer (routes, validation, keys, metrics, drain) is ``attnstore_node``'s,
so the servers of the benchmark differ only in how a request's vectors are
made. ``encode`` runs each request's texts in one ``encode`` call; ``dict`` looks
each text up in a dict (holding the stored texts' embeddings at start, as the
node's store holds them) and encodes the misses in one call, keeping them.
With ``--peer``, that call is the peer's on its exported ``--graph`` (the
pipeline's transformer weights left unread), else sentence-transformers'.
Requests are encoded one after another on one worker thread, as torch runs
best on these cores (concurrent calls would split the same threads).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from attnstore_node.engine import Embedded, Embedder
from attnstore_node.errors import bad_request
from attnstore_node.schema import Input, ModelInfo

log = logging.getLogger(__name__)


class EncodeEmbedder(Embedder):
    """Each request's texts through ``SentenceTransformer.encode`` (or a peer's ``encode``), one request at a time;
    with ``cache``, a dict of text -> (vector, tokens) in front.

    Args:
        model: a sentence-transformers model alias or folder.
        cache: the dict's first contents (None: no dict).
        threads: torch threads (a peer's runtime threads too).
        peer: a peer (``bench.peers.PEERS``) that encodes instead of sentence-transformers, on ``graph``.
        graph: the peer's exported graph (``peers_export.export_graph``).
    """

    def __init__(self, model: str, cache: dict[str, tuple[np.ndarray, int]] | None, threads: int, *,
                 peer: str | None = None, graph: Path | None = None) -> None:
        if (peer is None) != (graph is None):
            raise ValueError(f"EncodeEmbedder(): peer and graph go together, got peer={peer!r}, graph={graph!r}")
        self._model_name = model
        self._cache = cache
        self._threads = threads
        self._peer = peer
        self._graph = graph
        self._encoder: Callable[[list[str]], np.ndarray] | None = None
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="encode")
        self._info: ModelInfo | None = None
        self._failure: BaseException | None = None
        self._model: Any = None

    @property
    def info(self) -> ModelInfo | None:
        """See :meth:`Embedder.info`."""
        return self._info

    @property
    def failure(self) -> BaseException | None:
        """See :meth:`Embedder.failure`."""
        return self._failure

    def start(self) -> None:
        """See :meth:`Embedder.start`."""
        self._pool.submit(self._load)

    def _load(self) -> None:
        try:
            import torch

            from attnstore_client.models import load_model

            torch.set_num_threads(self._threads)
            if self._peer is not None:
                from attnstore_tools.bench.peers import open_peer, weightless_pipeline

                assert self._graph is not None
                model = weightless_pipeline(self._model_name)
                peer = open_peer(self._peer, self._graph, model, threads=self._threads)
                self._encoder = lambda texts: peer.encode(texts, batch_size=32)
            else:
                model = load_model(self._model_name).sentence_transformer
                if model is None:
                    raise ValueError(f"{self._model_name!r} has no sentence-transformers configuration")
                st = model
                self._encoder = lambda texts: st.encode(texts, batch_size=32, show_progress_bar=False)
            self._encoder(["warm up"] * 4)
            if self._cache:  # the stored texts' tokens, for their usage
                texts = list(self._cache)
                for text, length in zip(texts, _lengths(model, texts), strict=True):
                    self._cache[text] = (self._cache[text][0], length)
            self._model = model
            self._info = ModelInfo(self._model_name, int(model.get_embedding_dimension()),
                                   int(model.tokenizer.vocab_size), int(model.max_seq_length))
        except BaseException as exc:
            log.exception("event=load_failed")
            self._failure = exc

    def stop(self) -> None:
        """See :meth:`Embedder.stop`."""
        self._pool.shutdown(wait=True)

    async def embed(self, inputs: Sequence[Input], *, truncate: bool, max_input_tokens: int,
                    prompt_name: str | None = None) -> Embedded:
        """See :meth:`Embedder.embed`: texts only (``encode`` takes no token ids); its model names no prompts, so no
        ``prompt_name`` reaches it."""
        texts = [item for item in inputs if isinstance(item, str)]
        if len(texts) != len(inputs):
            raise bad_request("this baseline server takes texts only", "invalid_input", "input")
        return await asyncio.get_running_loop().run_in_executor(self._pool, self._encode, texts)

    def _encode(self, texts: list[str]) -> Embedded:
        model, cache, encoder = self._model, self._cache, self._encoder
        assert encoder is not None
        if cache is None:
            return Embedded(np.asarray(encoder(texts), np.float32), _tokens(model, texts))
        misses = list(dict.fromkeys(text for text in texts if text not in cache))
        if misses:
            computed = encoder(misses)
            lengths = _lengths(model, misses)
            for text, vector, length in zip(misses, computed, lengths, strict=True):
                cache[text] = (np.asarray(vector, np.float32), length)
        hits = [cache[text] for text in texts]
        return Embedded(np.stack([vector for vector, _ in hits]), sum(length for _, length in hits))


def _lengths(model: Any, texts: list[str]) -> list[int]:
    """Each text's tokens as ``encode`` truncates them (``usage``)."""
    ids = model.tokenizer(texts, truncation=True, max_length=model.max_seq_length)["input_ids"]
    return [len(row) for row in ids]


def _tokens(model: Any, texts: list[str]) -> int:
    return sum(_lengths(model, texts))


def main() -> int:
    """Run one baseline server until SIGTERM; returns its exit code."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--method", choices=("encode", "dict"), required=True)
    parser.add_argument("--model", default="minilm")
    parser.add_argument("--listen", default="127.0.0.1:0")
    parser.add_argument("--ready-file", type=Path, required=True)
    parser.add_argument("--stored", type=Path, help="JSON list of the stored texts (dict)")
    parser.add_argument("--stored-embeddings", type=Path, help="their embeddings, .npy (dict)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--peer", help="a peer (bench.peers) encodes instead of sentence-transformers")
    parser.add_argument("--graph", type=Path, help="the peer's exported graph")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from attnstore_node.app import create_app
    from attnstore_node.server import bind, serve

    cache = None
    if args.method == "dict":
        if args.stored is None or args.stored_embeddings is None:
            parser.error("--method dict needs --stored and --stored-embeddings")
        texts = json.loads(args.stored.read_text(encoding="utf-8"))
        embeddings = np.load(args.stored_embeddings)
        cache = {text: (vector, 0) for text, vector in zip(texts, embeddings, strict=True)}
    if (args.peer is None) != (args.graph is None):
        parser.error("--peer and --graph go together")
    embedder = EncodeEmbedder(args.model, cache, args.threads, peer=args.peer, graph=args.graph)
    return serve(create_app(embedder), bind(args.listen), ready_file=args.ready_file)


if __name__ == "__main__":
    raise SystemExit(main())
