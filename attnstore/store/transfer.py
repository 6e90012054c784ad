"""Copy namespaces between two stores of any backends: a Redis store's backup to LMDB, and its restore.

Entry by entry through the store interface (maps, outputs, feature, token
ids), so the two stores need not share a format. The copy is not a snapshot:
entries ingested or deleted while it runs may or may not be in it. Ids are the
target's own (a restore gives new ids; clients hold none across calls), hit
counts start over, and the projector is stored as the target's version 1.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from attnstore.errors import ChecksumError, EntryNotFoundError, NamespaceExistsError
from attnstore.protocol.records import EntryInfo, NewEntry
from attnstore.store.base import MapStoreBase

logger = logging.getLogger(__name__)

BATCH = 64  # entries per ingest call: one all-or-nothing write each


@dataclass(frozen=True, slots=True)
class TransferReport:
    """What a copy copied."""

    namespaces: tuple[str, ...]
    entries: int  # entries written (or found already stored) in the target
    skipped: int  # entries gone or corrupt in the source by the time they were read (verify lists corrupt ones)
    seconds: float


def copy_namespaces(
    source: MapStoreBase, target: MapStoreBase, names: Sequence[str] | None = None, *, batch: int = BATCH
) -> TransferReport:
    """Copy the namespaces ``names`` (default: all) with their projectors and entries from ``source`` to ``target``.

    Raises:
        NamespaceNotFoundError: a name ``source`` does not have.
        NamespaceExistsError: ``target`` has the namespace with another model, fingerprint, layout or projector.
        StoreFullError, UnavailableError: see the target's ``ingest``.
    """
    start = time.perf_counter()
    chosen = [info.name for info in source.list_namespaces()] if names is None else list(names)
    copied = skipped = 0
    for name in chosen:
        info = source.get_namespace(name)
        made = target.create_namespace(name, model=info.model, fingerprint=info.fingerprint, layout=info.layout,
                                       limits=info.limits)
        if info.projector is not None and made.projector != info.projector:
            if made.projector is not None:
                raise NamespaceExistsError(f"the target's namespace {name!r} has another projector: not overwritten")
            target.set_projector(name, info.projector)
        for entries, gone in _batches(source, name, batch):
            skipped += gone
            if entries:
                copied += len(target.ingest(name, entries).entry_ids)
        logger.info("copied namespace %r: %d entries so far", name, copied)
    return TransferReport(tuple(chosen), copied, skipped, time.perf_counter() - start)


def _batches(source: MapStoreBase, name: str, size: int) -> Iterator[tuple[list[NewEntry], int]]:
    """The namespace's entries as NewEntry batches, and how many of each batch could not be read."""
    pending: list[EntryInfo] = []
    for info in source.entries(name):
        pending.append(info)
        if len(pending) == size:
            yield _read(source, name, pending)
            pending = []
    if pending:
        yield _read(source, name, pending)


def _read(source: MapStoreBase, name: str, infos: list[EntryInfo]) -> tuple[list[NewEntry], int]:
    entries = []
    for info in infos:
        try:
            maps = source.read_maps(name, info.id)  # (layers, heads, L, L) fp16
            outputs = source.read_outputs(name, info.id)  # (L, hidden) fp16 or None
        except (EntryNotFoundError, ChecksumError) as exc:
            logger.warning("entry %d of %r not copied: %s", info.id, name, exc)
            continue
        entries.append(NewEntry(maps, info.token_hash, outputs, info.feature, info.token_ids))
    return entries, len(infos) - len(entries)
