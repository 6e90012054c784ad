"""The ways of embedding queries that the evaluation harness compares, and how their time is measured.

Every variant is one call over a list of queries and returns each query's
sentence embedding (the model's own: its sentence-transformers pooling and
normalisation, or a decoder's last token) with what serving it took, as a user
would call it: AttnStore's ``AttnCache`` resolves the whole call at once
(repeats, exact tiers, map lookups, batches formed after the lookups); methods
that run batches (the plain model, the layer-sharing and per-layer-search
baselines in ``eval.baselines``) get the queries batched longest first, as
``encode()`` batches. The simple alternatives a user would otherwise write are
here too: sentence-transformers' own ``encode`` (``sentence_transformers``),
and a dict output cache in front of it (``dict_cache``).

Attention time is measured with forward hooks on the model's attention modules:
the hooks wrap whatever runs inside them (the module's own kernel, or the replay
patch), so the same clock times every variant.
"""

from __future__ import annotations

import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial

import numpy as np
import torch
from torch import nn

from attnstore_client.adapters import Adapter
from attnstore_client.adapters.batch import Batch, batch_from_ids
from attnstore_client.cache import AttnCache
from attnstore_client.call.sinks import Pooled
from attnstore_client.call.sources import TokenRows
from attnstore_client.sentence.heads import SentenceHead
from attnstore_client.tiers.cost_model import CostModel


@dataclass(frozen=True)
class Queries:
    """A task's queries as every variant gets them.

    A timed call starts from the texts, as a user's does: variants that run token
    rows get them from ``tokenized`` inside the call (sentence-transformers and the
    dict tokenize inside their own calls), so every variant pays its tokenization.
    """

    texts: list[str]  # as the task gives them (decoders: already in their prompt)
    ids: list[list[int]]  # the same, tokenized and truncated as the model's head does
    pad_id: int
    batch_size: int
    tokenize: Callable[[list[str]], list[list[int]]]  # what made ``ids`` from ``texts``

    def tokenized(self, indices: Sequence[int]) -> list[list[int]]:
        """The token rows of the queries at ``indices``, tokenized now (the same rows as ``ids``)."""
        return self.tokenize([self.texts[i] for i in indices])


@dataclass(frozen=True, slots=True)
class CallRun:
    """One call of one variant over some queries."""

    embeddings: np.ndarray  # (n, dim) float32, in the order asked
    retrieval_s: float = 0.0  # projection + lookup + fetch; 0 for methods that retrieve nothing
    # The part of retrieval_s spent inside the attention modules (maps read as each layer
    # reaches them), so attention compute time = attention time - inline_s.
    inline_s: float = 0.0
    exact_hits: int = 0  # queries answered by stored outputs (no forward), repeats of them included
    map_hits: int = 0  # queries that replayed stored maps
    layer_replays: int = 0  # (row, layer) pairs whose maps were not computed (layer-level methods)
    fallbacks: int = 0  # queries the store should have served but could not
    kinds: tuple[str, ...] = ()  # per query, for store-backed variants: "exact", "prefix", "map", "miss", "fallback"
    prefix_tokens: int = 0  # prompt tokens taken from stored prefixes (keys and values), not computed


@dataclass(frozen=True, slots=True)
class BatchRun:
    """One batch through a batch-running variant."""

    hidden: list[torch.Tensor]  # per row, (L, hidden) fp32 last hidden states
    retrieval_s: float = 0.0
    inline_s: float = 0.0
    map_hits: int = 0
    layer_replays: int = 0


class Variant(ABC):
    """A way of embedding queries that the harness times and scores.

    Attributes:
        name: the method (``full``, ``sentence_transformers``, ``dict_cache``, ``attncache``,
            ``output_cache``, ``lazyformer``, ``san``, ``attncache_f``).
        setting: what distinguishes this run of the method (a threshold), None if nothing.
    """

    name: str
    setting: float | None = None

    @abstractmethod
    def embed(self, queries: Queries, indices: Sequence[int], head: SentenceHead) -> CallRun:
        """Embed the queries at ``indices`` in one call; rows come back in that order."""

    def close(self) -> None:  # noqa: B027 (optional: most variants hold nothing)
        """Release what the variant holds (store connections)."""


