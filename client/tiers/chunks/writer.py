"""Write-back of chunks: the chunks this node computed, sent to the store off the critical path.

The chunk tier computes a chunk its source lacks (``chunks_captured``) and puts
it; where write-back is on, ``StoreChunkSource.put`` hands it to a
``ChunkWriter``: a bounded queue (no copy, no waiting) and one thread that sends
what waits in ``PutChunks`` calls of at most ``batch_bytes``. Like rows written
back (``tiers.write_back``), chunks are a cache's fill, never data: a full queue
drops the new chunk, a failed call drops its batch, a refused one (another
layout, a bad chunk) counts its chunks as refused, and a refused token or a
store that takes no chunks turns the writer off with one warning. Nothing here
can block or fail a call.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass

from attnstore.errors import AttnStoreError, AuthError, ConfigError, WriteBackOffError
from attnstore.protocol.chunks import ChunkLayout, StoredChunk
from attnstore_client.connection import StoreConnection

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
    dropped_full: int  # chunks dropped because the queue was full
    dropped_failed: int  # chunks dropped with a failed call (store unreachable, writer off)
    refused: int  # chunks of calls the store refused (another chunk layout, a bad chunk)
    disabled: str | None  # why the writer turned itself off, if it did


class ChunkWriter:
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
        self._connection, self._namespace, self._fingerprint = connection, namespace, fingerprint
        self._layout = layout
        self.settings = settings
        self._queue: queue.Queue[StoredChunk | None] = queue.Queue(maxsize=settings.max_queued)  # None: stop
        self._idle = threading.Condition()
        self._counts = dict.fromkeys(("queued", "stored", "duplicates", "dropped_full", "dropped_failed",
                                      "refused", "pending"), 0)
        self._disabled: str | None = None
        self._thread = threading.Thread(target=self._run, name="attnstore-chunk-writer", daemon=True)
        self._thread.start()

    def put(self, chunk: StoredChunk) -> bool:
        """Queue one chunk; False when it was dropped. Never blocks."""
        if self._disabled is not None:
            self._add(dropped_failed=1)
            return False
        try:
            self._queue.put_nowait(chunk)
        except queue.Full:
            self._add(dropped_full=1)
            return False
        self._add(queued=1, pending=1)
        return True

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued chunk was sent (or dropped); False on timeout, or if the thread is gone."""
        with self._idle:
            done = self._idle.wait_for(lambda: self._counts["pending"] == 0 or not self._thread.is_alive(), timeout)
            return done and self._counts["pending"] == 0

    def stats(self) -> ChunkWriterStats:
        """The counts so far."""
        with self._idle:
            counts = {k: n for k, n in self._counts.items() if k != "pending"}
            return ChunkWriterStats(**counts, disabled=self._disabled)

    def close(self, timeout: float = 5.0) -> None:
        """Send what is queued (up to ``timeout`` seconds), then stop the thread."""
        self.flush(timeout)
        try:
            self._queue.put(None, timeout=timeout)
        except queue.Full:
            return  # the thread is stuck in a call: it is a daemon thread, and dies with the process
        self._thread.join(timeout)

    def _add(self, **deltas: int) -> None:
        with self._idle:
            for key, n in deltas.items():
                self._counts[key] += n
            if self._counts["pending"] == 0:
                self._idle.notify_all()

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            batch, nbytes = [item], item.kv.nbytes
            while nbytes < self.settings.batch_bytes:  # what else waits, up to one call's worth
                try:
                    more = self._queue.get_nowait()
                except queue.Empty:
                    break
                if more is None:
                    self._send(batch)
                    return
                if nbytes + more.kv.nbytes > self.settings.batch_bytes:
                    self._send(batch)
                    batch, nbytes = [], 0
                batch.append(more)
                nbytes += more.kv.nbytes
            self._send(batch)

    def _send(self, batch: list[StoredChunk]) -> None:
        done = {"pending": -len(batch)}
        try:
            if self._disabled is not None:
                done["dropped_failed"] = len(batch)
                return
            counts = self._connection.put_chunks(self._namespace, self._fingerprint, self._layout(), batch,
                                                 timeout=self.settings.timeout)
            done |= {"stored": counts.stored, "duplicates": counts.duplicates}
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
