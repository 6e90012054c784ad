"""``AttnCache``: a model in front of an attention-map store, used like sentence-transformers.

    cache = AttnCache("minilm", store="grpc://store-host:50051", namespace="minilm", token=...)
    embeddings = cache.encode(sentences)          # (n, hidden) numpy, like SentenceTransformer.encode
    print(cache.last_stats.summary())             # hit rate, bytes, time split

Each batch is projected, looked up once, and run once: exact hits return their
stored outputs, map hits replay stored maps, the rest compute normally. The
store can only make a call faster: a miss, timeout, checksum failure or outage
computes the affected rows with the plain model (counted in the stats).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Literal, overload

import numpy as np
import torch
from tqdm.auto import tqdm

from attnstore.errors import ConfigError, FingerprintMismatchError, NamespaceNotReadyError, UnsupportedModelError
from attnstore_client.adapters import adapter_for
from attnstore_client.batch import Batch, batch_from_ids
from attnstore_client.connection import StoreConnection, connect
from attnstore_client.keys import model_fingerprint
from attnstore_client.models import LoadedModel, load_model
from attnstore_client.prefill import BatchCounts, CachedPrefill, PrefillSettings
from attnstore_client.projector import Projector
from attnstore_client.resilience import BreakerPolicy, CircuitBreaker, RetryPolicy
from attnstore_client.stats import CacheStats

log = logging.getLogger(__name__)

ConvertTo = Literal["numpy", "torch"]
_CONVERT_CHOICES = ("numpy", "torch", None)

# PromptEOL (Jiang et al. 2023): a decoder's last token then summarises the sentence in "one word".
PROMPT_EOL = 'This sentence: "{text}" means in one word:"'

# Threshold on the predicted map distance for namespaces whose projector carries no
# calibration (built before calibration existed, or with --no-calibration). Measured on
# the demo's store (all-MiniLM-L6-v2, 3,000 STS-B train sentences, 8-epoch projector),
# 737 held-out dev sentences that are not exact duplicates: at 0.008, 11 map hits, 8 of
# them at cosine >= 0.99 to the plain model, the worst 0.977; at 0.01, 35 hits, 21
# faithful, the worst 0.885. A calibrated namespace recommends its own threshold.
DEFAULT_MAX_DISTANCE = 0.008


def _threshold(max_distance: float | None, projector: Projector) -> float:
    """The threshold in use: the caller's, else the namespace's calibrated one, else the default."""
    if max_distance is not None:
        return float(max_distance)
    calibration = projector.calibration
    if calibration is None:
        return DEFAULT_MAX_DISTANCE
    if calibration.max_distance is None:
        log.info("the namespace's calibration found no threshold with precise enough map hits: exact hits only")
        return 0.0
    return calibration.max_distance


@dataclass(frozen=True, slots=True)
class ChoiceScores:
    """Which choice each prompt's next token prefers."""

    index: np.ndarray  # (n,) int64: the most probable choice per prompt
    probabilities: np.ndarray  # (n, choices) float32: softmax over the choices' next-token logits


