"""Embedded mode: the store and its indexes in this process (``local:PATH``).

Imports the service (faiss, lmdb, zarr) only when a connection is made, so a
client that talks to a daemon never loads them. Maps are read from LMDB one
layer at a time when the forward asks for them: nothing streams, nothing is
copied ahead of use.

LMDB lets a process open an environment once, so every connection to one path
in this process shares one opened store (reference-counted: the last
connection to close it closes it). Several caches, models or namespaces on one
store then work side by side.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import numpy as np

from attnstore.errors import AttnStoreError, ChecksumError, EntryNotFoundError, MapsUnavailableError
from attnstore.protocol.chunks import ChunkLayout
from attnstore.protocol.prefix import PrefixLayout
from attnstore.protocol.records import LookupBatch
from attnstore_client.connection.base import (
    MapStream,
    Match,
    MismatchReport,
    NamespaceHandle,
    PrefixStream,
    StoreConnection,
    checked_projector,
)
from attnstore_client.resilience import cause_of

if TYPE_CHECKING:
    from attnstore.service import AttnStoreService

# Maps read between two drops of the store's mapped pages: a stream of many hits holds at most about this much
# of the store in this process's resident memory.
_DROP_EVERY_BYTES = 64 * 2**20
# Rows of an exact lookup between two drops: their keys' reads map at most 2 x 64 KiB each (32 MiB), and a drop
# costs 1-4 ms (reading /proc/self/maps, advising the store's range): 64 rows a drop took 0.3 s of 8,000 log lines.
_EXACT_ROWS_PER_DROP = 256
# What a damaged or vanished chunk raises (``attnstore.service.ROW_ERRORS``, not imported before a store is opened).
ROW_ERRORS = (ChecksumError, EntryNotFoundError)


class _SharedStores:
    """The stores this process has open, by resolved path, with how many connections use each."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._open: dict[Path, tuple[AttnStoreService, int]] = {}

    def acquire(self, path: Path) -> AttnStoreService:
        """The store at ``path``, opened read-only on first use.

        Raises:
            StoreNotFoundError: no store there.
        """
        from attnstore.service import AttnStoreService

        with self._lock:
            service, users = self._open.get(path) or (AttnStoreService.open(path, readonly=True), 0)
            self._open[path] = (service, users + 1)
            return service

    def release(self, path: Path) -> None:
        """One connection fewer; the last one closes the store."""
        with self._lock:
            service, users = self._open[path]
            if users > 1:
                self._open[path] = (service, users - 1)
                return
            del self._open[path]
        service.close()


# One per process: what LMDB allows is one open environment per path per process.
_SHARED = _SharedStores()


