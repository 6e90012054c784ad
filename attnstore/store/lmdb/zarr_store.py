"""A zarr v3 ``Store`` over an LMDB sub-database, so zarr can open a map store.

For inspection with standard tools (``zarr.open_group(store=..., mode="r")``);
the hot read path does not come through here. Each call runs in its own LMDB
transaction on the thread zarr runs it on, and copies the value out before the
transaction ends.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterable
from pathlib import Path

import lmdb
from zarr.abc.store import ByteRequest, OffsetByteRequest, RangeByteRequest, Store, SuffixByteRequest
from zarr.core.buffer import Buffer, BufferPrototype, default_buffer_prototype

from attnstore.store.lmdb.env import DbHandle, Generation, read_current


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
    """

    supports_listing: bool = True

    def __init__(
        self, env: lmdb.Environment, db: DbHandle, *, read_only: bool = True, on_close: Callable[[], None] | None = None
    ) -> None:
        super().__init__(read_only=read_only)
        self._env = env
        self._db = db
        self._on_close = on_close

    @classmethod
    def open_path(cls, path: str | Path) -> LMDBZarrStore:
        """A read-only zarr store over the live generation of the map store at ``path``.

        Use this from a process that does not have the store open (an LMDB
        environment opens once per process); in-process use ``MapStore.zarr_store()``.

        Raises:
            StoreNotFoundError: no map store at ``path``.
            StoreOpenError: the generation cannot be opened.
        """
        root = Path(path)
        gen = Generation(root, read_current(root), map_size=1 << 40, readonly=True, create=False)
        return cls(gen.env, gen.db.zarr, read_only=True, on_close=gen.release)

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
        return LMDBZarrStore(self._env, self._db, read_only=read_only)

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
        with self._env.begin(db=self._db, buffers=True) as txn:
            value = txn.get(key.encode())
            if value is None:
                return None
            data = bytes(value[_slice(len(value), byte_range)])
        return prototype.buffer.from_bytes(data)

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
        with self._env.begin(db=self._db, buffers=True) as txn:
            return txn.get(key.encode()) is not None

    async def getsize(self, key: str) -> int:
        """Size of the value of ``key`` in bytes.

        Raises:
            FileNotFoundError: ``key`` is absent.
        """
        with self._env.begin(db=self._db, buffers=True) as txn:
            value = txn.get(key.encode())
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
        with self._env.begin(db=self._db, buffers=True) as txn, txn.cursor() as cursor:
            if cursor.set_range(raw_prefix):
                for raw_key in cursor.iternext(keys=True, values=False):
                    key = bytes(raw_key)
                    if not key.startswith(raw_prefix):
                        break
                    keys.append(key.decode())
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