class AttnCache:
    """A model whose prefill is served from an attention-map store where possible.

    Args:
        model: a model alias (``minilm``, ``smollm2``), a local model path, or a loaded model.
        store: ``grpc://HOST:PORT`` (a daemon), ``grpcs://HOST:PORT`` (with TLS),
            ``local:PATH`` (embedded: the store opened in this process), or an open connection.
        namespace: the namespace built for this model.
        max_distance: threshold on the predicted map distance for a map hit. None (the
            default) lets the namespace's fidelity gate decide when it has one (``attnstore.protocol.gate``:
            the best of the nearest entries by distance and differing tokens); else takes the
            namespace's calibrated threshold (``Projector.calibration``), 0 (exact hits
            only) if its calibration found no threshold precise enough, and
            ``DEFAULT_MAX_DISTANCE`` for an uncalibrated namespace.
        token: bearer token of the daemon (a read token suffices).
        tls_ca: CA certificate (PEM file) of a ``grpcs://`` daemon.
        client_cert, client_key: this node's certificate and key (PEM files) for a daemon requiring mTLS.
        timeout: deadline in seconds of one batch's lookup, maps included; past it the
            rows still waiting are computed.
        exact: use the exact tier (stored outputs for inputs whose tokens are stored).
        stream: start replaying while maps still arrive (else wait for all first).
        max_length: inputs are truncated to this many tokens.
        retry: retries of a failed lookup (only outages, only within ``timeout``).
        breaker: when to stop asking a failing store, and when to try again.

    Raises:
        ConfigError: a bad option or store URL.
        NamespaceNotFoundError: no such namespace.
        NamespaceNotReadyError: the namespace has no projector yet.
        FingerprintMismatchError: the namespace was built with another model, tokenizer or weights.
        AuthError, UnavailableError: the daemon refused the token or cannot be reached.
    """

    def __init__(
        self,
        model: str | LoadedModel,
        store: str | StoreConnection,
        *,
        namespace: str = "default",
        max_distance: float | None = None,
        token: str | None = None,
        tls_ca: str | Path | None = None,
        client_cert: str | Path | None = None,
        client_key: str | Path | None = None,
        timeout: float | None = 30.0,
        exact: bool = True,
        stream: bool = True,
        max_length: int = 512,
        retry: RetryPolicy = RetryPolicy(),
        breaker: BreakerPolicy = BreakerPolicy(),
    ) -> None:
        if max_distance is not None and not max_distance >= 0:
            raise ConfigError(f"AttnCache: max_distance must be >= 0, got {max_distance}")
        if timeout is not None and timeout <= 0:
            raise ConfigError(f"AttnCache: timeout must be > 0 seconds or None, got {timeout}")
        if max_length < 1:
            raise ConfigError(f"AttnCache: max_length must be >= 1, got {max_length}")
        if not isinstance(store, str) and (token, tls_ca, client_cert, client_key) != (None, None, None, None):
            raise ConfigError("AttnCache: token and TLS files go with a store URL; this connection is already open")
        self.loaded = load_model(model) if isinstance(model, str) else model
        self.adapter = adapter_for(self.loaded)
        self.max_length = max_length
        self.connection = (
            connect(store, token=token, tls_ca=tls_ca, client_cert=client_cert, client_key=client_key)
            if isinstance(store, str) else store
        )
        try:
            fingerprint = model_fingerprint(self.loaded.model, self.loaded.tokenizer)
            projector, projector_version = self._projector(namespace, fingerprint)
        except BaseException:
            self.connection.close()
            raise
        self._prefill = CachedPrefill(
            self.adapter,
            self.connection,
            fingerprint=fingerprint,
            projector=projector,
            settings=PrefillSettings(
                namespace, _threshold(max_distance, projector), exact, stream, timeout, retry,
                gate=max_distance is None and projector.gate is not None,
            ),
            breaker=CircuitBreaker(breaker),
            projector_version=projector_version,
        )
        self.last_stats = CacheStats()
        self.stats = CacheStats()
        # Per row of the last call, in input order: "exact", "map", "miss" or "fallback".
        self.last_row_kinds: tuple[str, ...] = ()

    def _projector(self, namespace: str, fingerprint: str) -> tuple[Projector, int]:
        handle = self.connection.namespace(namespace)
        if handle.fingerprint != fingerprint:
            raise FingerprintMismatchError(
                f"namespace {namespace!r} at {self.connection.url} was built with model {handle.model!r} "
                f"(fingerprint {handle.fingerprint[:16]}...); {self.loaded.name!r} has fingerprint "
                f"{fingerprint[:16]}...: a different model, tokenizer or weights, so its maps would be wrong. "
                "Build a namespace with this model, or pick the namespace built for it."
            )
        if handle.projector is None:
            raise NamespaceNotReadyError(
                f"namespace {namespace!r} at {self.connection.url} has no projector yet: its build is still"
                " running or was interrupted"
            )
        return Projector.from_safetensors_bytes(handle.projector), handle.projector_version

    @property
    def max_distance(self) -> float:
        """Threshold on the predicted map distance for a map hit when not gated; setting it turns the gate off."""
        return self._prefill.settings.max_distance

    @max_distance.setter
    def max_distance(self, value: float) -> None:
        if not value >= 0:
            raise ConfigError(f"AttnCache: max_distance must be >= 0, got {value}")
        self._prefill.settings = dataclasses.replace(self._prefill.settings, max_distance=float(value), gate=False)

    @property
    def gated(self) -> bool:
        """Whether the namespace's fidelity gate decides map hits (instead of ``max_distance``); settable."""
        return self._prefill.settings.gate

    @gated.setter
    def gated(self, value: bool) -> None:
        if value and self._prefill.projector.gate is None:
            raise ConfigError("AttnCache: this namespace has no fidelity gate (built without calibration)")
        self._prefill.settings = dataclasses.replace(self._prefill.settings, gate=bool(value))

    @property
    def breaker(self) -> CircuitBreaker:
        """The circuit breaker in front of the store."""
        return self._prefill.breaker

    @property
    def family(self) -> Literal["llama", "bert"]:
        """The model's attention family: ``bert`` pools by mean, ``llama`` by PromptEOL's last token."""
        return self.adapter.family

    def reset_stats(self) -> None:
        """Zero the cumulative stats."""
        self.stats = CacheStats()

    def close(self) -> None:
        """Close the store connection."""
        self.connection.close()

    def __enter__(self) -> AttnCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- encode -------------------------------------------------------------

    # Only "numpy" is the default; the other choices are named, so each return type follows its flag.
    @overload
    def encode(
        self, texts: str | Sequence[str], batch_size: int = ..., show_progress_bar: bool | None = ...,
        convert_to: Literal["numpy"] = ..., normalize_embeddings: bool = ...,
    ) -> np.ndarray: ...
    @overload
    def encode(
        self, texts: str | Sequence[str], batch_size: int = ..., show_progress_bar: bool | None = ...,
        *, convert_to: Literal["torch"], normalize_embeddings: bool = ...,
    ) -> torch.Tensor: ...
    # A str is a Sequence[str] too: mypy calls the next two overlapping, but the str one comes first.
    @overload
    def encode(  # type: ignore[overload-overlap]
        self, texts: str, batch_size: int = ..., show_progress_bar: bool | None = ...,
        *, convert_to: None, normalize_embeddings: bool = ...,
    ) -> torch.Tensor: ...
    @overload
    def encode(
        self, texts: Sequence[str], batch_size: int = ..., show_progress_bar: bool | None = ...,
        *, convert_to: None, normalize_embeddings: bool = ...,
    ) -> list[torch.Tensor]: ...

    def encode(
        self,
        texts: str | Sequence[str],
        batch_size: int = 32,
        show_progress_bar: bool | None = None,
        convert_to: ConvertTo | None = "numpy",
        normalize_embeddings: bool = False,
    ) -> np.ndarray | torch.Tensor | list[torch.Tensor]:
        """Sentence embeddings: mean pooling (BERT-like), PromptEOL last token (decoders).

        Args:
            texts: one text (one vector back) or a sequence of texts.
            batch_size: rows per forward; inputs are sorted by length for batching
                and returned in input order.
            show_progress_bar: a bar over batches; None shows it when logging is at INFO or lower.
            convert_to: ``"numpy"`` (an ``(n, hidden)`` float32 array), ``"torch"``
                (an ``(n, hidden)`` tensor) or None (a list of ``(hidden,)`` tensors).
            normalize_embeddings: scale every vector to unit length.

        Returns:
            The embeddings in input order (1-D for a single text).

        Raises:
            ConfigError: a bad option, or no texts.
        """
        if convert_to not in _CONVERT_CHOICES:
            raise ConfigError(f"encode(): convert_to must be one of {list(_CONVERT_CHOICES)}, got {convert_to!r}")
        single = isinstance(texts, str)
        rows = [texts] if isinstance(texts, str) else list(texts)
        if self.family == "llama":
            rows = [PROMPT_EOL.format(text=text) for text in rows]
        vectors = self._run(rows, batch_size, show_progress_bar, self._pool)  # (n, hidden)
        if normalize_embeddings:
            vectors = torch.nn.functional.normalize(vectors, dim=-1)
        if single:
            vectors = vectors[0]
        if convert_to == "numpy":
            return vectors.numpy()
        if convert_to == "torch":
            return vectors
        return list(vectors) if not single else vectors

    def _pool(self, hidden: torch.Tensor) -> torch.Tensor:
        """One row's embedding from its last hidden states ``(L, hidden)``."""
        return hidden[-1] if self.family == "llama" else hidden.mean(dim=0)  # (hidden,)

    # ---- choice scoring -----------------------------------------------------

    def score_choices(
        self,
        prompts: str | Sequence[str],
        choices: Sequence[str] = ("A", "B", "C", "D"),
        batch_size: int = 32,
        show_progress_bar: bool | None = None,
    ) -> ChoiceScores:
        """Score each prompt's next token over ``choices`` (classification, multiple choice).

        The prompt is used as given (end it where the answer token follows, e.g.
        ``"...\\nAnswer:"``); each choice must be one token of the tokenizer, as
        the model would write it next (``" A"`` with its space for most BPE vocabularies).

        Args:
            prompts: one prompt or a sequence of prompts.
            choices: the candidate next tokens, as text.
            batch_size, show_progress_bar: as for :meth:`encode`.

        Returns:
            The chosen index and the probabilities over ``choices`` per prompt.

        Raises:
            UnsupportedModelError: the model is an encoder (no language-model head).
            ConfigError: fewer than two choices, or a choice that is not exactly one token.
        """
        head = self.loaded.lm_head
        if head is None:
            raise UnsupportedModelError(
                f"score_choices() needs a decoder with a language-model head; {self.loaded.name!r} is an encoder"
            )
        ids = self._choice_ids(choices)
        rows = [prompts] if isinstance(prompts, str) else list(prompts)
        last = self._run(rows, batch_size, show_progress_bar, lambda hidden: hidden[-1])  # (n, hidden)
        with torch.inference_mode():
            logits = head(last)[:, ids]  # (n, choices)
        probabilities = torch.softmax(logits.float(), dim=-1).numpy()
        return ChoiceScores(index=probabilities.argmax(axis=1), probabilities=probabilities)

    def _choice_ids(self, choices: Sequence[str]) -> list[int]:
        if isinstance(choices, str) or len(choices) < 2:
            raise ConfigError(f"score_choices(): give at least two choices as a sequence, got {choices!r}")
        ids = []
        for choice in choices:
            tokens = self.loaded.tokenizer(choice, add_special_tokens=False)["input_ids"]
            if len(tokens) != 1:
                raise ConfigError(f"score_choices(): choice {choice!r} is {len(tokens)} tokens; each must be one token")
            ids.append(tokens[0])
        return ids

    # ---- batching -------------------------------------------------------------

    def run_batch(self, batch: Batch) -> list[torch.Tensor]:
        """Each row's last hidden states ``(L, hidden)`` fp32 for one prepared batch; sets ``last_stats``.

        The building block of ``encode`` for callers that batch themselves (the
        evaluation harness runs the same batches through several methods).

        Args:
            batch: right-padded token rows (``attnstore_client.batch.batch_from_ids``).

        Returns:
            One tensor per row, in batch order.
        """
        start = time.perf_counter()
        counts = BatchCounts()
        hidden = self._prefill.hidden_states(batch, counts)
        self._record(counts, time.perf_counter() - start)
        self.last_row_kinds = tuple(counts.row_kinds)
        return hidden

    def _record(self, counts: BatchCounts, total_s: float) -> None:
        self.last_stats = CacheStats(
            rows=counts.rows, exact_hits=counts.exact_hits, map_hits=counts.map_hits, misses=counts.misses,
            fallbacks=MappingProxyType(dict(counts.fallbacks)), bytes_fetched=counts.bytes_fetched,
            projection_s=counts.projection_s, lookup_s=counts.lookup_s, fetch_s=counts.fetch_s,
            forward_s=counts.forward_s, total_s=total_s,
        )
        self.stats = self.stats + self.last_stats

    def _run(
        self,
        texts: list[str],
        batch_size: int,
        show_progress_bar: bool | None,
        reduce: Callable[[torch.Tensor], torch.Tensor],
    ) -> torch.Tensor:
        """``reduce`` of every text's last hidden states, ``(n, hidden)`` in input order; records the stats."""
        if not texts:
            raise ConfigError("no texts to run: give at least one")
        if batch_size < 1:
            raise ConfigError(f"batch_size must be >= 1, got {batch_size}")
        if show_progress_bar is None:
            show_progress_bar = log.getEffectiveLevel() <= logging.INFO
        start = time.perf_counter()
        tokenizer = self.loaded.tokenizer
        ids = tokenizer(texts, truncation=True, max_length=self.max_length, add_special_tokens=True)["input_ids"]
        # Longest first, as sentence-transformers does: rows of similar length pad little.
        order = sorted(range(len(texts)), key=lambda i: -len(ids[i]))
        out = torch.empty((len(texts), self.adapter.hidden_size))  # (n, hidden)
        counts = BatchCounts()
        kinds = [""] * len(texts)
        for begin in tqdm(range(0, len(order), batch_size), desc="batches", disable=not show_progress_bar):
            chosen = order[begin : begin + batch_size]
            batch = batch_from_ids([ids[i] for i in chosen], tokenizer.pad_token_id)
            for i, hidden in zip(chosen, self._prefill.hidden_states(batch, counts), strict=True):
                out[i] = reduce(hidden)
            for i, kind in zip(chosen, counts.row_kinds[begin:], strict=True):
                kinds[i] = kind
        self._record(counts, time.perf_counter() - start)
        self.last_row_kinds = tuple(kinds)
        return out
