"""A zarr v3 ``Store`` over an LMDB sub-database, so zarr can open a map store.

For inspection with standard tools (:func:`attnstore.store.open_zarr`, or
``zarr.open_group(store=..., mode="r")``); the hot read path does not come
through here. Each call runs in its own LMDB transaction on the thread zarr runs
it on, and copies the value out before the transaction ends.

Slots: ``<ns>/maps/L<L>`` holds entry ``N`` of length ``L`` at some slot, and
unused slots (never filled, or deleted) read as zeros. So that zarr alone can
find an entry, the store also shows, read-only and computed from the entry
records at read time (nothing of it is stored), one array per bucket::

    <ns>/entry_ids/L<L>      uint64 (capacity,): the entry id in each slot, 0 for an unused slot
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterator, Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING

import lmdb
import numpy as np
from zarr.abc.store import ByteRequest, OffsetByteRequest, RangeByteRequest, Store, SuffixByteRequest
from zarr.core.buffer import Buffer, BufferPrototype, default_buffer_prototype

from attnstore.store.entry_record import EntryRecord
from attnstore.store.lmdb.env import Databases, DbHandle, Generation, read_current
from attnstore.store.lmdb.records import BucketRecord, bucket_key, entry_key, split_length_key
from attnstore.store.zarr_layout import group_metadata, slot_ids_metadata

if TYPE_CHECKING:
    import zarr

SLOTS_ARRAY = "entry_ids"
_SLOTS_GROUP_RE = re.compile(rf"^(?P<ns>[^/]+)/{SLOTS_ARRAY}/zarr\.json$")
_SLOTS_NODE_RE = re.compile(rf"^(?P<ns>[^/]+)/{SLOTS_ARRAY}/L(?P<length>\d+)/(?P<leaf>zarr\.json|c/0)$")


class _SlotArrays:
    """The computed ``<ns>/entry_ids/L<L>`` arrays (see the module docstring), over one generation's records."""

    def __init__(self, db: Databases) -> None:
        self._db = db

    def buckets(self, txn: lmdb.Transaction) -> list[tuple[str, int, int]]:
        """``(namespace, length, capacity)`` of every length bucket."""
        found = []
        with txn.cursor(db=self._db.buckets) as cursor:
            for raw_key, raw_value in cursor:
                key = bytes(raw_key)  # namespace NUL length(4)
                capacity = BucketRecord.from_bytes(raw_value).capacity
                found.append((key[:-5].decode(), int.from_bytes(key[-4:], "big"), capacity))
        return found

    def keys(self, txn: lmdb.Transaction) -> list[str]:
        """Every computed key."""
        keys: set[str] = set()
        for namespace, length, _ in self.buckets(txn):
            base = f"{namespace}/{SLOTS_ARRAY}"
            keys.update((f"{base}/zarr.json", f"{base}/L{length}/zarr.json", f"{base}/L{length}/c/0"))
        return sorted(keys)

    def get(self, txn: lmdb.Transaction, key: str) -> bytes | None:
        """The value of computed ``key``, or None when it is not one."""
        group = _SLOTS_GROUP_RE.match(key)
        if group is not None:
            if not any(ns == group["ns"] for ns, _, _ in self.buckets(txn)):
                return None
            return group_metadata({"description": "per length bucket: the entry id in each slot of maps/L<L>"})
        node = _SLOTS_NODE_RE.match(key)
        if node is None:
            return None
        namespace, length = node["ns"], int(node["length"])
        raw = txn.get(bucket_key(namespace, length), db=self._db.buckets)
        if raw is None:
            return None
        capacity = BucketRecord.from_bytes(raw).capacity
        if node["leaf"] == "zarr.json":
            return self._metadata(length, capacity)
        ids = np.zeros(capacity, dtype="<u8")  # (capacity,)
        prefix = bucket_key(namespace, length)
        with txn.cursor(db=self._db.lengths) as cursor:
            if cursor.set_range(prefix):
                for raw_key in cursor.iternext(keys=True, values=False):
                    if not bytes(raw_key).startswith(prefix):
                        break
                    _, entry_id = split_length_key(raw_key)
                    record = txn.get(entry_key(namespace, entry_id), db=self._db.entries)
                    if record is not None:
                        ids[EntryRecord.from_bytes(record).slot] = entry_id
        return ids.tobytes()

    @staticmethod
    def _metadata(length: int, capacity: int) -> bytes:
        return slot_ids_metadata(length, capacity)