class LocalConnection(StoreConnection):
    """A store opened in this process.

    Args:
        url: the ``local:PATH`` URL, for messages.
        store: the store folder (opened read-only, shared with every other
            connection to it in this process: any number of processes may share
            it too, and a build may add to it meanwhile), or an already open
            service (not closed by this connection).

    Raises:
        StoreNotFoundError: no store at the path.
    """

    def __init__(self, url: str, store: Path | AttnStoreService) -> None:
        self.url = url
        self._path: Path | None = None
        if isinstance(store, Path):
            self._path = store.resolve()
            self._service = _SHARED.acquire(self._path)
        else:
            self._service = store
        self._closed = False

    def namespace(self, name: str) -> NamespaceHandle:
        """See :meth:`StoreConnection.namespace`."""
        info = self._service.get_namespace(name)
        layout = info.layout
        return NamespaceHandle(
            name=info.name, model=info.model, fingerprint=info.fingerprint, layers=layout.layers,
            heads=layout.heads, causal=layout.causal, hidden=layout.hidden, feature_dim=layout.feature_dim,
            projector=checked_projector(info.name, info.projector, info.projector_crc32c),
            projector_version=info.projector_version, prefix=self._service.prefixes.layout(name),
            chunks=self._service.chunks.layout(name),
        )

    def exact(
        self, namespace: str, fingerprint: str, token_hashes: Sequence[bytes], lengths: Sequence[int], *,
        timeout: float | None,
    ) -> dict[int, np.ndarray]:
        """See :meth:`StoreConnection.exact` (in-process: ``timeout`` does not apply)."""
        from attnstore.service import Query

        empty = np.empty(0, dtype=np.float32)
        queries = [
            Query(feature=empty, length=int(length), token_hash=token_hash)
            for token_hash, length in zip(token_hashes, lengths, strict=True)
        ]
        outputs: dict[int, np.ndarray] = {}
        for first in range(0, len(queries), _EXACT_ROWS_PER_DROP):
            part = queries[first : first + _EXACT_ROWS_PER_DROP]
            results = self._service.lookup(namespace, fingerprint, part, max_distance=0.0, maps=False)
            served = self._service.read_exact_outputs(namespace, results)
            outputs.update((first + row, array) for row, (_, array) in served.outputs.items())
            self._service.drop_mapped_pages()  # each key read mapped the pages around it (up to 64 KiB)
        return outputs

    @property
    def supports_quarantine(self) -> bool:
        """An embedded store quarantines in this process's service (every cache of the process shares it)."""
        return True

    def report_mismatch(
        self, namespace: str, fingerprint: str, kind: Literal["row", "prefix", "chunk"], key: bytes, *, detail: str,
        timeout: float | None,
    ) -> MismatchReport:
        """See :meth:`StoreConnection.report_mismatch` (in-process: ``timeout`` does not apply)."""
        reported = self._service.report_mismatch(namespace, fingerprint, kind, key, reporter="embedded",
                                                 detail=detail)
        if reported is None:
            return MismatchReport(False, False, None)
        item, quarantined = reported
        return MismatchReport(True, quarantined, item.writer, item.entry_id)

    def search(self, batch: LookupBatch, *, timeout: float | None) -> list[Match]:
        """See :meth:`StoreConnection.search` (in-process: ``timeout`` does not apply)."""
        from attnstore.service import Query

        ids = batch.token_ids if batch.token_ids is not None else [None] * batch.size
        queries = [
            Query(feature=feature, length=int(length), token_ids=None if row_ids is None else np.asarray(row_ids))
            for feature, length, row_ids in zip(batch.features, batch.lengths, ids, strict=True)
        ]
        results = self._service.lookup(
            batch.namespace, batch.fingerprint, queries, max_distance=batch.max_distance, exact=False,
            gate=batch.gate, projector_version=batch.projector_version or None,
        )
        return [Match(r.kind, r.entry_id, r.distance, r.stored_length) for r in results]

    def fetch_maps(
        self, namespace: str, fingerprint: str, rows: Sequence[tuple[int, int]], *, timeout: float | None
    ) -> MapStream:
        """See :meth:`StoreConnection.fetch_maps`: layers are read from the store when the forward asks."""
        self._service.check_fingerprint(namespace, fingerprint)
        return _LocalMaps(self._service, namespace, list(rows))

    def prefix_layout(self, namespace: str) -> PrefixLayout | None:
        """See :meth:`StoreConnection.prefix_layout` (in-process: the store's record)."""
        return self._service.prefixes.layout(namespace)

    def match_prefix(
        self, namespace: str, fingerprint: str, block_size: int, rows: Sequence[Sequence[bytes]], *,
        timeout: float | None,
    ) -> list[int]:
        """See :meth:`StoreConnection.match_prefix` (in-process: ``timeout`` does not apply)."""
        return self._service.prefixes.matches(namespace, fingerprint, block_size, rows)

    def fetch_prefix(
        self, namespace: str, fingerprint: str, block_size: int, rows: Sequence[Sequence[bytes]], *,
        timeout: float | None,
    ) -> PrefixStream:
        """See :meth:`StoreConnection.fetch_prefix`: each layer is read from the store when the forward asks."""
        self._service.check_fingerprint(namespace, fingerprint)
        return _LocalPrefix(self._service, namespace, block_size, [list(row) for row in rows])

    def match_chunks(
        self, namespace: str, fingerprint: str, layout: ChunkLayout, keys: Sequence[bytes], *, timeout: float | None,
    ) -> list[int | None]:
        """See :meth:`StoreConnection.match_chunks` (in-process: ``timeout`` does not apply)."""
        return self._service.chunks.lengths(namespace, fingerprint, layout, keys)

    def fetch_chunks(
        self, namespace: str, fingerprint: str, layout: ChunkLayout, keys: Sequence[bytes], *, timeout: float | None,
    ) -> list[np.ndarray | AttnStoreError]:
        """See :meth:`StoreConnection.fetch_chunks`: each chunk read from the store, checked, whole."""
        self._service.chunks.check_request(namespace, fingerprint, layout)
        out: list[np.ndarray | AttnStoreError] = []
        for key in keys:
            try:
                out.append(self._service.chunks.read(namespace, key))  # (layers, 2, KVH, C, d)
            except ROW_ERRORS as exc:
                out.append(exc)
        return out

    @property
    def resident_bytes(self) -> int:
        """See :attr:`StoreConnection.resident_bytes`: the store's indexes, every namespace's (shared by every
        connection to the store in this process)."""
        return self._service.index_bytes

    def health(self) -> str:
        """``"SERVING"`` while the store's background threads live."""
        return "NOT_SERVING" if self._service.monitoring.dead_threads() else "SERVING"

    def close(self) -> None:
        """Let go of the store (the last connection to it in this process closes it). Idempotent."""
        if self._path is not None and not self._closed:
            _SHARED.release(self._path)
        self._closed = True


