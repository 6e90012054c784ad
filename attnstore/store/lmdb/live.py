"""A store's live generation: creating and opening it, following compactions, and transactions on it.

Every LMDB error a store call meets is translated here into an AttnStore error
(``StoreFullError`` when the map or the disk is full, ``StoreDamagedError`` when
LMDB finds its own structure damaged, ``StorageError`` for the rest), so none
escapes untranslated. Messages never name the store's path (they may reach
clients of a daemon); the log does.

Damage and a store directory removed under an open store are remembered as the
store's *fault* (``LiveGeneration.fault``): the daemon then reports NOT_SERVING,
and writes to a removed directory are refused (they would land in unlinked files).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import lmdb

from attnstore.errors import (
    AttnStoreError,
    ConfigError,
    FormatVersionError,
    ReadOnlyStoreError,
    StorageError,
    StoreDamagedError,
    StoreFullError,
    StoreNotFoundError,
    StoreOpenError,
)
from attnstore.protocol.records import FORMAT_VERSION, SUPPORTED_FORMAT_VERSIONS
from attnstore.store.lmdb.env import (
    CURRENT_FILE,
    Generation,
    acquire_writer_lock,
    current_signature,
    disk_full_error,
    is_disk_full,
    is_map_full,
    next_generation_name,
    read_current,
    release_lock,
    remove_unused_generations,
    write_current,
)
from attnstore.store.lmdb.records import META_NEXT_ID, write_counter
from attnstore.store.lmdb.settings import StoreSettings
from attnstore.store.zarr_layout import group_metadata, root_group_key

logger = logging.getLogger(__name__)

META_FORMAT_VERSION = b"format_version"
META_CREATED = b"created"

# LMDB errors that mean its own structure is damaged (a page of the wrong kind, a page number past
# the end, a failed consistency check): no retry helps; the store needs restoring.
_DAMAGE_ERRORS: tuple[type[lmdb.Error], ...] = (
    lmdb.CorruptedError, lmdb.PageNotFoundError, lmdb.PanicError, lmdb.InvalidError,
)


def translate_lmdb_error(exc: lmdb.Error, root: Path, map_size: int) -> AttnStoreError:
    """The AttnStore error an LMDB error under the store at ``root`` stands for (details go to the log)."""
    if is_map_full(exc):
        logger.warning("map store %s: its map of %s bytes is full", root, map_size)
        return StoreFullError(
            f"the map store is full (its map size of {map_size} bytes is used up): nothing of the failed write is"
            " visible. Restart with a larger map size, or compact first (a full map has no free page even for a"
            " delete), then delete entries and compact"
        )
    if is_disk_full(exc, root):
        return disk_full_error(root)
    logger.error("map store %s: LMDB error %r", root, exc)
    if isinstance(exc, _DAMAGE_ERRORS):
        return StoreDamagedError(
            f"the map store's database is damaged ({type(exc).__name__}: {exc}): restore it from a backup;"
            " admin verify lists what can still be reached"
        )
    return StorageError(f"the map store's storage failed ({type(exc).__name__}); see the daemon log")


def check_store_format(gen: Generation) -> None:
    """Refuse a generation this code cannot read.

    Raises:
        FormatVersionError: no format version recorded, or an unknown one.
        StorageError: the generation's database cannot be read (damaged).
    """
    try:
        with gen.env.begin() as txn:
            raw = txn.get(META_FORMAT_VERSION, db=gen.db.meta)
    except lmdb.Error as exc:
        raise translate_lmdb_error(exc, gen.path.parent, 0) from exc
    if raw is None:
        raise FormatVersionError(f"{gen.path} has no format version: not an AttnStore map store")
    try:
        version = int(bytes(raw))
    except ValueError:
        raise StoreDamagedError(f"the map store's format version record {bytes(raw)!r:.40} is damaged") from None
    if version not in SUPPORTED_FORMAT_VERSIONS:
        raise FormatVersionError(
            f"map store {gen.path} is in format version {version}; this code reads versions"
            f" {sorted(SUPPORTED_FORMAT_VERSIONS)}"
        )


def create_store(root: Path, settings: StoreSettings) -> Generation:
    """Create the first generation of a new store at ``root`` and make it live.

    Entry ids start at 1 (0 stays free to mean "no entry" on the wire).
    """
    gen = Generation(root, next_generation_name(root), map_size=settings.map_size, readonly=False, create=True)
    try:
        with gen.env.begin(write=True) as txn:
            txn.put(META_FORMAT_VERSION, str(FORMAT_VERSION).encode(), db=gen.db.meta)
            txn.put(META_CREATED, repr(time.time()).encode(), db=gen.db.meta)
            write_counter(txn, gen.db, META_NEXT_ID, 1)
            txn.put(root_group_key(), group_metadata({"attnstore_format_version": FORMAT_VERSION}), db=gen.db.zarr)
        gen.env.sync(True)
        write_current(root, gen.name)
    except BaseException:
        gen.release()
        raise
    logger.info("created map store %s (%s)", root, gen.name)
    return gen


def open_live(root: Path, settings: StoreSettings) -> Generation:
    """Open the live generation of the store at ``root``.

    Raises:
        StoreNotFoundError: no store at ``root``.
        StoreOpenError: the generation cannot be opened.
        FormatVersionError: see :func:`check_store_format`.
    """
    for _ in range(3):
        name = read_current(root)
        try:
            gen = Generation(root, name, map_size=settings.map_size, readonly=settings.readonly, create=False)
        except StoreOpenError:
            if read_current(root) != name:
                continue  # a compaction swapped generations meanwhile: open the new one
            raise
        try:
            check_store_format(gen)
        except BaseException:
            gen.release()
            raise
        return gen
    raise StoreOpenError(f"map store {root} keeps changing generation; retry later")


class LiveGeneration:
    """The generation a store's calls read and write now.

    A read-only store follows the writer's compactions (it reopens when CURRENT
    changes); the writer swaps in the generation its compaction wrote. Writes
    are serialised by ``write_lock``, which compaction holds too.

    Open one with :meth:`open`.

    Args:
        root: the store directory.
        gen: the live generation, opened (its reference passes to this object).
        settings: the store's settings.
        writer_fd: the writer lock of a writable store (released on close).
    """

    def __init__(self, root: Path, gen: Generation, settings: StoreSettings, writer_fd: int | None) -> None:
        self._root = root
        self._gen = gen
        self._settings = settings
        self._writer_fd = writer_fd
        self._lock = threading.Lock()
        self.write_lock = threading.RLock()
        self._signature = current_signature(root)
        self._closed = False
        self._damage: str | None = None  # the first damage LMDB reported (see ``fault``)

    @classmethod
    def open(cls, root: Path, settings: StoreSettings, *, create: bool) -> LiveGeneration:
        """Open (or create) the store in directory ``root``; a writable store takes the writer lock.

        Raises:
            StoreNotFoundError: no store at ``root`` and ``create`` is False.
            StoreOpenError: another writer holds the store, or this process has it open.
            FormatVersionError: the store is in a format version this code does not read.
            StorageError: its database cannot be read.
            ConfigError: ``create`` on a read-only store.
        """
        if settings.readonly and create:
            raise ConfigError("LmdbMapStore.open(): create=True and readonly=True exclude each other")
        if not (root / CURRENT_FILE).exists() and not create:
            raise StoreNotFoundError(f"no map store at {root} (no {CURRENT_FILE} file); pass create=True to make one")
        writer_fd = None
        if not settings.readonly:
            root.mkdir(parents=True, exist_ok=True)
            writer_fd = acquire_writer_lock(root)
        try:
            gen = open_live(root, settings) if (root / CURRENT_FILE).exists() else create_store(root, settings)
            if writer_fd is not None:
                remove_unused_generations(root, keep=gen.name)
        except BaseException:
            if writer_fd is not None:
                release_lock(writer_fd)
            raise
        return cls(root, gen, settings, writer_fd)

    @property
    def root(self) -> Path:
        """The store directory."""
        return self._root

    @property
    def name(self) -> str:
        """Name of the live generation."""
        return self._gen.name

    def acquire(self) -> Generation:
        """A reference to the live generation (release it when done).

        Raises:
            StoreOpenError: the store is closed.
        """
        with self._lock:
            if self._closed:
                raise StoreOpenError("the map store is closed")
            if self._settings.readonly:
                self._follow_current()
            return self._gen.acquire()

    @contextmanager
    def held(self) -> Iterator[Generation]:
        """The live generation, held for a whole-generation job (verify, compaction, a zarr view)."""
        gen = self.acquire()
        try:
            yield gen
        except lmdb.Error as exc:
            raise self.translate(exc) from exc
        finally:
            gen.release()

    @contextmanager
    def read(self) -> Iterator[tuple[Generation, lmdb.Transaction[memoryview]]]:
        """A read transaction (zero-copy buffers) on the live generation."""
        with self.held() as gen, gen.env.begin(buffers=True) as txn:
            yield gen, txn

    @contextmanager
    def write(self) -> Iterator[tuple[Generation, lmdb.Transaction[bytes]]]:
        """A write transaction on the live generation; all-or-nothing.

        Raises:
            ReadOnlyStoreError: the store is read-only.
            StoreNotFoundError: the store's directory was removed (see :meth:`check_present`).
            StoreFullError, StorageError: see :meth:`translate`.
        """
        self.check_writable()
        with self.write_lock:
            self.check_present()
            with self.held() as gen, gen.env.begin(write=True) as txn:
                yield gen, txn

    def check_writable(self) -> None:
        """Raise ReadOnlyStoreError on a read-only store."""
        if self._settings.readonly:
            raise ReadOnlyStoreError("the map store is open read-only: writes go to the process that writes it")

    def check_present(self) -> None:
        """Refuse a write when the store's directory was removed while open: it would go to unlinked files.

        Raises:
            StoreNotFoundError: the live generation's directory is gone.
        """
        if self._gen.removed():
            logger.error("map store %s: its directory was removed while open; writes are refused", self._root)
            raise StoreNotFoundError(
                "the map store's directory was removed while it was open: writes are refused (reads serve what"
                " was open). Restore the store and restart"
            )

    def fault(self) -> str | None:
        """Why this store's storage can no longer be trusted, or None: its directory removed, or LMDB damage."""
        if self._gen.removed():
            return "the store directory was removed while open"
        if self._damage is not None:
            return f"the database is damaged ({self._damage})"
        return None

    def swap(self, new: Generation) -> Generation:
        """Make ``new`` (just written by a compaction, already CURRENT) live; returns the retired one."""
        with self._lock:
            retired, self._gen = self._gen, new
            self._signature = current_signature(self._root)
        return retired

    def close(self) -> None:
        """Release the live generation and the writer lock; later calls raise StoreOpenError. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._gen.release()
        if self._writer_fd is not None:
            release_lock(self._writer_fd)
            self._writer_fd = None

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` ran."""
        return self._closed

    def translate(self, exc: lmdb.Error) -> AttnStoreError:
        """The AttnStore error an LMDB error stands for (see :func:`translate_lmdb_error`); remembers damage."""
        error = translate_lmdb_error(exc, self._root, self._settings.map_size)
        if isinstance(error, StoreDamagedError) and self._damage is None:
            self._damage = f"{type(exc).__name__}: {exc}"
        return error

    def _follow_current(self) -> None:
        # A read-only store sees the writer's compactions: reopen when CURRENT changed.
        try:
            signature = current_signature(self._root)
        except FileNotFoundError:
            return
        if signature == self._signature:
            return
        name = read_current(self._root)
        if name != self._gen.name:
            new = open_live(self._root, self._settings)
            old, self._gen = self._gen, new
            old.release()
            logger.info("map store %s: now reading %s", self._root, new.name)
        self._signature = signature
