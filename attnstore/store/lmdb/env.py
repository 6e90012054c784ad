"""Store directory, generations and their LMDB environments.

A store is a directory::

    PATH/CURRENT          name of the live generation ("gen-000001"), replaced atomically
    PATH/writer.lock      flock held by the one process that may write
    PATH/gen-NNNNNN/      one LMDB environment (data.mdb, lock.mdb) + holders.lock

Compaction writes ``gen-N+1`` and swaps ``CURRENT`` with ``os.replace``. Every
process that opens a generation holds a shared flock on its ``holders.lock``; a
generation other than the live one is removed only once an exclusive flock can be
had, i.e. when no process holds it any more. Within a process a generation is
reference counted, so a read that started on it finishes on it.

LMDB maps its lock file (``lock.mdb``) and writes its reader table through that
mapping. Created sparse, a page of it would only get disk space when first
touched, and on a full disk that touch is a SIGBUS, not an error. So the lock
file's blocks are allocated before LMDB opens it, where a full disk is an
ordinary ENOSPC (``StoreFullError``).

**Mapped pages.** What Linux's fault-around maps in, unasked, a read-only store gives back
(``attnstore.protocol.mapped_pages.drop_mapped_pages``, on the store's folder).

A process reading an LMDB store maps its file. Entry records lie between their maps' pages, so a scan of
the records to build the indexes (when an embedded client opens a store that is in the page cache) maps a
large part of the maps too (fault-around): measured on a 666 MiB store of 4,276 MiniLM log lines, +245 MiB
of resident memory for 5 MiB of records read.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import re
import shutil
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TypeAlias, TypeVar

import lmdb

from attnstore.errors import StoreFullError, StoreNotFoundError, StoreOpenError

logger = logging.getLogger(__name__)

CURRENT_FILE = "CURRENT"
WRITER_LOCK_FILE = "writer.lock"
HOLDERS_LOCK_FILE = "holders.lock"
DATA_FILE = "data.mdb"
LOCK_FILE = "lock.mdb"
# LMDB reports a write cut short as EIO; with less than this free on the store's filesystem the
# cause is taken to be a full disk (a short write at ENOSPC leaves almost nothing free), with
# more it is a real I/O error.
DISK_FULL_FREE_BYTES = 16 << 20
# Sub-database names; "index" is reserved for the vector index (raw bytes).
DB_NAMES: tuple[str, ...] = ("meta", "catalog", "projectors", "entries", "lengths", "hashes", "hits", "buckets", "zarr")
RESERVED_DB_NAMES: tuple[str, ...] = ("index",)
# Prefix blocks: created by a writer when missing, so stores from before them open as they are.
PREFIX_DB_NAME = "prefix"
CHUNKS_DB_NAME = "chunks"  # chunk entries: likewise created by a writer when missing
_MAX_DBS = 16
_MAX_READERS = 512
# Size LMDB gives a new lock file: its header (two 64-byte cache lines) and one 64-byte slot per
# reader. Exactly that is allocated up front: a larger file would raise the reader count of later
# openers past what processes that mapped it earlier can see.
LOCK_FILE_BYTES = 2 * 64 + _MAX_READERS * 64
_GEN_RE = re.compile(r"^gen-(\d{6,})$")

# Handle of one named sub-database (lmdb's stubs and C module call its class ``_Database``).
DbHandle: TypeAlias = lmdb._Database
# A cursor's value type: bytes, or memoryview in a transaction opened with ``buffers=True``.
_Value = TypeVar("_Value", bound=bytes | memoryview)


def generation_name(number: int) -> str:
    """Directory name of generation ``number``."""
    return f"gen-{number:06d}"


def _generation_number(name: str) -> int:
    match = _GEN_RE.match(name)
    if match is None:
        raise ValueError(f"{name!r} is not a generation directory name (gen-NNNNNN)")
    return int(match[1])


def list_generations(root: Path) -> list[str]:
    """Generation directory names under ``root``, oldest first."""
    if not root.is_dir():
        return []
    names = [p.name for p in root.iterdir() if p.is_dir() and _GEN_RE.match(p.name)]
    return sorted(names, key=_generation_number)


def next_generation_name(root: Path) -> str:
    """Name for a new generation, above every existing one."""
    names = list_generations(root)
    last = _generation_number(names[-1]) if names else 0
    return generation_name(last + 1)


def read_current(root: Path) -> str:
    """Name of the live generation.

    Raises:
        StoreNotFoundError: ``root`` has no ``CURRENT`` file.
    """
    try:
        name = (root / CURRENT_FILE).read_text().strip()
    except FileNotFoundError:
        raise StoreNotFoundError(f"no map store at {root} (no {CURRENT_FILE} file)") from None
    if not _GEN_RE.match(name):
        raise StoreOpenError(f"{root / CURRENT_FILE} names {name!r}, not a generation directory")
    return name


def current_signature(root: Path) -> tuple[int, int]:
    """Identity of the ``CURRENT`` file; it changes whenever a generation is swapped in."""
    st = os.stat(root / CURRENT_FILE)
    return (st.st_ino, st.st_mtime_ns)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_current(root: Path, name: str) -> None:
    """Make ``name`` the live generation, atomically and durably."""
    tmp = root / (CURRENT_FILE + ".tmp")
    with open(tmp, "w") as fh:
        fh.write(name + "\n")
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, root / CURRENT_FILE)
    _fsync_dir(root)


def acquire_writer_lock(root: Path) -> int:
    """Take the store's writer lock; returns the fd that holds it.

    Raises:
        StoreOpenError: another process (or another LmdbMapStore here) writes to the store.
    """
    fd = os.open(root / WRITER_LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise StoreOpenError(
            f"map store {root} is open for writing elsewhere; open it with readonly=True or close the other"
        ) from None
    return fd


def release_lock(fd: int) -> None:
    """Release a lock taken with flock and close its fd."""
    fcntl.flock(fd, fcntl.LOCK_UN)
    os.close(fd)


def remove_unused_generations(root: Path, keep: str) -> list[str]:
    """Delete every generation but ``keep`` that no process holds; returns their names."""
    removed = []
    for name in list_generations(root):
        if name == keep:
            continue
        path = root / name
        try:
            fd = os.open(path / HOLDERS_LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
        except FileNotFoundError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            logger.info("generation %s of %s is still held by a reader; kept for now", name, root)
            continue
        try:
            shutil.rmtree(path)
            removed.append(name)
            logger.info("removed old generation %s of %s", name, root)
        finally:
            release_lock(fd)
    return removed


@dataclass(frozen=True, slots=True)
class Databases:
    """Handles of one environment's sub-databases."""

    meta: DbHandle  # format version, id counter, eviction counters
    catalog: DbHandle  # namespace name -> NamespaceInfo JSON
    projectors: DbHandle  # namespace name -> safetensors blob
    entries: DbHandle  # ns NUL id -> EntryRecord
    lengths: DbHandle  # ns NUL L id -> b"" (entries by length)
    hashes: DbHandle  # ns NUL token hash -> id (exact tier)
    hits: DbHandle  # ns NUL id -> HitRecord
    buckets: DbHandle  # ns NUL L -> BucketRecord
    zarr: DbHandle  # zarr key -> zarr.json or a stored object (``zarr_layout``)
    # ns NUL kind ... -> prefix layout, block records and parts (prefix_blocks.py); None in a read-only
    # opening of a store written before prefix blocks existed (it has none)
    prefix: DbHandle | None = None
    # ns NUL kind ... -> chunk layout, records and layers (lmdb.chunks.keys); None as ``prefix`` is
    chunks: DbHandle | None = None


