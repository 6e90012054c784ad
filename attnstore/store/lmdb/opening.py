"""Creating a store and opening its live generation, with the format version check."""

from __future__ import annotations

import logging
import time
from pathlib import Path

from attnstore.errors import FormatVersionError, StoreOpenError
from attnstore.store.lmdb.ingest import META_NEXT_ID, write_counter
from attnstore.protocol.records import FORMAT_VERSION, SUPPORTED_FORMAT_VERSIONS
from attnstore.store.lmdb.env import Generation, next_generation_name, read_current, write_current
from attnstore.store.lmdb.settings import StoreSettings
from attnstore.store.zarr_layout import group_metadata, root_group_key

logger = logging.getLogger(__name__)

META_FORMAT_VERSION = b"format_version"
META_CREATED = b"created"


def check_store_format(gen: Generation) -> None:
    """Refuse a generation this code cannot read.

    Raises:
        FormatVersionError: no format version recorded, or an unknown one.
    """
    with gen.env.begin() as txn:
        raw = txn.get(META_FORMAT_VERSION, db=gen.db.meta)
    if raw is None:
        raise FormatVersionError(f"{gen.path} has no format version: not an AttnStore map store")
    version = int(bytes(raw))
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
