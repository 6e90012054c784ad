"""Write-back: the rows this node computed and the store admitted, sent to the store off the critical path.

``encode`` only puts a row on a bounded queue (its token ids copied, nothing
else: no serialisation, no waiting); one worker thread (``tiers.background``)
takes rows off it in batches, converts them to fp16 and sends them in one
``WriteBack`` call per batch. A row goes with its maps (captured in its own
forward, see ``prefill``) and the feature of its map lookup when it has them,
so the store adds it to the map tier too; the queue's maps are bounded in bytes
(``max_queued_bytes``): past it a row is queued with
its outputs only, and counted. Written-back rows are a
cache's fill, never data: a full queue drops the new row, a failed call (the
daemon unreachable, a refused token) drops its batch, and both are counted, so
write-back can neither block nor fail a call. A refused token (PERMISSION_DENIED)
or a daemon with write-back off turns the worker off with one warning rather
than failing every batch again. A row that could not be stored as it is (its
fp16 outputs or maps not finite) is dropped before sending, so it spoils no
batch. Any other error, a bug included, drops the batch it hit, is logged with
its traceback and counted (``errors``), and the thread goes on: it never dies
with rows still queued, so ``flush()`` always returns.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from attnstore.errors import AttnStoreError, AuthError, ConfigError, WriteBackOffError
from attnstore_client.connection import RefusedRow, RowToWrite, StoreConnection
from attnstore_client.tiers.background import BackgroundSender

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class WriteBackSettings:
    """How a client writes back (see ``AttnCache(write_back=...)``)."""

    max_queued: int = 4096  # rows waiting at most; past it new rows are dropped (counted)
    max_queued_bytes: int = 256 << 20  # maps waiting at most (fp16 bytes); past it rows go without maps (counted)
    # Largest maps of one row sent (fp16 bytes); longer rows go with outputs only. One row is one message:
    # this and its outputs stay under the daemon's default message cap (8 MiB).
    max_row_map_bytes: int = 4 << 20
    batch_rows: int = 256  # rows per WriteBack call at most
    batch_bytes: int = 2 << 20  # fp16 bytes (outputs and maps) per call at most; a bigger row goes alone
    timeout: float = 10.0  # deadline of one WriteBack call, seconds
    # Share of the computed tokens (padded, summed over forwards) that may run in a batch keeping maps:
    # such a batch costs 6.5-8.6% more (MiniLM, one thread), so 0.5 holds capture under 5% of the miss path.
    capture_share: float = 0.5

    def __post_init__(self) -> None:
        for name in ("max_queued", "max_queued_bytes", "max_row_map_bytes", "batch_rows", "batch_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"WriteBackSettings.{name} must be a positive int, got {value!r}")
        if not self.timeout > 0:
            raise ConfigError(f"WriteBackSettings.timeout must be > 0 seconds, got {self.timeout!r}")
        if not 0 <= self.capture_share <= 1:
            raise ConfigError(f"WriteBackSettings.capture_share must be in [0, 1], got {self.capture_share!r}")


@dataclass(frozen=True, slots=True)
class WriteBackStats:
    """What the worker has done since it started."""

    queued: int  # rows put on the queue
    queued_maps: int  # of those, rows queued with their maps
    maps_over_budget: int  # rows whose maps were left out: the queue held max_queued_bytes of maps already
    stored: int  # rows the store added
    maps_stored: int  # of those, rows stored with maps (the map tier)
    duplicates: int  # rows the store had already (another node wrote them first)
    not_admitted: int  # rows the store's admission rule skipped
    dropped_full: int  # rows dropped because the queue was full
    dropped_failed: int  # rows dropped with a failed call (daemon unreachable, refused, an unexpected error)
    dropped_invalid: int  # rows dropped before sending: their fp16 outputs or maps are not finite
    refused: int  # rows the store refused one by one (the rest of their call was stored); the first reason is logged
    errors: int  # batches an unexpected error dropped (logged with its traceback)
    calls: int  # WriteBack calls made
    pending: int  # rows queued or in flight now
    disabled: str | None  # why the worker stopped writing back, or None




@dataclass(frozen=True, slots=True)
class _Queued:
    """A row on the queue, as ``encode`` left it (converted by the worker thread)."""

    token_ids: Sequence[int]  # (L,)
    outputs: np.ndarray | torch.Tensor  # (L, hidden)
    maps: torch.Tensor | None  # (layers, heads, L, L) fp16
    feature: np.ndarray | None  # (feature_dim,)
    projector_version: int


class WriteBackWorker(BackgroundSender[_Queued]):
    """A bounded queue and one thread that writes rows back to ``connection``'s namespace.

    Args:
        connection: the store (it must support write-back).
        namespace: the namespace rows go to.
        fingerprint: the model's fingerprint.
        settings: queue size, batch size, deadline.
    """

    def __init__(
        self, connection: StoreConnection, namespace: str, fingerprint: str, settings: WriteBackSettings
    ) -> None:
        super().__init__(name="attnstore-write-back", max_queued=settings.max_queued,
                         batch_items=settings.batch_rows, batch_bytes=settings.batch_bytes,
                         counts=("queued_maps", "maps_over_budget", "stored", "maps_stored", "duplicates",
                                 "not_admitted", "dropped_invalid", "refused", "errors", "calls",
                                 "pending_map_bytes"))
        self._connection = connection
        self._namespace = namespace
        self._fingerprint = fingerprint
        self.settings = settings
        self._stale_version = 0  # features of projector versions up to this one were refused as stale
        self._refusals_logged: set[str] = set()  # status codes whose first refusal was logged
        self._turned_off = False  # by turn_off: the model no longer computes in fp32
        self._start()

    def put(
        self, token_ids: Sequence[int], outputs: np.ndarray | torch.Tensor, maps: torch.Tensor | None = None,
        feature: np.ndarray | None = None, projector_version: int = 0,
    ) -> bool:
        """Queue one computed row; False when it was dropped. Never blocks.

        Args:
            token_ids: its ``(L,)`` ids, copied here: they may be the caller's own row (``hidden_states(ids)``),
                which it may change once the call returned, before the worker sends them.
            outputs: its ``(L, hidden)`` last hidden states (kept as given: the compute tier hands over a copy).
            maps: its ``(layers, heads, L, L)`` fp16 maps, or None (outputs only).
            feature: the ``(feature_dim,)`` projector output of its map lookup (only with maps), or None.
            projector_version: the namespace's projector version ``feature`` came from.
        """
        map_bytes = 0 if maps is None else 2 * int(maps.numel())
        with self._lock:
            over = map_bytes and self._counts["pending_map_bytes"] + map_bytes > self.settings.max_queued_bytes
        if over:
            maps, feature, map_bytes = None, None, 0
        row = _Queued(np.asarray(token_ids, dtype=np.int64).tolist(), outputs, maps, feature, projector_version)
        return self._offer(row, queued_maps=int(maps is not None), maps_over_budget=int(bool(over)),
                           pending_map_bytes=map_bytes)

    @property
    def turned_off(self) -> bool:
        """Whether ``turn_off`` stopped the worker (the tiers then keep no rows for it)."""
        return self._turned_off

    def turn_off(self, reason: str) -> None:
        """Send what is queued, then take no more rows (a put is dropped, counted); ``reason`` goes to
        ``stats().disabled``."""
        self.close()
        self._turned_off = True
        if self._disabled is None:
            self._disabled = reason

    def stats(self) -> WriteBackStats:
        """The counts so far."""
        counts = self._snapshot()
        del counts["pending_map_bytes"]
        return WriteBackStats(**counts, disabled=self._disabled)

    # ---- the worker thread ------------------------------------------------------

    def _size(self, item: _Queued) -> int:
        return _fp16_bytes(item)

    def _send(self, batch: list[_Queued]) -> None:
        sent = {"pending": -len(batch), "pending_map_bytes": -sum(_map_bytes(row) for row in batch)}
        started = time.perf_counter()
        rows: list[RowToWrite] = []
        try:
            rows = [self._current(row) for row in map(_as_sent, batch) if _finite(row)]  # fp16 numpy, as stored
            sent["dropped_invalid"] = len(batch) - len(rows)
            if not rows:
                self._add(**sent)
                return
            if self._disabled is not None:
                raise WriteBackOffError(self._disabled)
            counts = self._connection.write_back(
                self._namespace, self._fingerprint, rows, timeout=self.settings.timeout
            )
        except (AuthError, WriteBackOffError) as exc:
            if self._disabled is None:
                self._disabled = str(exc)
                log.warning("write-back turned off for namespace %r: %s", self._namespace, exc)
            self._add(dropped_failed=len(rows), calls=1, **sent)
        except AttnStoreError as exc:
            log.info("write-back of %d rows dropped (%.3f s): %s", len(rows), time.perf_counter() - started, exc)
            self._add(dropped_failed=len(rows), calls=1, **sent)
        except Exception:
            # A bug, or a row no check foresaw: the batch is lost, the thread goes on (flush() must return).
            log.exception("write-back of %d rows failed unexpectedly; the batch is dropped", len(batch))
            self._add(dropped_failed=len(batch) - sent.get("dropped_invalid", 0), errors=1, **sent)
        else:
            self._note_refusals(rows, counts.refused)
            self._add(stored=counts.stored, maps_stored=counts.maps_stored, duplicates=counts.duplicates,
                      not_admitted=counts.not_admitted, refused=len(counts.refused), calls=1, **sent)

    def _current(self, row: RowToWrite) -> RowToWrite:
        """The row without its feature when the store refused that projector version as replaced: its maps go
        alone (the store indexes them once it projects them itself), and the row is not refused again."""
        if row.feature is None or row.projector_version > self._stale_version:
            return row
        return RowToWrite(row.token_ids, row.outputs, row.maps, None, 0)

    def _note_refusals(self, rows: Sequence[RowToWrite], refused: Sequence[RefusedRow]) -> None:
        """Log the first refusal of each kind; a projector version refused as stale is not sent again."""
        for refusal in refused:
            if refusal.code == "FAILED_PRECONDITION" and 0 <= refusal.row < len(rows):
                self._stale_version = max(self._stale_version, rows[refusal.row].projector_version)
            if refusal.code not in self._refusals_logged:
                self._refusals_logged.add(refusal.code)
                log.warning("the store refused a written-back row (%s): %s; the other rows were stored (further"
                            " refusals of this kind are counted in stats().refused)", refusal.code, refusal.message)


def _as_sent(row: _Queued) -> RowToWrite:
    """The row with fp16 numpy outputs and maps (what the store keeps and the wire carries)."""
    outputs = row.outputs.cpu().numpy() if isinstance(row.outputs, torch.Tensor) else row.outputs
    maps = None if row.maps is None else row.maps.cpu().numpy()
    return RowToWrite(
        row.token_ids, np.asarray(outputs, dtype=np.float16), None if maps is None else np.asarray(maps, np.float16),
        row.feature, row.projector_version,
    )


def _finite(row: RowToWrite) -> bool:
    """Whether the row's fp16 outputs and maps are all finite (what the store accepts)."""
    if not np.isfinite(row.outputs).all():
        log.warning("a computed row's outputs overflow fp16 (%d tokens); not written back", len(row.token_ids))
        return False
    return row.maps is None or bool(np.isfinite(row.maps).all())


