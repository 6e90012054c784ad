"""``AttnCache``: a model in front of an attention-map store, used like sentence-transformers.

    cache = AttnCache("minilm", store="grpc://store-host:50051", namespace="minilm", token=...)
    embeddings = cache.encode(sentences)          # (n, dim) numpy, as SentenceTransformer.encode gives
    print(cache.last_stats.summary())             # hits by kind, repeats, bytes, time split

A call resolves its rows tier by tier, each tier asked only for the rows still
open (``attnstore_client.prefill``): repeats within the call, this process's own
exact tier, the store's exact tier, stored prefixes (causal models), then map
hits where the cost model expects a lookup to pay; the rest compute normally.
The store can only make a call faster: a miss, timeout, checksum failure or
outage computes the affected rows with the plain model (counted in the stats),
also when the daemon is down at start.
"""

from __future__ import annotations

import dataclasses
import logging
import time
import weakref
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, overload

import numpy as np
import torch

from attnstore.errors import ConfigError, UnavailableError
from attnstore_client.adapters import adapter_for
from attnstore_client.audit import AuditFinding
from attnstore_client.call.rows import NamespaceView
from attnstore_client.call.settings import CallSettings, ChunkSettings
from attnstore_client.call.sinks import Pooled, RowStates, Sink
from attnstore_client.call.sources import Prompt, RowSource, TextRows, TokenRows, segment_tokens
from attnstore_client.call.state import Call
from attnstore_client.choices import ChoiceScores, last_states, score_prompts
from attnstore_client.connection import StoreConnection, connect
from attnstore_client.keys import model_fingerprint
from attnstore_client.memory import MemoryPlan, forward_bytes_per_token, plan_memory
from attnstore_client.models import LoadedModel, load_model, move_model, resolve_device
from attnstore_client.namespace import NamespaceReader
from attnstore_client.prefill import Prefill
from attnstore_client.resilience import CircuitBreaker
from attnstore_client.sentence import cross_encoder
from attnstore_client.sentence.compat import Embeddings, SentenceTransformerAPI
from attnstore_client.sentence.heads import PROMPT_EOL, PromptEolHead, sentence_head
from attnstore_client.sentence.outputs import OutputOptions, OutputValue, Precision, check_keywords, shape_outputs
from attnstore_client.settings import CacheSettings
from attnstore_client.stats import CacheStats
from attnstore_client.tiers.available import CacheTiers, cache_tiers
from attnstore_client.tiers.base import TierContext
from attnstore_client.tiers.chunks.source import ChunkSource
from attnstore_client.tiers.chunks.store_source import StoreChunkSource
from attnstore_client.tiers.chunks.tier import ChunkTier
from attnstore_client.tiers.compute import ComputeTier
from attnstore_client.tiers.cost_model import CostModel
from attnstore_client.tiers.engines import EngineChoice, EngineSelection
from attnstore_client.tiers.forward_pool import ForwardPool
from attnstore_client.tiers.local_exact import LocalExactTier, LocalOutputs
from attnstore_client.tiers.map_threshold import DEFAULT_MAX_DISTANCE, map_threshold
from attnstore_client.tiers.maps import MapTier
from attnstore_client.tiers.prefix import PrefixTier
from attnstore_client.tiers.prefix.writer import PrefixWriter, start_prefix_writer
from attnstore_client.tiers.store_exact import StoreExactTier
from attnstore_client.tiers.write_back import WriteBackWorker, check_write_back_dtype, start_write_back

if TYPE_CHECKING:
    from typing import Unpack

    from attnstore_client.settings import CacheOptions

log = logging.getLogger(__name__)

__all__ = ["DEFAULT_MAX_DISTANCE", "PROMPT_EOL", "AttnCache", "CacheSettings", "ChoiceScores"]


class _Flag:
    """A switch of the cache's settings (``CacheSettings``), read and set on the cache; the next call reads it."""

    def __init__(self, doc: str) -> None:
        self.__doc__ = doc + " Settable."

    def __set_name__(self, owner: type, name: str) -> None:
        self._name = name

    def __get__(self, cache: AttnCache, owner: type | None = None) -> bool:
        return bool(getattr(cache._settings, self._name))

    def __set__(self, cache: AttnCache, value: bool) -> None:
        cache._settings = cache._settings.with_options({self._name: bool(value)})


@dataclasses.dataclass
class _CostModels:
    """The cost model the next call uses: ``AttnCache.cost_model`` replaces it; the tiers read it when they
    decide (``TierContext.cost_models``), so replacing it leaves the tiers as they are."""

    current: CostModel

    def __call__(self) -> CostModel:
        return self.current


@dataclasses.dataclass
class _Resources:
    """What an ``AttnCache`` holds open: closed once, by ``close()`` or when the cache is collected."""

    connection: StoreConnection
    forwards: ForwardPool
    write_back: WriteBackWorker | None = None
    chunks: StoreChunkSource | None = None
    prefixes: PrefixWriter | None = None

    def close(self) -> None:
        for worker in (self.forwards, self.write_back, self.chunks, self.prefixes):
            if worker is not None:
                worker.close()
        self.connection.close()