class BatchVariant(Variant):
    """A method that runs batches: the queries are batched longest first, as ``encode()`` batches."""

    @abstractmethod
    def run(self, batch: Batch) -> BatchRun:
        """Run one batch; rows come back in batch order."""

    def embed(self, queries: Queries, indices: Sequence[int], head: SentenceHead) -> CallRun:
        """See :meth:`Variant.embed`."""
        ids = queries.tokenized(indices)
        order = sorted(range(len(indices)), key=lambda k: -len(ids[k]))
        embeddings = np.zeros((len(indices), 0), dtype=np.float32)
        retrieval = inline = 0.0
        map_hits = layer_replays = 0
        for start in range(0, len(order), queries.batch_size):
            batch_rows = order[start : start + queries.batch_size]
            run = self.run(batch_from_ids([ids[k] for k in batch_rows], queries.pad_id))
            pooled = head.embed(run.hidden, 0).float().cpu().numpy()  # (B, dim)
            if embeddings.shape[1] == 0:
                embeddings = np.zeros((len(indices), pooled.shape[1]), dtype=np.float32)
            embeddings[batch_rows] = pooled
            retrieval += run.retrieval_s
            inline += run.inline_s
            map_hits += run.map_hits
            layer_replays += run.layer_replays
        return CallRun(embeddings, retrieval, inline, map_hits=map_hits, layer_replays=layer_replays)


class PlainVariant(BatchVariant):
    """The unmodified model: the reference every other variant is compared with."""

    name = "full"

    def __init__(self, adapter: Adapter) -> None:
        self.adapter = adapter

    def run(self, batch: Batch) -> BatchRun:
        out = self.adapter.forward(batch)  # (B, P, hidden)
        return BatchRun(hidden=[out[row, :length] for row, length in enumerate(batch.lengths)])


class CacheVariant(Variant):
    """AttnStore's client at one threshold, or under the namespace's fidelity gate (``threshold`` None).

    ``maps=False`` makes it a plain output cache (the exact tiers only, nothing
    searched). Every call starts with the client's own exact tier empty, so calls
    (passes, timing rounds) are alike and only the store knows the build corpus.
    The variants share one client but each has its own cost model, as a user running
    one setting would: what one threshold's lookups earn says nothing of another's.
    """

    def __init__(self, cache: AttnCache, threshold: float | None, *, maps: bool = True) -> None:
        self.cache = cache
        self.name = "attncache" if maps else "output_cache"
        self.setting = threshold if maps else None
        self._threshold = threshold
        self._maps = maps
        self.cost_model = CostModel(cache.cost_model.settings)

    def embed(self, queries: Queries, indices: Sequence[int], head: SentenceHead) -> CallRun:
        """See :meth:`Variant.embed`."""
        self.cache.maps = self._maps
        self.cache.prefix = self._maps  # the plain output cache has the exact tiers only
        self.cache.cost_model = self.cost_model
        if self._maps and self._threshold is None:
            self.cache.gated = True
        elif self._maps and self._threshold is not None:
            self.cache.max_distance = self._threshold
        self.cache.local_tier.clear()
        # One call of the rows, streamed: each forward is pooled as it ends (the cache's head is ``head``'s kind).
        embeddings = embed_ids(self.cache, queries.tokenized(indices), batch_size=queries.batch_size)
        stats = self.cache.last_stats
        kinds = self.cache.last_row_kinds
        return CallRun(
            embeddings=embeddings.float().cpu().numpy(),
            retrieval_s=stats.projection_s + stats.lookup_s + stats.fetch_s,
            # Embedded stores read each layer's maps when the forward reaches it; a daemon's
            # stream is received beside the forward, which waits inside the attention modules.
            inline_s=stats.fetch_s,
            exact_hits=kinds.count("exact"),
            map_hits=kinds.count("map"),
            fallbacks=kinds.count("fallback"),
            kinds=kinds,
            prefix_tokens=stats.prefix_tokens,
        )