def _map_bytes(row: _Queued) -> int:
    return 0 if row.maps is None else 2 * int(row.maps.numel())


def _fp16_bytes(row: _Queued) -> int:
    return 2 * int(np.prod(row.outputs.shape)) + _map_bytes(row)


def check_write_back_dtype(model: torch.nn.Module) -> None:
    """Refuse write-back from a model not computing in fp32, the dtype every namespace is built in.

    The fingerprint digests the weights as fp32, so a model cast to fp16 or bf16 reads its
    fp32 namespace as its own; what it wrote back would be served to every node as the fp32
    model's outputs.

    Raises:
        ConfigError: the model's weights are not fp32.
    """
    dtype = next(model.parameters()).dtype
    if dtype != torch.float32:
        raise ConfigError(
            f"AttnCache: write_back needs the model in torch.float32, the dtype its namespace is built in; this one"
            f" is {dtype}: what it computes would be served to every node as the float32 model's outputs. Read"
            " with write_back=False, or run the model in float32"
        )


def start_write_back(
    connection: StoreConnection, namespace: str, fingerprint: str, setting: bool | WriteBackSettings
) -> WriteBackWorker | None:
    """The worker ``AttnCache(write_back=setting)`` asks for; None when write-back is off.

    Embedded mode (``local:PATH``) cannot write back: every process opens the
    store on its own, and LMDB takes one writer, so rows go through the daemon.

    Raises:
        ConfigError: write-back asked of a connection that cannot write back (embedded mode).
    """
    if setting is False:
        return None
    if not connection.supports_write_back:
        raise ConfigError(
            f"AttnCache: write_back needs a daemon (grpc:// or grpcs://), not {connection.url}: an embedded"
            " store takes no write-back; serve it with `attnstore serve` and connect with a write token"
        )
    settings = setting if isinstance(setting, WriteBackSettings) else WriteBackSettings()
    log.info("write-back on: namespace %r, up to %d queued rows", namespace, settings.max_queued)
    return WriteBackWorker(connection, namespace, fingerprint, settings)