def free_disk_bytes(path: Path) -> int:
    """Bytes an unprivileged writer may still use on the filesystem holding ``path`` (0 if it is gone)."""
    try:
        st = os.statvfs(path)
    except OSError:
        return 0
    return st.f_bavail * st.f_frsize


def is_disk_full(exc: BaseException, root: Path) -> bool:
    """True when ``exc`` (an LMDB or OS error of a write under ``root``) means the disk is full.

    ENOSPC and EDQUOT are; EIO is when the filesystem has under ``DISK_FULL_FREE_BYTES`` free
    (LMDB turns a write cut short by a full disk into EIO). A full LMDB map is not: see
    :func:`is_map_full`.
    """
    if isinstance(exc, OSError) and not isinstance(exc, lmdb.Error):
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        return exc.errno == errno.EIO and free_disk_bytes(root) < DISK_FULL_FREE_BYTES
    text = str(exc)
    if isinstance(exc, lmdb.DiskError) or "No space left" in text or "Disk quota exceeded" in text:
        return True
    return "Input/output error" in text and free_disk_bytes(root) < DISK_FULL_FREE_BYTES


def is_map_full(exc: BaseException) -> bool:
    """True when ``exc`` says the LMDB map (its address space, ``map_size``) is used up."""
    return isinstance(exc, lmdb.MapFullError)


def disk_full_error(root: Path) -> StoreFullError:
    """The error of a write that found the disk under the store at ``root`` full (the path goes to the log only)."""
    free = free_disk_bytes(root)
    logger.warning("map store %s: the disk is full (%s bytes free)", root, free)
    return StoreFullError(
        f"the disk is full ({free} bytes free on the map store's filesystem): nothing of the failed write is"
        " visible. Free disk space (a compaction needs about the live data's size free)"
    )


