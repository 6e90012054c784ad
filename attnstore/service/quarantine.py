"""Quarantine: stored objects a node's audit found wrong, never served again until an admin looks.

A node that audits what it is served (``attnstore_client.audit``) recomputes a
sampled object, and when the stored values differ from its forward beyond the
tolerance it reports the object (``ReportMismatch``, a write or admin call). The
object is then quarantined here: every lookup of every node treats it as a miss
(an exact row's token hash, and its entry id for the map tier), and it stays
stored, with its writer, so an admin can judge it: ``release`` serves it again,
``drop`` deletes it (``attnstore admin quarantine list|release|drop``).

The quarantine is held by the process that serves the store (the daemon, or an
embedded store's process) and, given a file (the daemon's ``--quarantine-file``,
by default ``quarantine.json`` in an LMDB store's folder), kept there across
restarts: rewritten whole (a temporary file renamed over it) at each change.
Without one a restarted daemon serves the object again until an audit catches it
again (at rate ``r``, within about ``1/r`` of its hits).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, get_args

from attnstore.errors import ConfigError, StorageError, shown

log = logging.getLogger(__name__)

ObjectKind = Literal["row", "prefix", "chunk"]
OBJECT_KINDS: tuple[ObjectKind, ...] = get_args(ObjectKind)


@dataclass(frozen=True, slots=True)
class QuarantinedObject:
    """One quarantined object and who is concerned: the writer that stored it, the caller that reported it."""

    namespace: str
    kind: ObjectKind
    key: bytes  # a row's token hash; a prefix block's chain hash; a chunk's key
    writer: str | None  # the name of the token that stored it (None: an admin ingested it, or unknown)
    entry_id: int | None  # a row's entry id (None for prefix blocks and chunks)
    reporter: str  # the caller that reported the mismatch
    detail: str  # what its audit measured ("min_cosine=0.12 max_abs=3.4")
    since: float  # unix time of the report


def check_kind(kind: str) -> ObjectKind:
    """``kind`` as an object kind.

    Raises:
        ConfigError: not one of ``OBJECT_KINDS`` (named).
    """
    if kind not in OBJECT_KINDS:
        raise ConfigError(f"quarantine: object kind {shown(kind)} is unknown; choose one of {OBJECT_KINDS}")
    return kind


class Quarantine:
    """The quarantined objects of a service, by namespace, kind and key; thread-safe.

    Args:
        path: the JSON file it is kept in (read now if it exists, rewritten at each change); None: memory only.

    Raises:
        StorageError: ``path`` exists but is not a quarantine file this version reads.
    """

    def __init__(self, path: Path | None = None) -> None:
        self._lock = threading.Lock()
        self._objects: dict[tuple[str, str, bytes], QuarantinedObject] = {}
        self._entry_ids: dict[str, set[int]] = {}  # namespace -> quarantined rows' entry ids
        self.reports = 0  # mismatches reported, quarantined or already so
        self.path = path
        for item in _read(path) if path is not None and path.exists() else ():
            self._objects[(item.namespace, item.kind, item.key)] = item
            if item.entry_id is not None:
                self._entry_ids.setdefault(item.namespace, set()).add(item.entry_id)

    def __len__(self) -> int:
        with self._lock:
            return len(self._objects)

    def add(self, item: QuarantinedObject) -> bool:
        """Quarantine ``item``; False when it already was (the first report is kept)."""
        key = (item.namespace, item.kind, item.key)
        with self._lock:
            self.reports += 1
            if key in self._objects:
                return False
            self._objects[key] = item
            if item.entry_id is not None:
                self._entry_ids.setdefault(item.namespace, set()).add(item.entry_id)
            self._save()
        log.warning(
            "event=quarantined namespace=%s kind=%s key=%s writer=%s entry=%s reporter=%s %s", item.namespace,
            item.kind, item.key.hex()[:16], item.writer or "(admin)", item.entry_id, item.reporter, item.detail,
        )
        return True

    def holds(self, namespace: str, kind: ObjectKind, key: bytes) -> bool:
        """Whether the object is quarantined."""
        return (namespace, kind, key) in self._objects  # one dict read: atomic under the GIL

    def held_keys(self, namespace: str, kind: ObjectKind, keys: Iterable[bytes | None]) -> set[bytes]:
        """Those of ``keys`` that are quarantined."""
        if not self._objects:
            return set()
        return {key for key in keys if key is not None and (namespace, kind, key) in self._objects}

    def held_entry(self, namespace: str, entry_id: int | None) -> bool:
        """Whether ``entry_id`` is a quarantined row of ``namespace`` (the map tier must not replay it either)."""
        ids = self._entry_ids.get(namespace)
        return entry_id is not None and ids is not None and entry_id in ids

    def items(self, namespace: str | None = None) -> list[QuarantinedObject]:
        """The quarantined objects (of ``namespace`` only, when given), oldest first."""
        with self._lock:
            held = list(self._objects.values())
        return sorted((i for i in held if namespace is None or i.namespace == namespace), key=lambda i: i.since)

    def release(self, namespace: str, kind: ObjectKind, key: bytes) -> QuarantinedObject | None:
        """Take the object out of quarantine (it is served again); None when it was not quarantined."""
        with self._lock:
            item = self._objects.pop((namespace, kind, key), None)
            if item is not None and item.entry_id is not None:
                self._entry_ids.get(namespace, set()).discard(item.entry_id)
            if item is not None:
                self._save()
        return item

    def forget(self, namespace: str) -> None:
        """Drop a namespace's quarantine (the namespace was dropped)."""
        with self._lock:
            for key in [k for k in self._objects if k[0] == namespace]:
                del self._objects[key]
            self._entry_ids.pop(namespace, None)
            self._save()

    def _save(self) -> None:
        """Rewrite the file (under the lock): a temporary file renamed over it, so a crash leaves one or the
        other. A write that fails is logged: the quarantine holds in memory still."""
        if self.path is None:
            return
        records = [dataclasses.asdict(item) | {"key": item.key.hex()} for item in self._objects.values()]
        temporary = self.path.with_name(self.path.name + ".tmp")
        try:
            temporary.write_text(json.dumps({"version": 1, "objects": records}, indent=1), encoding="utf-8")
            os.replace(temporary, self.path)
        except OSError as exc:
            log.error("event=quarantine_not_saved path=%s error=%r (held in memory until a restart)", self.path, exc)


def _read(path: Path) -> list[QuarantinedObject]:
    """The objects a quarantine file holds.

    Raises:
        StorageError: not a quarantine file of version 1 (named).
    """
    try:
        data: Any = json.loads(path.read_text(encoding="utf-8"))
        if data.get("version") != 1:
            raise ValueError(f"version {data.get('version')!r}, not 1")
        return [QuarantinedObject(**(record | {"key": bytes.fromhex(record["key"]),
                                               "kind": check_kind(record["kind"])}))
                for record in data["objects"]]
    except (OSError, ValueError, TypeError, KeyError, AttributeError, ConfigError) as exc:
        raise StorageError(f"quarantine file {path} cannot be read ({type(exc).__name__}: {exc}): move it away to"
                           " start with an empty quarantine") from None


def quarantined_now(
    namespace: str, kind: ObjectKind, key: bytes, *, writer: str | None, entry_id: int | None, reporter: str,
    detail: str,
) -> QuarantinedObject:
    """A ``QuarantinedObject`` reported now."""
    return QuarantinedObject(namespace, kind, key, writer, entry_id, reporter, detail[:512], time.time())
