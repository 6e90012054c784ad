"""Namespace catalog: records in the ``catalog`` and ``projectors`` sub-databases.

Each namespace also gets a zarr group (with its info as attributes) so the
hierarchy is self-describing when opened with zarr. The catalog record (JSON)
carries the projector's version and crc32c; a projector is checked against it
whenever it is loaded, and a record that does not decode is reported as damage,
never as a raw parsing error.
"""

from __future__ import annotations

import json
import threading
from typing import TYPE_CHECKING

import crc32c

from attnstore.errors import (
    ChecksumError,
    FormatVersionError,
    NamespaceNotFoundError,
    StoreDamagedError,
    shown,
)
from attnstore.protocol.records import SUPPORTED_FORMAT_VERSIONS, NamespaceInfo, is_namespace_name
from attnstore.store.arrays import NamespaceState
from attnstore.store.namespace_rules import matching_namespace
from attnstore.store.zarr_layout import group_metadata, node_key

if TYPE_CHECKING:
    import lmdb

    from attnstore.store.lmdb.env import Databases


def check_format_version(info: NamespaceInfo) -> NamespaceInfo:
    """Return ``info`` if this code reads its format version.

    Raises:
        FormatVersionError: unknown format version.
    """
    if info.format_version not in SUPPORTED_FORMAT_VERSIONS:
        raise FormatVersionError(
            f"namespace {info.name!r} is in format version {info.format_version};"
            f" this code reads versions {sorted(SUPPORTED_FORMAT_VERSIONS)}"
        )
    return info


def decode_namespace(name: str, raw: bytes, projector: bytes | None, *, check_projector: bool = True) -> NamespaceInfo:
    """A catalog record and its projector as a NamespaceInfo, both checked (the projector unless told not to).

    Raises:
        StoreDamagedError: the record does not decode, or names another namespace.
        ChecksumError: the projector does not match the crc32c its record holds.
        FormatVersionError: the namespace is in a format version this code does not read.
    """
    try:
        info = NamespaceInfo.from_json_dict(json.loads(raw), projector)
    except (ValueError, KeyError, TypeError) as exc:  # JSON, UTF-8, a missing or mistyped field
        raise StoreDamagedError(
            f"the catalog record of namespace {name!r} is damaged ({type(exc).__name__}): restore the store from"
            " a backup"
        ) from None
    if info.name != name:
        raise StoreDamagedError(f"the catalog record of namespace {name!r} names {info.name!r}: it is damaged")
    if check_projector and projector is not None and not projector_intact(info):
        raise ChecksumError(
            f"the projector of namespace {name!r} fails its crc32c check: its stored weights are damaged."
            " Store it again (admin ingest --replace-projector from the store it was built in) or restore a backup"
        )
    return check_format_version(info)


def projector_intact(info: NamespaceInfo) -> bool:
    """Whether the namespace's projector matches the crc32c recorded with it (True when none is recorded)."""
    if info.projector is None or info.projector_crc32c is None:
        return True
    return crc32c.crc32c(info.projector) == info.projector_crc32c


class CatalogCache:
    """Decoded namespaces, reused while their catalog record is unchanged.

    Every change of a namespace (a new projector, a new version, a drop and
    re-create) rewrites its catalog record, so comparing the record's bytes is
    enough to know the cached info (and its checked projector) still holds. A
    lookup then reads one small record instead of copying and checksumming the
    projector.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._infos: dict[str, tuple[bytes, NamespaceInfo]] = {}

    def load(
        self, txn: lmdb.Transaction, db: Databases, name: str, *, check_projector: bool = True
    ) -> NamespaceInfo | None:
        """The namespace called ``name`` (with its projector), or None.

        Args:
            txn: a transaction on the generation ``db`` belongs to.
            db: its sub-databases.
            name: namespace name.
            check_projector: check the projector's crc32c. Admin work that only needs the
                layout, or replaces the projector, does without, so a damaged projector
                can still be replaced and the rest of the store compacted and verified.

        Raises:
            StoreDamagedError, ChecksumError, FormatVersionError: see :func:`decode_namespace`.
        """
        if not is_namespace_name(name):
            # Never stored; and LMDB refuses empty or over-long keys with an error of its own.
            return None
        raw = txn.get(name.encode(), db=db.catalog)
        if raw is None:
            return None
        record = bytes(raw)
        with self._lock:
            cached = self._infos.get(name)
        if cached is not None and cached[0] == record:
            return cached[1]
        projector = txn.get(name.encode(), db=db.projectors)
        info = decode_namespace(
            name, record, None if projector is None else bytes(projector), check_projector=check_projector
        )
        if check_projector:
            with self._lock:
                self._infos[name] = (record, info)
        return info


    def require(
        self, txn: lmdb.Transaction, db: Databases, name: str, *, check_projector: bool = True
    ) -> NamespaceInfo:
        """As :meth:`load`, but a missing namespace is NamespaceNotFoundError."""
        info = self.load(txn, db, name, check_projector=check_projector)
        if info is None:
            raise NamespaceNotFoundError(f"no namespace {shown(name)} in the map store")
        return info


def create_or_match(cache: CatalogCache, txn: lmdb.Transaction, db: Databases, wanted: NamespaceInfo) -> NamespaceInfo:
    """Store ``wanted`` as a new namespace and return it, or return the existing one of that name if it
    has the same model, fingerprint and layout (creating is idempotent; an existing namespace without
    token limits records ``wanted``'s).

    Raises:
        NamespaceExistsError: a namespace of that name exists with another model, fingerprint or layout.
    """
    existing = cache.load(txn, db, wanted.name, check_projector=False)
    if existing is None:
        put_namespace(txn, db, wanted)
        return wanted
    matched = matching_namespace(existing, wanted)
    if matched is not existing:
        _put_record(txn, db, matched)
    return matched


def namespace_names(txn: lmdb.Transaction, db: Databases) -> list[str]:
    """Names of every namespace, sorted.

    Raises:
        StoreDamagedError: a catalog key is not a namespace name.
    """
    with txn.cursor(db=db.catalog) as cursor:
        keys = [bytes(key) for key in cursor.iternext(keys=True, values=False)]
    names = []
    for key in keys:
        try:
            name = key.decode()
        except UnicodeDecodeError:
            name = ""
        if not is_namespace_name(name):
            raise StoreDamagedError(f"the catalog holds a key that is no namespace name ({key!r:.40}): it is damaged")
        names.append(name)
    return names


def _put_record(txn: lmdb.Transaction, db: Databases, info: NamespaceInfo) -> None:
    txn.put(info.name.encode(), json.dumps(info.to_json_dict()).encode(), db=db.catalog)
    txn.put(node_key(info.name), group_metadata({"attnstore_namespace": info.to_json_dict()}), db=db.zarr)


def put_namespace(txn: lmdb.Transaction, db: Databases, info: NamespaceInfo) -> None:
    """Write a new namespace's catalog record and zarr groups."""
    _put_record(txn, db, info)
    if info.projector is not None:
        txn.put(info.name.encode(), info.projector, db=db.projectors)
    for group in NamespaceState.of(info).group_names():
        txn.put(node_key(f"{info.name}/{group}"), group_metadata(), db=db.zarr)


def put_projector(txn: lmdb.Transaction, db: Databases, info: NamespaceInfo) -> None:
    """Write a namespace's projector blob with its catalog record (version and crc32c) in the same write."""
    assert info.projector is not None  # only a namespace given a projector comes here
    txn.put(info.name.encode(), info.projector, db=db.projectors)
    _put_record(txn, db, info)
