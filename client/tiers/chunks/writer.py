"""Write-back of chunks: the chunks this node computed, sent to the store off the critical path.

The chunk tier computes a chunk its source lacks (``chunks_captured``) and puts
it; where write-back is on, ``StoreChunkSource.put`` hands it to a
``ChunkWriter``: a bounded queue (no copy, no waiting) and one thread that sends
what waits in ``PutChunks`` calls of at most ``batch_bytes`` (``tiers.background``). Like rows written
back (``tiers.write_back``), chunks are a cache's fill, never data: a full queue
drops the new chunk, a failed call drops its batch, a refused one (another
layout, a bad chunk) counts its chunks as refused, and a refused token or a
store that takes no chunks turns the writer off with one warning. Nothing here
can block or fail a call.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

from attnstore.errors import AttnStoreError, AuthError, ConfigError, WriteBackOffError
from attnstore.protocol.chunks import ChunkLayout, StoredChunk
from attnstore_client.connection import StoreConnection
from attnstore_client.tiers.background import BackgroundSender

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ChunkWriterSettings:
    """How computed chunks are written back."""

    max_queued: int = 1024  # chunks waiting at most; past it new ones are dropped (counted)
    # Bytes of one PutChunks call at most: under the daemon's default message cap (8 MiB); a larger chunk goes alone.
    batch_bytes: int = 4 << 20
    timeout: float = 10.0  # deadline of one PutChunks call, seconds

    def __post_init__(self) -> None:
        if self.max_queued < 1 or self.batch_bytes < 1 or not self.timeout > 0:
            raise ConfigError(f"ChunkWriterSettings: sizes and timeout must be positive, got {self}")


@dataclass(frozen=True, slots=True)
class ChunkWriterStats:
    """What the writer has done since it started."""

    queued: int  # chunks put on the queue
    stored: int  # chunks the store added
    duplicates: int  # chunks it had already (another node was first)
    not_admitted: int  # chunks the store skipped: not asked for by --admit-after writers yet
    dropped_full: int  # chunks dropped because the queue was full
    dropped_failed: int  # chunks dropped with a failed call (store unreachable, writer off)
    refused: int  # chunks of calls the store refused (another chunk layout, a bad chunk)
    disabled: str | None  # why the writer turned itself off, if it did


class ChunkWriter(BackgroundSender[StoredChunk]):
    """A bounded queue and one thread that puts chunks in ``connection``'s namespace.

    Args:
        connection: the store (it must take chunks: a daemon and a write token).
        namespace, fingerprint: where chunks go, and the model's fingerprint.
        layout: the layout chunks are sent in (the namespace's, or the model's where it has none yet).
        settings: queue size, call size, deadline.
    """

    def __init__(
        self, connection: StoreConnection, namespace: str, fingerprint: str, layout: Callable[[], ChunkLayout],
        settings: ChunkWriterSettings = ChunkWriterSettings(),
    ) -> None:
        super().__init__(name="attnstore-chunk-writer", max_queued=settings.max_queued,
                         batch_items=settings.max_queued, batch_bytes=settings.batch_bytes,
                         counts=("stored", "duplicates", "not_admitted", "refused"))
        self._connection, self._namespace, self._fingerprint = connection, namespace, fingerprint
        self._layout = layout
        self.settings = settings
        self._start()

    def put(self, chunk: StoredChunk) -> bool:
        """Queue one chunk; False when it was dropped. Never blocks."""
        return self._offer(chunk)

    def stats(self) -> ChunkWriterStats:
        """The counts so far."""
        counts = self._snapshot()
        del counts["pending"]
        return ChunkWriterStats(**counts, disabled=self._disabled)

    def _size(self, item: StoredChunk) -> int:
        return item.kv.nbytes

    def _send(self, batch: list[StoredChunk]) -> None:
        done = {"pending": -len(batch)}
        try:
            if self._disabled is not None:
                done["dropped_failed"] = len(batch)
                return
            counts = self._connection.put_chunks(self._namespace, self._fingerprint, self._layout(), batch,
                                                 timeout=self.settings.timeout)
            done |= {"stored": counts.stored, "duplicates": counts.duplicates, "not_admitted": counts.not_admitted}
        except (AuthError, WriteBackOffError) as exc:
            self._disabled = str(exc)
            done["dropped_failed"] = len(batch)
            log.warning("chunk write-back off for namespace %r: %s", self._namespace, exc)
        except AttnStoreError as exc:
            refused = not isinstance(exc, ConnectionError)  # an outage drops the batch; anything else refused it
            done["refused" if refused else "dropped_failed"] = len(batch)
            log.warning("chunk write-back of %d chunks %s: %s", len(batch), "refused" if refused else "failed", exc)
        except Exception:
            done["dropped_failed"] = len(batch)
            log.exception("chunk write-back of %d chunks failed unexpectedly", len(batch))
        finally:
            self._add(**done)