class SentenceTransformersVariant(Variant):
    """sentence-transformers' own ``encode`` of the same model: what a user runs without AttnStore."""

    name = "sentence_transformers"

    def __init__(self, model: object) -> None:
        self.model = model  # a SentenceTransformer

    def embed(self, queries: Queries, indices: Sequence[int], head: SentenceHead) -> CallRun:
        """See :meth:`Variant.embed`."""
        texts = [queries.texts[i] for i in indices]
        embeddings = self.model.encode(texts, batch_size=queries.batch_size, show_progress_bar=False)  # type: ignore[attr-defined]
        return CallRun(np.asarray(embeddings, dtype=np.float32))


class DictCacheVariant(Variant):
    """A dict output cache in front of the plain encoder: what a user writes in five lines.

    Keyed by the query's text; it holds the build corpus's embeddings (as the
    store does), and within a call the distinct texts it lacks are encoded once
    (by ``encoder``: sentence-transformers' ``encode`` where the model has it,
    else the plain model) and kept. Every call starts from the build corpus alone.

    Args:
        encoder: the plain variant that encodes the misses.
        prefilled: build-corpus text -> its embedding (only the texts some query asks
            for need to be there: the others are never looked up).
    """

    name = "dict_cache"

    def __init__(self, encoder: Variant, prefilled: dict[str, np.ndarray]) -> None:
        self.encoder = encoder
        self.prefilled = prefilled

    def embed(self, queries: Queries, indices: Sequence[int], head: SentenceHead) -> CallRun:
        """See :meth:`Variant.embed`."""
        cache = dict(self.prefilled)
        hits = sum(queries.texts[i] in cache for i in indices)
        missing = list(dict.fromkeys(queries.texts[i] for i in indices if queries.texts[i] not in cache))
        if missing:
            positions = {queries.texts[i]: i for i in indices}
            computed = self.encoder.embed(queries, [positions[text] for text in missing], head).embeddings
            cache.update(zip(missing, computed, strict=True))
        kinds = tuple("exact" if queries.texts[i] in self.prefilled else "miss" for i in indices)
        return CallRun(np.stack([cache[queries.texts[i]] for i in indices]), exact_hits=hits, kinds=kinds)


class AttentionTimer:
    """Wall seconds spent inside the given attention modules, summed over calls (and over the forward pool's
    threads, which may run one module at once: each start is kept per thread).

    Use as a context manager; the hooks are removed on exit.
    """

    def __init__(self, modules: Sequence[nn.Module]) -> None:
        self.seconds = 0.0
        self._modules = list(modules)
        self._started: dict[tuple[int, int], float] = {}  # (thread, module) -> start
        self._lock = threading.Lock()
        self._handles: list[torch.utils.hooks.RemovableHandle] = []

    def __enter__(self) -> AttentionTimer:
        for module in self._modules:
            self._handles.append(module.register_forward_pre_hook(self._start))
            self._handles.append(module.register_forward_hook(self._stop))
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _start(self, module: nn.Module, args: object) -> None:
        with self._lock:
            self._started[threading.get_ident(), id(module)] = time.perf_counter()

    def _stop(self, module: nn.Module, args: object, output: object) -> None:
        with self._lock:
            self.seconds += time.perf_counter() - self._started.pop((threading.get_ident(), id(module)))


def embed_ids(cache: AttnCache, ids: Sequence[Sequence[int]], *, batch_size: int) -> torch.Tensor:
    """Sentence embeddings ``(n, dim)`` of token rows tokenized once (``Queries.tokenized``); sets ``cache.last_stats``.

    ``AttnCache.encode`` for rows the harness runs through several methods: ``cache.run`` with the library's
    token-row source and pooling sink, each forward's rows pooled as it ends. It lives here, not on
    ``AttnCache``: only this harness needs it, and it calls the cache's public ``run`` only.

    Raises:
        ConfigError: an empty row, or ``batch_size`` < 1.
    """
    if not ids:
        return torch.zeros((0, cache.head.dimension), device=cache.device)
    pooled = Pooled(len(ids), partial(cache.head.pool_rows, prompt_length=0))
    cache.run(TokenRows(ids), pooled, batch_size=batch_size, show_progress_bar=False)
    return pooled.result()
