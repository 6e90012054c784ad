"""The served model: its ``AttnCache`` opened and warmed up, the tokenizer of its requests, and what the routes know.

Loaded once, on the batcher's thread (``Batcher.start``), so a slow load never
blocks the server: ``/health`` answers 503 until it is in, and a model that
cannot be loaded ends the node (``Embedder.failure``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from attnstore_client.cache import AttnCache
from attnstore_node.schema import ModelInfo
from attnstore_node.tokenization import RequestTokenizer
from attnstore_node.warmup import WarmUp, warm_up


@dataclass(frozen=True, slots=True)
class ServedModel:
    """The loaded model the batcher serves."""

    cache: AttnCache  # runs the calls
    tokenizer: RequestTokenizer  # tokenizes each request before it is queued
    info: ModelInfo  # what the routes check requests against
    warmup: WarmUp | None = None  # the warm-up forwards left to time while idle (None: no warm-up)

    def close(self) -> None:
        """Stop the tokenizer once what was submitted is done, then close the cache (its write-back sent)."""
        self.tokenizer.close()
        self.cache.close()


def load_model(open_cache: Callable[[], AttnCache], name: str, *, warmup: bool) -> ServedModel:
    """Open the cache, time its warm-up forwards (``warmup``) and start its request tokenizer.

    Args:
        open_cache: opens the ``AttnCache``.
        name: the model name requests give.
        warmup: run the warm-up forwards first, within their time budget (``warmup.warm_up``); the rest are left
            to the batcher, while idle.

    Raises:
        Exception: whatever opening or warming up the cache raised (a cache opened is closed first).
    """
    cache = open_cache()
    try:
        warming = warm_up(cache) if warmup else None
        vocab = int(cache.adapter.loaded.model.config.vocab_size)
        decoder = cache.adapter.loaded.lm_head is not None
        tiers = cache.tiers
        classifier = cache.adapter.loaded.classifier
        names: dict[Any, Any] = {} if classifier is None else dict(classifier.model.config.id2label or {})
        classes = () if classifier is None else tuple(
            str(names.get(k, names.get(str(k), f"LABEL_{k}"))) for k in range(classifier.num_labels))
        info = ModelInfo(name, int(cache.head.dimension), vocab, int(cache.head.max_length), decoder=decoder,
                         chunks=decoder and cache.chunks is not None, tiers=tiers.present,
                         absent_tiers=tuple(tiers.absent.items()), prompts=tuple(sorted(cache.head.prompts)),
                         classes=classes)
    except BaseException:
        with contextlib.suppress(Exception):
            cache.close()
        raise
    return ServedModel(cache, RequestTokenizer(cache), info, warming)
