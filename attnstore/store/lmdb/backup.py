"""Backup: a consistent copy of a store's live generation, safe while a daemon writes to it."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

from attnstore.errors import ConfigError
from attnstore.store.lmdb.env import DATA_FILE, write_current
from attnstore.store.lmdb.live import open_live
from attnstore.store.lmdb.settings import StoreSettings

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class BackupReport:
    """What a backup copied."""

    source: str
    destination: str
    generation: str  # the live generation at the start of the copy
    file_bytes: int  # size of the copied data file
    seconds: float


def backup_store(source: str | Path, destination: str | Path, *, compact: bool = True) -> BackupReport:
    """Copy the live generation of the store at ``source`` into a new store at ``destination``.

    The copy is LMDB's ``mdb_env_copy``: one read transaction, so it holds every
    entry committed before it began and nothing written later or left
    uncommitted. Writers are not blocked. The generation is held (its shared
    flock) for the whole copy, so a compaction that swaps generations meanwhile
    cannot remove it; the backup then reflects the store as it was at its start.

    Args:
        source: store directory (a daemon may be serving it).
        destination: directory for the copy; must not exist or be empty.
        compact: leave free pages out (smaller copy, a little slower).

    Raises:
        StoreNotFoundError: no store at ``source``.
        ConfigError: ``destination`` exists and is not empty.
    """
    source, destination = Path(source), Path(destination)
    if destination.exists() and any(destination.iterdir()):
        raise ConfigError(f"backup destination {destination} is not empty; give a new directory")
    start = time.perf_counter()
    gen = open_live(source, StoreSettings(readonly=True))
    try:
        target = destination / gen.name
        target.mkdir(parents=True)
        gen.env.copy(str(target), compact=compact)
        write_current(destination, gen.name)
    finally:
        gen.release()
    report = BackupReport(
        source=str(source),
        destination=str(destination),
        generation=gen.name,
        file_bytes=(target / DATA_FILE).stat().st_size,
        seconds=time.perf_counter() - start,
    )
    logger.info("backed up %s (%s) to %s", source, gen.name, destination)
    return report