def allocate_lock_file(path: Path, *, required: bool) -> None:
    """Give a generation's LMDB lock file its disk blocks before LMDB maps it (see the module docstring).

    Args:
        path: the generation directory.
        required: raise when the blocks cannot be had (a writer); else leave it to LMDB
            (a reader on read-only storage cannot allocate, and needs not on a sound disk).

    Raises:
        StoreFullError: ``required`` and the disk is full.
        OSError: ``required`` and the file cannot be written.
    """
    root = path.parent
    try:
        fd = os.open(path / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            # An existing file is allocated at its own size, never grown (see LOCK_FILE_BYTES).
            os.posix_fallocate(fd, 0, os.fstat(fd).st_size or LOCK_FILE_BYTES)
        finally:
            os.close(fd)
    except OSError as exc:
        if not required:
            return
        if is_disk_full(exc, root):
            raise disk_full_error(root) from None
        raise


def stale_generations(root: Path, live: str) -> tuple[int, int]:
    """Number and bytes of the generation directories under ``root`` other than ``live``."""
    count = nbytes = 0
    for name in list_generations(root):
        if name == live:
            continue
        count += 1
        for path in (root / name).iterdir():
            try:
                nbytes += path.stat().st_blocks * 512  # allocated, not apparent: lock files are sparse
            except FileNotFoundError:
                pass  # removed meanwhile
    return count, nbytes


class Generation:
    """One generation: an LMDB environment and its sub-databases, reference counted.

    The opener holds the first reference; :meth:`acquire`/:meth:`release` bracket
    each use. The environment closes when the last reference is released.

    Raises:
        StoreOpenError: the environment cannot be opened (missing, being removed,
            already open in this process, or missing sub-databases).
    """

    def __init__(self, root: Path, name: str, *, map_size: int, readonly: bool, create: bool) -> None:
        self.name = name
        self.path = root / name
        if create:
            try:
                # Never parents: a store directory removed meanwhile must not come back empty.
                self.path.mkdir(exist_ok=False)
            except OSError as exc:
                if is_disk_full(exc, root):
                    raise disk_full_error(root) from None
                raise
        try:
            allocate_lock_file(self.path, required=not readonly)
        except OSError:
            if create:
                shutil.rmtree(self.path, ignore_errors=True)
            raise
        try:
            self._holder_fd = os.open(self.path / HOLDERS_LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
        except FileNotFoundError:
            raise StoreOpenError(f"generation {self.path} does not exist (removed meanwhile?)") from None
        try:
            fcntl.flock(self._holder_fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._holder_fd)
            raise StoreOpenError(f"generation {self.path} is being removed") from None
        try:
            self.env = lmdb.open(
                str(self.path),
                map_size=map_size,
                max_dbs=_MAX_DBS,
                max_readers=_MAX_READERS,
                readonly=readonly,
                create=create,
                subdir=True,
                meminit=False,
                lock=True,
                # A reader's accesses are random (an entry's maps, a hit's outputs): read-ahead would map the
                # neighbouring entries' pages into every process that opens the store, for nothing.
                readahead=not readonly,
            )
            handles = {n: self.env.open_db(n.encode(), create=not readonly) for n in DB_NAMES}
            self.db = Databases(**handles, prefix=_open_optional_db(self.env, PREFIX_DB_NAME, readonly=readonly),
                                chunks=_open_optional_db(self.env, CHUNKS_DB_NAME, readonly=readonly))
        except lmdb.Error as exc:
            release_lock(self._holder_fd)
            if getattr(self, "env", None) is not None:
                self.env.close()
            raise StoreOpenError(f"cannot open LMDB environment {self.path}: {exc}") from None
        self.readonly = readonly
        # Called once after the environment closed (the writer removes retired generations then).
        self.on_closed: Callable[[], None] | None = None
        self._refs = 1
        self._lock = threading.Lock()

    @property
    def data_path(self) -> Path:
        """The environment's data file."""
        return self.path / DATA_FILE

    def removed(self) -> bool:
        """True when the generation's directory was deleted while it is open (its files are then unlinked)."""
        try:
            return os.fstat(self._holder_fd).st_nlink == 0
        except OSError:
            return True  # the fd is closed: the generation is, too

    def file_bytes(self) -> int:
        """Size of the data file in bytes."""
        try:
            return self.data_path.stat().st_size
        except FileNotFoundError:
            return 0

    def acquire(self) -> Generation:
        """Take a reference; returns self.

        Raises:
            StoreOpenError: the generation was closed already.
        """
        with self._lock:
            if self._refs <= 0:
                raise StoreOpenError(f"generation {self.path} is closed")
            self._refs += 1
        return self

    def release(self) -> None:
        """Drop a reference; the last one closes the environment and its hold."""
        with self._lock:
            self._refs -= 1
            last = self._refs == 0
        if last:
            self.env.close()
            release_lock(self._holder_fd)
            logger.debug("closed generation %s", self.path)
            if self.on_closed is not None:
                self.on_closed()


def _open_optional_db(env: lmdb.Environment, name: str, *, readonly: bool) -> DbHandle | None:
    """The sub-database ``name``; a read-only opening of an environment without it gets None."""
    try:
        return env.open_db(name.encode(), create=not readonly)
    except lmdb.NotFoundError:
        return None


def items_with_prefix(
    cursor: lmdb.Cursor[_Value], prefix: bytes, *, start: bytes | None = None
) -> Iterator[tuple[bytes, _Value]]:
    """``(key, value)`` pairs of a cursor's database whose key starts with ``prefix``, in key order.

    Args:
        cursor: an LMDB cursor (its transaction must stay open while iterating).
        prefix: key prefix.
        start: first key to consider (for resuming a paged scan); defaults to ``prefix``.
    """
    if not cursor.set_range(start if start is not None else prefix):
        return
    for raw_key, value in cursor.iternext():
        key = bytes(raw_key)
        if not key.startswith(prefix):
            return
        yield key, value