class AttnCache(SentenceTransformerAPI):
    """A model whose prefill is served from an attention-map store where possible.

    Used like a ``SentenceTransformer``: ``encode`` and the rest of its public
    surface (``sentence.compat``), so code written for one runs on the other.

    Args:
        model: a model alias (``minilm``, ``smollm2``), a local model path, or a loaded model.
        store: ``grpc://HOST:PORT`` (a daemon), ``grpcs://HOST:PORT`` (with TLS),
            ``local:PATH`` (embedded: the store opened in this process), or an open connection.
        namespace: the namespace built for this model.
        settings: every option of the cache, each default commented (``CacheSettings``); None: the defaults.
        token: bearer token of the daemon (a read token suffices).
        tls_ca: CA certificate (PEM file) of a ``grpcs://`` daemon.
        client_cert, client_key: this node's certificate and key (PEM files) for a daemon requiring mTLS.
        chunk_source: where chunks are kept (default: the namespace's stored chunks, ``StoreChunkSource``, behind
            a ``MemoryChunkSource``; the ones computed are written back with ``write_back``).
        **overrides: single settings replacing those of ``settings``, by name (``timeout=5.0``,
            ``write_back=True``; ``CacheOptions`` types them):

            - max_distance: threshold on the predicted map distance for a map hit. None (the default) lets the
              namespace's fidelity gate decide when it has one (``attnstore.projector.gate``: the best of the
              nearest entries by distance and differing tokens); else takes the namespace's calibrated
              threshold (``Projector.calibration``), 0 (exact hits only) if its calibration found no threshold
              precise enough, and ``DEFAULT_MAX_DISTANCE`` for an uncalibrated namespace.
            - timeout: deadline in seconds of one store call (an exact-tier window, a search, a batch of hits'
              maps); past it the rows still waiting are computed.
            - exact, maps, prefix: use the exact tiers (this process's and the store's stored outputs), map
              hits, stored prefixes (causal models).
            - stream: start replaying while maps still arrive (else wait for all first).
            - max_length: truncate inputs to this many tokens; None: the model's own limit (its
              sentence-transformers ``max_seq_length``, else its context).
            - device: where the model runs (``"cpu"``, ``"cuda"``, ``"cuda:1"``...; default: the CPU).
            - exact_cache_bytes: cap of this process's exact tier (0 turns it off).
            - prefix_min_tokens: shortest stored prefix fetched (causal models).
            - cost: how the cost model decides which rows are worth a map lookup.
            - retry: retries of a failed store call (only outages, only within ``timeout``).
            - breaker: when to stop asking a failing store, and when to try again.
            - write_back: send computed rows the daemon admits to its exact tier (needs a daemon, a write token).
            - packed: run forwards with their rows end to end, nothing padded (``adapters.packed``); False pads
              length-sorted batches, cut where the cost model's fit predicts the least time.
            - side_by_side: packed CPU forwards run side by side, a thread each (``tiers.forward_pool``).
            - chunks: fuse prompts given in segments from stored chunks (decoders; ``tiers.chunks``) in calls
              that keep each prompt's last state (``score_choices``, ``last_hidden_states``); None: no chunk tier.
            - int8: compute the rows no tier served with the linear layers the namespace's int8 plan names
              quantised (``attnstore build --int8`` chose them on its corpus to keep rows at cosine >= 0.99 to
              fp32; ``int8``): faster, approximate. The exact tiers keep fp32 outputs only; int8 rows are neither
              kept nor written back (rows the daemon admits are computed in fp32). Default False.
            - engine: where computed fp32 rows that keep no maps run (``tiers.engines``): ``"torch"`` (the
              default), ``"auto"`` (per length band the fastest of torch and the model's OpenVINO and ONNX Runtime
              graphs, exported once, checked against torch and timed on the first computing call; ``engines``
              shows the choice) or ``"openvino"`` / ``"onnxruntime"`` (that graph for every band).
            - memory_budget: bytes this cache may keep beyond its model and a call's result: the store's
              indexes (embedded mode), the forwards in flight and this process's exact tier, split by
              ``attnstore_client.memory.plan_memory`` (``memory`` holds the split). None (the default): each
              part has its own bound only.

    Raises:
        ConfigError: a bad option (named), an unknown keyword (the settings are listed), or a bad store URL.
        NamespaceNotFoundError: no such namespace.
        FingerprintMismatchError: the namespace was built with another model, tokenizer or weights.
        AuthError: the daemon refused the token.
    """

    def __init__(
        self,
        model: str | LoadedModel,
        store: str | StoreConnection,
        namespace: str = "default",
        settings: CacheSettings | None = None,
        *,
        token: str | None = None,
        tls_ca: str | Path | None = None,
        client_cert: str | Path | None = None,
        client_key: str | Path | None = None,
        chunk_source: ChunkSource | None = None,
        **overrides: Unpack[CacheOptions],
    ) -> None:
        if settings is not None and not isinstance(settings, CacheSettings):
            raise ConfigError(f"AttnCache: settings must be a CacheSettings or None, got {settings!r}")
        settings = (settings or CacheSettings()).with_options(overrides)
        if not isinstance(store, str) and (token, tls_ca, client_cert, client_key) != (None, None, None, None):
            raise ConfigError("AttnCache: token and TLS files go with a store URL; this connection is already open")
        # Every option is checked before anything is opened: a bad one leaves nothing behind.
        self._settings = settings
        self.device = resolve_device(settings.device)
        self.loaded = load_model(model) if isinstance(model, str) else model
        if settings.write_back is not False:
            check_write_back_dtype(self.loaded.model)
        self.fingerprint = model_fingerprint(self.loaded.model, self.loaded.tokenizer)  # on the CPU weights
        move_model(self.loaded, self.device)
        self.adapter = adapter_for(self.loaded)
        if not self.adapter.capabilities.can_replay:  # the one line that says what a model without an adapter gets
            log.info("model %r runs through its own forward: exact tiers and write-back only (%s)", self.loaded.name,
                     self.adapter.capabilities.missing)
        self.head = sentence_head(self.loaded, settings.max_length)
        self.namespace = namespace
        # The map-hit rule the next call uses, taken from the namespace once read (``_adopt``).
        self._hit_threshold = map_threshold(settings.max_distance, None)
        self._gated = False
        self._cost_models = _CostModels(CostModel(settings.cost))
        self.connection = (
            connect(store, token=token, tls_ca=tls_ca, client_cert=client_cert, client_key=client_key)
            if isinstance(store, str) else store
        )
        # What this cache holds open, released by close() or, for a cache dropped without it, by the collector.
        self._resources = _Resources(self.connection, ForwardPool())
        self._finalizer = weakref.finalize(self, self._resources.close)
        self._namespace = NamespaceReader(self.connection, namespace, self.fingerprint, model=self.loaded.name,
                                          causal=self.adapter.causal, device=self.device)
        try:
            self._build_tiers(chunk_source)
            self._adopt(self._namespace.read())
        except UnavailableError as exc:
            # The store can only make a call faster: compute until it answers (NamespaceReader.refresh).
            log.warning("store %s is unreachable: computing every row until it answers (%s)", self.connection.url, exc)
            self._context.breaker.record_failure()
        except BaseException:
            self.close()
            raise
        self.last_stats = CacheStats()
        self.stats = CacheStats()
        # Per row of the last call, in input order: how it was served (a ``RowKind``).
        self.last_row_kinds: tuple[str, ...] = ()

    def _build_tiers(self, chunk_source: ChunkSource | None) -> None:
        """The tiers, in one pass: what they share first (the write-back worker, the chunk source), then each
        tier on it, into a pipeline nothing changes afterwards. Opens nothing on the store (it is read after)."""
        settings = self._settings
        write_back = start_write_back(self.connection, self.namespace, self.fingerprint, settings.write_back)
        self._resources.write_back = write_back
        self._resources.prefixes = start_prefix_writer(self.connection, self.namespace, self.fingerprint, self.adapter,
                                                       write_back=write_back is not None)
        if chunk_source is None:  # the namespace's stored chunks, behind this process's
            chunk_source = self._resources.chunks = StoreChunkSource(
                self.connection, self.namespace, self.fingerprint, self.adapter,
                dtype=settings.chunks.dtype if settings.chunks else None, timeout=settings.timeout,
                write_back=write_back is not None)
        self._context = TierContext(self.adapter, self.connection, self.fingerprint, CircuitBreaker(settings.breaker),
                                    self._cost_models, write_back=write_back, forwards=self._resources.forwards,
                                    reload_namespace=self._namespace.read)
        self.memory = self._plan_memory()
        exact_bytes = settings.exact_cache_bytes if self.memory is None else self.memory.exact_tier
        self._local = LocalExactTier(self._context, LocalOutputs(exact_bytes))
        self._engines = (None if settings.engine == "torch"
                         else EngineSelection(self.adapter, settings.engine, max_length=self.head.max_length))
        self._chunks = ChunkTier(self._context, chunk_source)
        self._prefill = Prefill([
            self._local, StoreExactTier(self._context, self._local),
            self._chunks, PrefixTier(self._context, self._resources.prefixes),
            MapTier(self._context), ComputeTier(self._context, self._local, self._engines),
        ])

    def _plan_memory(self) -> MemoryPlan | None:
        """What ``memory_budget`` gives the store's indexes, the forwards and the exact tier; None without one.

        Raises:
            ConfigError: a budget too small for the indexes or for one full-length row's forwards.
        """
        budget = self._settings.memory_budget
        if budget is None:
            return None
        side_by_side = self._settings.side_by_side and self.device.type == "cpu"
        return plan_memory(
            budget, indexes=self.connection.resident_bytes, exact_cache_bytes=self._settings.exact_cache_bytes,
            bytes_per_token=forward_bytes_per_token(self.loaded.model.config, self.head.max_length),
            forwards_at_once=torch.get_num_threads() if side_by_side else 1, max_length=self.head.max_length)

    # ---- the namespace ----------------------------------------------------------

    def _adopt(self, view: NamespaceView) -> None:
        """Take the threshold and gate of ``view``'s projector for the next calls.

        The one place the cache follows its namespace, whoever read it: the constructor, ``refresh`` before a
        call, or a call's map tier told the projector was replaced (``run`` adopts the view the call ended with).
        """
        if view.projector is not None:
            self._hit_threshold = map_threshold(self._settings.max_distance, view.projector)
            self._gated = self._settings.max_distance is None and view.projector.gate is not None

    # ---- settings ---------------------------------------------------------------

    @property
    def settings(self) -> CacheSettings:
        """The settings the next call reads (the switches below replace values of it)."""
        return self._settings

    @property
    def max_distance(self) -> float:
        """Threshold on the predicted map distance for a map hit when not gated; setting it turns the gate off."""
        return self._hit_threshold

    @max_distance.setter
    def max_distance(self, value: float) -> None:
        self._settings = self._settings.with_options({"max_distance": value})
        self._hit_threshold, self._gated = float(value), False

    @property
    def gated(self) -> bool:
        """Whether the namespace's fidelity gate decides map hits (instead of ``max_distance``); settable."""
        return self._gated

    @gated.setter
    def gated(self, value: bool) -> None:
        projector = self._namespace.view.projector
        if value and (projector is None or projector.gate is None):
            raise ConfigError("AttnCache: this namespace has no fidelity gate (built without calibration)")
        self._gated = bool(value)

    exact = _Flag("Whether the exact tiers (this process's and the store's stored outputs) answer rows.")
    maps = _Flag("Whether map hits are looked for at all (False: the exact tiers only, a plain output cache).")
    prefix = _Flag("Whether rows start from stored prefixes of their keys and values (causal models).")
    packed = _Flag("Whether forwards run their rows end to end, unpadded (``adapters.packed``).")
    side_by_side = _Flag("Whether packed CPU forwards run side by side, a thread each (``tiers.forward_pool``).")
    int8 = _Flag("Whether computed rows run on the namespace's int8 plan (``int8``): faster, approximate.")

    @property
    def chunks(self) -> ChunkSettings | None:
        """How prompts in segments are fused from stored chunks (None: not at all); settable."""
        return self._settings.chunks

    @chunks.setter
    def chunks(self, value: ChunkSettings | None) -> None:
        self._settings = self._settings.with_options({"chunks": value})

    @property
    def chunk_source(self) -> ChunkSource:
        """Where the chunk tier looks chunks up and puts the ones it computed."""
        return self._chunks.source

    @property
    def breaker(self) -> CircuitBreaker:
        """The circuit breaker in front of the store."""
        return self._context.breaker

    @property
    def cost_model(self) -> CostModel:
        """What decides which rows are worth a map lookup (``estimates()`` shows its figures); settable."""
        return self._cost_models.current

    @cost_model.setter
    def cost_model(self, model: CostModel) -> None:
        self._cost_models.current = model

    @property
    def audit_findings(self) -> tuple[AuditFinding, ...]:
        """The stored rows this cache's audit found wrong (``audit_rate``), latest last: each with the writer the
        store named and whether it was quarantined."""
        return self._context.audit.findings

    @property
    def local_tier(self) -> LocalOutputs:
        """This process's exact tier (``stats()`` shows its usage)."""
        return self._local.outputs

    @property
    def family(self) -> Literal["llama", "bert", "generic"]:
        """The model's attention layout (``Adapter.family``): ``bert`` (an encoder's), ``llama`` (a decoder's; causal
        unless ``adapter.causal`` says otherwise, as for EmbeddingGemma) or ``generic`` (no adapter: the model's own
        forward, the exact tiers only)."""
        return self.adapter.family

    @property
    def tiers(self) -> CacheTiers:
        """Which tiers this cache has now (its model's adapter, its settings, its namespace), and why each absent one
        is absent: ``str(cache.tiers)`` reads as a sentence."""
        worker = self._context.write_back
        write_back_off = ("off in the settings (write_back=False)" if worker is None
                          else f"turned off: {worker.stats().disabled}" if worker.turned_off else None)
        return cache_tiers(self.adapter, self._settings, write_back_off=write_back_off,
                           has_projector=self._namespace.view.projector is not None)

    @property
    def engines(self) -> EngineChoice | None:
        """The engine each length band of computed forwards runs on, with the timings that chose it
        (``CacheSettings.engine``); None with ``engine="torch"`` and before the first call that computes a row.
        ``print(cache.engines)`` shows the table."""
        return None if self._engines is None else self._engines.choice

    @property
    def int8_engines(self) -> EngineChoice | None:
        """The engine each length band of int8 rows runs on (``int8=True``, engine ``auto`` or ``openvino``, a
        plan with graph layers); None while they run on torch's int8 model."""
        return None if self._engines is None else self._engines.int8_choice

    def to(self, device: str | torch.device) -> AttnCache:
        """Move the model (and what replays into it) to ``device``; returns self."""
        self.device = resolve_device(device)
        move_model(self.loaded, self.device)
        self._namespace.device = self.device  # the tiers read the device from the model
        self._settings = self._settings.with_options({"device": self.device})
        if self._namespace.view.projector is not None:
            self._namespace.view.projector.to(self.device)
        return self

    def reset_stats(self) -> None:
        """Zero the cumulative stats."""
        self.stats = CacheStats()

    @property
    def write_back(self) -> WriteBackWorker | None:
        """The write-back worker (its ``stats()``, ``flush()``), or None when write-back is off (or was turned off:
        the model no longer computes in fp32)."""
        return self._context.writing_back

    def close(self) -> None:
        """Send the rows queued for write-back (a few seconds at most), then close the store connection."""
        self._finalizer()

    def __enter__(self) -> AttnCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- encode -----------------------------------------------------------------

    # The return type follows the output flags, as sentence-transformers' own overloads give it (and in their
    # order: the first that matches wins): one text gives one result, a sequence of texts a list or a stacked
    # array. A keyword no overload names (a misspelt one) is a type error; at run time it raises ConfigError.
    @overload
    def encode(
        self,
        inputs: str | Sequence[Prompt],
        prompt_name: str | None = ...,
        prompt: str | None = ...,
        batch_size: int = ...,
        show_progress_bar: bool | None = ...,
        output_value: Literal["sentence_embedding"] = ...,
        precision: Precision | None = ...,
        convert_to_numpy: Literal[True] = ...,
        convert_to_tensor: Literal[False] = ...,
        device: str | torch.device | None = ...,
        normalize_embeddings: bool = ...,
        truncate_dim: int | None = ...,
        *,
        pool: None = ...,
        chunk_size: int | None = ...,
    ) -> np.ndarray: ...

    @overload
    def encode(
        self,
        inputs: str | Sequence[Prompt],
        prompt_name: str | None = ...,
        prompt: str | None = ...,
        batch_size: int = ...,
        show_progress_bar: bool | None = ...,
        output_value: Literal["sentence_embedding"] = ...,
        precision: Precision | None = ...,
        convert_to_numpy: bool = ...,
        *,
        convert_to_tensor: Literal[True],
        device: str | torch.device | None = ...,
        normalize_embeddings: bool = ...,
        truncate_dim: int | None = ...,
        pool: None = ...,
        chunk_size: int | None = ...,
    ) -> torch.Tensor: ...

    @overload
    def encode(  # type: ignore[overload-overlap]  # a str is a Sequence[str]: it matches this first
        self,
        inputs: str,
        prompt_name: str | None = ...,
        prompt: str | None = ...,
        batch_size: int = ...,
        show_progress_bar: bool | None = ...,
        output_value: Literal["sentence_embedding"] = ...,
        precision: Precision | None = ...,
        *,
        convert_to_numpy: Literal[False],
        convert_to_tensor: bool = ...,
        device: str | torch.device | None = ...,
        normalize_embeddings: bool = ...,
        truncate_dim: int | None = ...,
        pool: None = ...,
        chunk_size: int | None = ...,
    ) -> torch.Tensor: ...

    @overload
    def encode(  # type: ignore[overload-overlap]  # a str is a Sequence[str]: it matches this first
        self,
        inputs: str,
        prompt_name: str | None = ...,
        prompt: str | None = ...,
        batch_size: int = ...,
        show_progress_bar: bool | None = ...,
        *,
        output_value: Literal["token_embeddings"],
        precision: Precision | None = ...,
        convert_to_numpy: bool = ...,
        convert_to_tensor: bool = ...,
        device: str | torch.device | None = ...,
        normalize_embeddings: bool = ...,
        truncate_dim: int | None = ...,
        pool: None = ...,
        chunk_size: int | None = ...,
    ) -> torch.Tensor: ...

    @overload
    def encode(  # type: ignore[overload-overlap]  # a str is a Sequence[str]: it matches this first
        self,
        inputs: str,
        prompt_name: str | None = ...,
        prompt: str | None = ...,
        batch_size: int = ...,
        show_progress_bar: bool | None = ...,
        *,
        output_value: None,
        precision: Precision | None = ...,
        convert_to_numpy: bool = ...,
        convert_to_tensor: bool = ...,
        device: str | torch.device | None = ...,
        normalize_embeddings: bool = ...,
        truncate_dim: int | None = ...,
        pool: None = ...,
        chunk_size: int | None = ...,
    ) -> dict[str, torch.Tensor]: ...

    @overload
    def encode(
        self,
        inputs: Sequence[Prompt],
        prompt_name: str | None = ...,
        prompt: str | None = ...,
        batch_size: int = ...,
        show_progress_bar: bool | None = ...,
        output_value: Literal["sentence_embedding"] = ...,
        precision: Precision | None = ...,
        *,
        convert_to_numpy: Literal[False],
        convert_to_tensor: Literal[False] = ...,
        device: str | torch.device | None = ...,
        normalize_embeddings: bool = ...,
        truncate_dim: int | None = ...,
        pool: None = ...,
        chunk_size: int | None = ...,
    ) -> list[torch.Tensor]: ...

    @overload
    def encode(
        self,
        inputs: Sequence[Prompt],
        prompt_name: str | None = ...,
        prompt: str | None = ...,
        batch_size: int = ...,
        show_progress_bar: bool | None = ...,
        *,
        output_value: Literal["token_embeddings"],
        precision: Precision | None = ...,
        convert_to_numpy: bool = ...,
        convert_to_tensor: bool = ...,
        device: str | torch.device | None = ...,
        normalize_embeddings: bool = ...,
        truncate_dim: int | None = ...,
        pool: None = ...,
        chunk_size: int | None = ...,
    ) -> list[torch.Tensor]: ...

    @overload
    def encode(
        self,
        inputs: Sequence[Prompt],
        prompt_name: str | None = ...,
        prompt: str | None = ...,
        batch_size: int = ...,
        show_progress_bar: bool | None = ...,
        *,
        output_value: None,
        precision: Precision | None = ...,
        convert_to_numpy: bool = ...,
        convert_to_tensor: bool = ...,
        device: str | torch.device | None = ...,
        normalize_embeddings: bool = ...,
        truncate_dim: int | None = ...,
        pool: None = ...,
        chunk_size: int | None = ...,
    ) -> list[dict[str, torch.Tensor]]: ...

    # Catch-all, as sentence-transformers has: union-typed flags, and the texts given as ``sentences=``.
    @overload
    def encode(
        self,
        inputs: str | Sequence[Prompt] | None = ...,
        prompt_name: str | None = ...,
        prompt: str | None = ...,
        batch_size: int = ...,
        show_progress_bar: bool | None = ...,
        output_value: OutputValue | None = ...,
        precision: Precision | None = ...,
        convert_to_numpy: bool = ...,
        convert_to_tensor: bool = ...,
        device: str | torch.device | None = ...,
        normalize_embeddings: bool = ...,
        truncate_dim: int | None = ...,
        *,
        pool: None = ...,
        chunk_size: int | None = ...,
        sentences: str | Sequence[Prompt] | None = ...,
    ) -> Embeddings: ...

    def encode(
        self,
        inputs: str | Sequence[Prompt] | None = None,
        prompt_name: str | None = None,
        prompt: str | None = None,
        batch_size: int = 32,
        show_progress_bar: bool | None = None,
        output_value: OutputValue | None = "sentence_embedding",
        precision: Precision | None = "float32",
        convert_to_numpy: bool = True,
        convert_to_tensor: bool = False,
        device: str | torch.device | None = None,
        normalize_embeddings: bool = False,
        truncate_dim: int | None = None,
        **kwargs: Any,
    ) -> Embeddings:
        """Sentence embeddings, as ``SentenceTransformer.encode`` gives them for this model.

        The model's sentence-transformers configuration decides truncation, pooling,
        normalisation and prompts; a decoder without one embeds the PromptEOL prompt's
        last token. Takes sentence-transformers' keywords with their meanings.

        Args:
            inputs: one text (one result back) or a sequence of texts (``sentences=`` works too); an input may be
                a list of segments (tokenized one by one, the ids concatenated; not with a prompt or PromptEOL).
            prompt_name: one of the model's ``prompts`` to put before every text.
            prompt: a prompt to put before every text (wins over ``prompt_name``).
            batch_size: rows per forward, as sentence-transformers takes it; packed forwards hold the tokens of
                ``batch_size`` padded rows (their longest times ``batch_size``), shorter rows filling the rest.
            show_progress_bar: a bar over the rows computed; None shows it when logging is at INFO or lower.
            output_value: ``"sentence_embedding"``, ``"token_embeddings"`` (per text ``(L, hidden)``),
                or None (a dict of both per text).
            precision: ``"float32"``, or a quantisation (``"int8"``, ``"uint8"``, ``"binary"``, ``"ubinary"``).
            convert_to_numpy: an ``(n, dim)`` numpy array (else a list of tensors).
            convert_to_tensor: one ``(n, dim)`` tensor (wins over ``convert_to_numpy``).
            device: the device to run on (the model moves there).
            normalize_embeddings: scale every vector to unit length.
            truncate_dim: keep the first this many dimensions.

        Returns:
            The embeddings in input order: an ``(n, dim)`` numpy array (a ``(dim,)`` one for a single text), a tensor
            with ``convert_to_tensor``, a list of tensors with ``convert_to_numpy=False``, per text an ``(L, hidden)``
            tensor for ``"token_embeddings"`` and a dict of both for ``output_value=None`` (the overloads above).

        Raises:
            ConfigError: a bad option, an unknown keyword (the valid ones are listed), or no texts.
            NotImplementedError: ``pool=`` (run one cache per process instead).
        """
        sentences = kwargs.pop("sentences", None)
        check_keywords(kwargs)
        texts = inputs if inputs is not None else sentences
        if texts is None:
            raise ConfigError("encode() needs the texts: encode(texts) or encode(sentences=texts)")
        options = OutputOptions(output_value, precision, convert_to_numpy, convert_to_tensor, normalize_embeddings,
                                self.head.truncate_dim if truncate_dim is None else truncate_dim)
        if device is not None and resolve_device(device) != self.device:
            self.to(device)
        single = isinstance(texts, str)
        rows = [texts] if isinstance(texts, str) else list(texts)
        prompt_text = self.head.resolve_prompt(prompt, prompt_name)
        if not rows:
            return shape_outputs(torch.zeros((0, self.head.dimension), device=self.device), [], options, single=False)
        first_text = next((text for text in rows if isinstance(text, str)), "")
        _, prompt_length = self.head.tokenize([first_text], prompt_text)
        segments = None if prompt_text is not None or isinstance(self.head, PromptEolHead) else partial(
            segment_tokens, self.loaded.tokenizer, max_length=self.head.max_length)
        source = TextRows(rows, lambda batch: self.head.tokenize(batch, prompt_text)[0], segments)
        if output_value == "token_embeddings":
            states = RowStates(len(rows))
            self.run(source, states, batch_size=batch_size, show_progress_bar=show_progress_bar)
            return shape_outputs(None, states.result(), options, single=single)
        pooled = Pooled(len(rows), partial(self.head.pool_rows, prompt_length=prompt_length),
                        keep_states=output_value is None)
        self.run(source, pooled, batch_size=batch_size, show_progress_bar=show_progress_bar)
        tokens = None if pooled.states is None else pooled.states.result()
        return shape_outputs(pooled.result(), tokens, options, single=single)

    def hidden_states(
        self, ids: Sequence[Sequence[int]], *, batch_size: int = 32, show_progress_bar: bool | None = None
    ) -> list[torch.Tensor]:
        """Each row's last hidden states ``(L, hidden)`` fp32 for token rows the caller made; sets ``last_stats``.

        Raises:
            ConfigError: an empty row, or ``batch_size`` < 1.
        """
        states = RowStates(len(ids))
        if ids:
            self.run(TokenRows(ids), states, batch_size=batch_size, show_progress_bar=show_progress_bar)
        return states.result()

    # ---- decoders: next-token choices --------------------------------------------

    def score_choices(
        self,
        prompts: str | Sequence[Prompt],
        choices: Sequence[str] = ("A", "B", "C", "D"),
        batch_size: int = 32,
        show_progress_bar: bool | None = None,
    ) -> ChoiceScores:
        """Score each prompt's next token over ``choices`` (classification, multiple choice).

        The prompt is used as given (end it where the answer token follows, e.g.
        ``"...\\nAnswer:"``); each choice must be one token of the tokenizer, as
        the model would write it next (``" A"`` with its space for most BPE vocabularies).

        Args:
            prompts: one prompt or a sequence of prompts; a prompt may be a list of segments (instruction,
                chunks, question), each tokenized on its own and the ids concatenated (fused from stored
                chunks by the chunk tier when the cache's ``chunks`` is set).
            choices: the candidate next tokens, as text.
            batch_size, show_progress_bar: as for ``encode``.

        Returns:
            The chosen index and the probabilities over ``choices`` per prompt.

        Raises:
            UnsupportedModelError: the model is an encoder (no language-model head).
            ConfigError: fewer than two choices, or a choice that is not exactly one token.
        """
        run = partial(self.run, batch_size=batch_size, show_progress_bar=show_progress_bar)
        return score_prompts(self.loaded, prompts, choices, self.head.max_length, run)

    def last_hidden_states(
        self, prompts: str | Sequence[Prompt], batch_size: int = 32, show_progress_bar: bool | None = None
    ) -> torch.Tensor:
        """Each prompt's last hidden state ``(n, hidden)`` fp32, what :meth:`score_choices` scores; sets ``last_stats``.

        A prompt may be a list of segments, as for :meth:`score_choices`.

        Raises:
            ConfigError: a prompt in segments longer than the model's limit.
        """
        run = partial(self.run, batch_size=batch_size, show_progress_bar=show_progress_bar)
        return last_states(self.loaded.tokenizer, prompts, self.head.max_length, run)

    # ---- cross-encoders: scored text pairs ----------------------------------------

    def predict(
        self,
        sentences_pairs: cross_encoder.Pair | Sequence[cross_encoder.Pair],
        batch_size: int = 32,
        show_progress_bar: bool | None = None,
        activation_fn: Callable[..., Any] | None = None,
        apply_softmax: bool = False,
        convert_to_numpy: bool = True,
        convert_to_tensor: bool = False,
    ) -> Any:
        """Score (query, document) pairs, as sentence-transformers' ``CrossEncoder.predict`` does for this model.

        The model is a sequence-classification one (``*ForSequenceClassification``, or a ``CrossEncoder`` folder);
        each pair is one row of the call, keyed by its tokens (and token types), served by the exact tiers where
        they hold it (``sentence.cross_encoder``).

        Args:
            sentences_pairs: one pair or a list of pairs of strings.
            batch_size, show_progress_bar: as for ``encode``.
            activation_fn: applied to the logits; None: the model's (its folder's, else Sigmoid for one label).
            apply_softmax: a softmax over the labels after the activation (models of several labels).
            convert_to_numpy: a numpy array (else a list of tensors).
            convert_to_tensor: one tensor (wins over ``convert_to_numpy``).

        Returns:
            ``(n,)`` scores for a model of one label, ``(n, num_labels)`` for several; one pair's alone for one pair.

        Raises:
            UnsupportedModelError: the model has no classifier head.
            ConfigError: no pairs, or a pair that is not two strings.
        """
        pairs, single = cross_encoder.listed_pairs(sentences_pairs, "predict()")
        run = partial(self.run, batch_size=batch_size, show_progress_bar=show_progress_bar)
        logits = cross_encoder.score_pairs(self.loaded, pairs, self.head.max_length, run, "predict()")
        return cross_encoder.finish_scores(
            logits, cross_encoder.classifier_of(self.loaded, "predict()"), activation_fn=activation_fn,
            apply_softmax=apply_softmax, convert_to_numpy=convert_to_numpy, convert_to_tensor=convert_to_tensor,
            single=single)

    def rank(
        self,
        query: str,
        documents: Sequence[str],
        top_k: int | None = None,
        return_documents: bool = False,
        batch_size: int = 32,
        show_progress_bar: bool | None = None,
        activation_fn: Callable[..., Any] | None = None,
    ) -> list[dict[str, Any]]:
        """Rank documents for a query, as ``CrossEncoder.rank`` does: ``predict`` on the (query, document) pairs.

        Returns:
            ``{"corpus_id", "score"}`` per document (and ``"text"`` with ``return_documents``), best first, the first
            ``top_k`` (None: all).

        Raises:
            UnsupportedModelError: the model has no classifier head.
            ConfigError: a model of several labels, no documents, or a query or document that is not a string.
        """
        classifier = cross_encoder.classifier_of(self.loaded, "rank()")
        pairs = cross_encoder.rank_pairs(query, documents, classifier, "rank()")
        scores = self.predict(pairs, batch_size=batch_size, show_progress_bar=show_progress_bar,
                              activation_fn=activation_fn, convert_to_tensor=True)
        return cross_encoder.ranked(scores.tolist(), documents, top_k=top_k, return_documents=return_documents)

    # ---- one call ---------------------------------------------------------------

    def run(
        self, source: RowSource, sink: Sink, *, batch_size: int = 32, show_progress_bar: bool | None = None,
        max_batch_tokens: int | None = None,
    ) -> CacheStats:
        """One call of ``source``'s rows into ``sink`` (``sources``, ``sinks``): what ``encode`` and the other
        entry points run. Sets and returns ``last_stats``; sets ``stats`` and ``last_row_kinds``.

        Args:
            source: the call's rows.
            sink: where each served row goes, as its forward (or tier) ends.
            batch_size: rows per forward (packed: the tokens of ``batch_size`` padded rows, see ``tiers.forwards.cut``).
            show_progress_bar: a bar over the rows; None shows it when logging is at INFO or lower.
            max_batch_tokens: tokens per packed forward at most, and then ``batch_size`` rows at most (None:
                ``batch_size`` padded rows' tokens); with a ``memory_budget``, at most the tokens it allows.

        Raises:
            ConfigError: a row without tokens, a bad ``batch_size`` or ``max_batch_tokens``, or
                ``int8`` on in a namespace without an int8 plan.
        """
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ConfigError(f"batch_size must be an int >= 1, got {batch_size!r}")
        if show_progress_bar is None:
            show_progress_bar = log.getEffectiveLevel() <= logging.INFO
        started = time.perf_counter()
        if self._namespace.refresh(self._context.breaker):
            self._adopt(self._namespace.view)
        view = self._namespace.view
        if self._settings.int8 and view.projector is not None and view.projector.int8 is None:
            raise ConfigError(f"AttnCache: int8=True needs an int8 plan, and namespace {self.namespace!r} has none"
                              " (build it with `attnstore build --int8`)")
        if self.memory is not None:  # the budget's tokens per forward, or fewer when asked
            max_batch_tokens = min(max_batch_tokens or self.memory.forward_tokens, self.memory.forward_tokens)
        call = Call(self._call_settings(batch_size, max_batch_tokens), view, sink, len(source))
        try:
            self._prefill.run(source, call, progress=show_progress_bar)
        finally:
            if call.namespace is not view:  # the map tier read it again (its projector was replaced): follow it
                self._adopt(call.namespace)
        self._record(call, time.perf_counter() - started)
        return self.last_stats

    def _call_settings(self, batch_size: int, max_batch_tokens: int | None) -> CallSettings:
        """What one call reads: the cache's settings now, the map-hit rule its namespace gave, the call's sizes."""
        settings = self._settings
        return CallSettings(
            self.namespace, self._hit_threshold, settings.exact, settings.stream, settings.timeout, settings.retry,
            gate=self._gated, maps=settings.maps, prefix=settings.prefix, prefix_min_tokens=settings.prefix_min_tokens,
            batch_size=batch_size, packed=settings.packed and self.adapter.capabilities.can_pack,
            max_batch_tokens=max_batch_tokens,
            side_by_side=settings.side_by_side, chunks=settings.chunks, int8=settings.int8,
            audit_rate=float(settings.audit_rate),
        )

    def _record(self, call: Call, total_s: float) -> None:
        self.last_stats = CacheStats.of_call(call.counts, total_s, self.cost_model.estimates())
        self.stats = self.stats + self.last_stats
        self.last_row_kinds = tuple(call.kinds)