def _slice(size: int, byte_range: ByteRequest | None) -> slice:
    if byte_range is None:
        return slice(0, size)
    if isinstance(byte_range, RangeByteRequest):
        return slice(byte_range.start, byte_range.end)
    if isinstance(byte_range, OffsetByteRequest):
        return slice(byte_range.offset, size)
    if isinstance(byte_range, SuffixByteRequest):
        return slice(max(0, size - byte_range.suffix), size)
    raise TypeError(f"LMDBZarrStore.get(): unexpected byte_range {byte_range!r}")


class LMDBZarrStore(Store):
    """zarr ``Store`` whose keys and values live in one LMDB sub-database.

    Args:
        env: an open LMDB environment.
        db: the sub-database handle holding the zarr keys.
        read_only: refuse writes (the map store writes its own keys).
        on_close: called once by :meth:`close` (releases the environment's owner).
        records: the map store's databases in ``env``: with them the store also
            shows the computed ``entry_ids`` arrays (see the module docstring).
    """

    supports_listing: bool = True

    def __init__(
        self,
        env: lmdb.Environment,
        db: DbHandle,
        *,
        read_only: bool = True,
        on_close: Callable[[], None] | None = None,
        records: Databases | None = None,
    ) -> None:
        super().__init__(read_only=read_only)
        self._env = env
        self._db = db
        self._on_close = on_close
        self._records = records
        self._slots = _SlotArrays(records) if records is not None else None

    @classmethod
    def open_path(cls, path: str | Path) -> LMDBZarrStore:
        """A read-only zarr store over the live generation of the map store at ``path``.

        Use this from a process that does not have the store open (an LMDB
        environment opens once per process); in-process use ``LmdbMapStore.zarr_store()``.

        Raises:
            StoreNotFoundError: no map store at ``path``.
            StoreOpenError: the generation cannot be opened.
        """
        root = Path(path)
        gen = Generation(root, read_current(root), map_size=1 << 40, readonly=True, create=False)
        return cls(gen.env, gen.db.zarr, read_only=True, on_close=gen.release, records=gen.db)

    @property
    def supports_writes(self) -> bool:
        """Writes are supported unless read-only."""
        return not self.read_only

    @property
    def supports_deletes(self) -> bool:
        """Deletes are supported unless read-only."""
        return not self.read_only

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, LMDBZarrStore)
            and other._env is self._env
            and other._db is self._db
            and other.read_only == self.read_only
        )

    def __hash__(self) -> int:
        return hash((id(self._env), id(self._db), self.read_only))

    def __repr__(self) -> str:
        return f"LMDBZarrStore({self._env.path()!r}, read_only={self.read_only})"

    def with_read_only(self, read_only: bool = False) -> LMDBZarrStore:
        """The same database with another read-only setting (not closing anything on close)."""
        return LMDBZarrStore(self._env, self._db, read_only=read_only, records=self._records)

    def close(self) -> None:
        """Close the store and release the environment's owner (once)."""
        super().close()
        if self._on_close is not None:
            on_close, self._on_close = self._on_close, None
            on_close()

    def get_sync(
        self, key: str, *, prototype: BufferPrototype | None = None, byte_range: ByteRequest | None = None
    ) -> Buffer | None:
        """Value of ``key`` (or a byte range of it), or None if absent."""
        prototype = prototype or default_buffer_prototype()
        value = self._value(key)
        if value is None:
            return None
        return prototype.buffer.from_bytes(value[_slice(len(value), byte_range)])

    def _value(self, key: str) -> bytes | None:
        with self._env.begin(db=self._db, buffers=True) as txn:
            value = txn.get(key.encode())
            if value is not None:
                return bytes(value)
            return None if self._slots is None else self._slots.get(txn, key)

    async def get(
        self, key: str, prototype: BufferPrototype, byte_range: ByteRequest | None = None
    ) -> Buffer | None:
        """Value of ``key`` (or a byte range of it), or None if absent."""
        return self.get_sync(key, prototype=prototype, byte_range=byte_range)

    async def get_partial_values(
        self, prototype: BufferPrototype, key_ranges: Iterable[tuple[str, ByteRequest | None]]
    ) -> list[Buffer | None]:
        """Values of several (key, byte range) pairs, in order."""
        return [self.get_sync(key, prototype=prototype, byte_range=byte_range) for key, byte_range in key_ranges]

    async def exists(self, key: str) -> bool:
        """True if ``key`` is present."""
        return self._value(key) is not None

    async def getsize(self, key: str) -> int:
        """Size of the value of ``key`` in bytes.

        Raises:
            FileNotFoundError: ``key`` is absent.
        """
        value = self._value(key)
        if value is None:
            raise FileNotFoundError(key)
        return len(value)

    async def set(self, key: str, value: Buffer) -> None:
        """Store ``value`` under ``key``.

        Raises:
            ValueError: the store is read-only.
            TypeError: ``value`` is not a zarr Buffer.
        """
        self._check_writable()
        if not isinstance(value, Buffer):
            raise TypeError(f"LMDBZarrStore.set(): `value` must be a Buffer instance, got {type(value).__name__}")
        with self._env.begin(db=self._db, write=True) as txn:
            txn.put(key.encode(), value.to_bytes())

    async def delete(self, key: str) -> None:
        """Remove ``key`` if present.

        Raises:
            ValueError: the store is read-only.
        """
        self._check_writable()
        with self._env.begin(db=self._db, write=True) as txn:
            txn.delete(key.encode())

    def _keys(self, prefix: str) -> list[str]:
        # Collected in one transaction; none stays open across an await.
        raw_prefix = prefix.encode()
        keys = []
        with self._env.begin(db=self._db, buffers=True) as txn:
            with txn.cursor() as cursor:
                if cursor.set_range(raw_prefix):
                    for raw_key in cursor.iternext(keys=True, values=False):
                        key = bytes(raw_key)
                        if not key.startswith(raw_prefix):
                            break
                        keys.append(key.decode())
            if self._slots is not None:
                keys = sorted(keys + [key for key in self._slots.keys(txn) if key.startswith(prefix)])
        return keys

    async def list(self) -> AsyncIterator[str]:
        """Every key."""
        for key in self._keys(""):
            yield key

    async def list_prefix(self, prefix: str) -> AsyncIterator[str]:
        """Every key starting with ``prefix``."""
        for key in self._keys(prefix):
            yield key

    async def list_dir(self, prefix: str) -> AsyncIterator[str]:
        """Names directly under ``prefix`` (keys and pseudo-directories)."""
        prefix = prefix.rstrip("/")
        base = prefix + "/" if prefix else ""
        seen: set[str] = set()
        for key in self._keys(base):
            name = key[len(base) :].split("/", 1)[0]
            if name and name not in seen:
                seen.add(name)
                yield name


def open_zarr(path: str | Path) -> zarr.Group:
    """The map store at ``path`` as a read-only zarr group (its live generation).

    ``zarr.open_group(path)`` cannot open the directory itself: the hierarchy lives
    in LMDB. Entry ``N`` of length ``L`` is at the slot where
    ``group[f"{ns}/entry_ids/L{L}"][:] == N``, in ``group[f"{ns}/maps/L{L}"]``.
    Close ``group.store`` when done: it holds the generation open. Use it from a
    process that does not have the store open (an LMDB environment opens once per
    process); in-process, open ``LmdbMapStore.zarr_store()`` with zarr instead.

    Raises:
        StoreNotFoundError: no map store at ``path``.
        StoreOpenError: the generation cannot be opened.
    """
    import zarr

    store = LMDBZarrStore.open_path(path)
    try:
        return zarr.open_group(store=store, mode="r")
    except BaseException:
        store.close()
        raise
