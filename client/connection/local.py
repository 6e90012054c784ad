"""Embedded mode: the store and its indexes in this process (``local:PATH``).

Imports the service (faiss, lmdb, zarr) only when a connection is made, so a
client that talks to a daemon never loads them. Maps are read from LMDB one
layer at a time when the forward asks for them: nothing streams, nothing is
copied ahead of use.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from attnstore.errors import AttnStoreError, MapsUnavailableError
from attnstore.protocol.records import LookupBatch
from attnstore_client.connection import Match, NamespaceHandle, Retrieval, StoreConnection
from attnstore_client.connection.base import checked_projector
from attnstore_client.resilience import cause_of

if TYPE_CHECKING:
    from attnstore.service import AttnStoreService, MatchResult


class LocalConnection(StoreConnection):
    """A store opened in this process.

    Args:
        url: the ``local:PATH`` URL, for messages.
        store: the store folder (opened read-only: any number of processes may
            share it, and a build may add to it meanwhile), or an already open
            service (not closed by this connection).

    Raises:
        StoreNotFoundError: no store at the path.
    """

    def __init__(self, url: str, store: Path | AttnStoreService) -> None:
        self.url = url
        if isinstance(store, Path):
            from attnstore.service import AttnStoreService

            self._service = AttnStoreService.open(store, readonly=True)
            self._owned = True
        else:
            self._service, self._owned = store, False

    def namespace(self, name: str) -> NamespaceHandle:
        """See :meth:`StoreConnection.namespace`."""
        info = self._service.get_namespace(name)
        layout = info.layout
        return NamespaceHandle(
            name=info.name, model=info.model, fingerprint=info.fingerprint, layers=layout.layers,
            heads=layout.heads, causal=layout.causal, hidden=layout.hidden, feature_dim=layout.feature_dim,
            projector=checked_projector(info.name, info.projector, info.projector_crc32c),
            projector_version=info.projector_version,
        )

    def lookup(self, batch: LookupBatch, *, timeout: float | None) -> Retrieval:
        """See :meth:`StoreConnection.lookup` (in-process: ``timeout`` does not apply)."""
        from attnstore.service import Query

        hashes = batch.token_hashes if batch.token_hashes is not None else [None] * batch.size
        ids = batch.token_ids if batch.token_ids is not None else [None] * batch.size
        queries = [
            Query(feature=feature, length=int(length), token_hash=token_hash,
                  token_ids=None if row_ids is None else np.asarray(row_ids))
            for feature, length, token_hash, row_ids in zip(batch.features, batch.lengths, hashes, ids, strict=True)
        ]
        results = self._service.lookup(
            batch.namespace, batch.fingerprint, queries, max_distance=batch.max_distance, exact=batch.exact,
            gate=batch.gate, projector_version=batch.projector_version or None,
        )
        return _LocalRetrieval(self._service, batch.namespace, results, batch.lengths)

    def health(self) -> str:
        """``"SERVING"`` while the store's background threads live."""
        return "NOT_SERVING" if self._service.dead_threads() else "SERVING"

    def close(self) -> None:
        """Close the store if this connection opened it."""
        if self._owned:
            self._service.close()


class _LocalRetrieval(Retrieval):
    """Exact rows' outputs read at once; map rows' layers read from the store on demand."""

    def __init__(
        self, service: AttnStoreService, namespace: str, results: list[MatchResult], lengths: Sequence[int]
    ) -> None:
        start = time.perf_counter()
        served = service.read_exact_outputs(namespace, results)
        matches = [Match(r.kind, r.entry_id, r.distance, r.stored_length) for r in served.results]
        outputs = {row: array for row, (_, array) in served.outputs.items()}
        super().__init__(matches, outputs)
        self._failed: dict[int, str] = {}
        self._service = service
        self._namespace = namespace
        self._lengths = lengths
        self.bytes_fetched = sum(array.nbytes for array in outputs.values())
        self.fetch_seconds = time.perf_counter() - start

    def layer(self, row: int, layer: int) -> np.ndarray:
        """See :meth:`Retrieval.layer`."""
        match = self.matches[row]
        if match.kind != "map" or match.entry_id is None:
            raise MapsUnavailableError(f"row {row} is not a map hit", row=row, cause="bad_data")
        if row in self._failed:
            raise MapsUnavailableError(f"row {row}: entry {match.entry_id} failed earlier", row=row,
                                       cause=self._failed[row])
        start = time.perf_counter()
        try:
            maps = self._service.read_layer(self._namespace, match.entry_id, layer, self._lengths[row])  # (H, L, L)
        except AttnStoreError as exc:
            self._failed[row] = cause = "checksum" if cause_of(exc) == "checksum" else "row_error"
            raise MapsUnavailableError(f"row {row}: entry {match.entry_id} layer {layer}: {exc}", row=row,
                                       cause=cause) from exc
        self.bytes_fetched += maps.nbytes
        self.fetch_seconds += time.perf_counter() - start
        return maps

    def failed(self) -> dict[int, str]:
        """See :meth:`Retrieval.failed`."""
        return dict(self._failed)

    def wait(self) -> None:
        """Nothing to wait for: layers are read when asked for."""