class _LocalMaps(MapStream):
    """Each row's layers read from the store on demand."""

    def __init__(self, service: AttnStoreService, namespace: str, rows: list[tuple[int, int]]) -> None:
        super().__init__()
        self._service = service
        self._namespace = namespace
        self._rows = rows
        self._failed: dict[int, str] = {}
        self._dropped_at = 0  # bytes_fetched when the mapped pages were last given back

    def layer(self, row: int, layer: int) -> np.ndarray:
        """See :meth:`MapStream.layer`."""
        entry_id, length = self._rows[row]
        if row in self._failed:
            raise MapsUnavailableError(f"row {row}: entry {entry_id} failed earlier", row=row, cause=self._failed[row])
        start = time.perf_counter()
        try:
            maps = self._service.read_layer(self._namespace, entry_id, layer, length)  # (H, L, L)
        except AttnStoreError as exc:
            self._failed[row] = cause = "checksum" if cause_of(exc) == "checksum" else "row_error"
            raise MapsUnavailableError(f"row {row}: entry {entry_id} layer {layer}: {exc}", row=row,
                                       cause=cause) from exc
        self.bytes_fetched += maps.nbytes
        if self.bytes_fetched - self._dropped_at >= _DROP_EVERY_BYTES:
            self._drop_pages()
        self.fetch_seconds += time.perf_counter() - start
        return maps

    def failed(self) -> dict[int, str]:
        """See :meth:`MapStream.failed`."""
        return dict(self._failed)

    def wait(self) -> None:
        """Nothing to wait for: layers are read when asked for."""

    def close(self) -> None:
        """Give back the store's pages the reads mapped (``AttnStoreService.drop_mapped_pages``)."""
        self._drop_pages()

    def _drop_pages(self) -> None:
        self._dropped_at = self.bytes_fetched
        self._service.drop_mapped_pages()


class _LocalPrefix(PrefixStream):
    """Each row's prefix read from the store, one layer when the forward reaches it."""

    def __init__(self, service: AttnStoreService, namespace: str, block_size: int, rows: list[list[bytes]]) -> None:
        super().__init__()
        self._service = service
        self._namespace = namespace
        self._block_size = block_size
        self._rows = rows

    def _read(self, row: int, part: int) -> np.ndarray:
        start = time.perf_counter()
        try:
            array = self._service.prefixes.read(self._namespace, self._block_size, self._rows[row], part)
        except AttnStoreError as exc:
            cause = "checksum" if cause_of(exc) == "checksum" else "row_error"
            raise MapsUnavailableError(f"row {row}: prefix part {part}: {exc}", row=row, cause=cause) from exc
        self.bytes_fetched += array.nbytes
        self.fetch_seconds += time.perf_counter() - start
        return array

    def layer(self, row: int, layer: int) -> np.ndarray:
        """See :meth:`PrefixStream.layer`."""
        return self._read(row, layer)

    def hidden(self, row: int) -> np.ndarray:
        """See :meth:`PrefixStream.hidden`."""
        layout = self._service.prefixes.layout(self._namespace)
        assert layout is not None  # the rows were matched against it
        return self._read(row, layout.layers)
