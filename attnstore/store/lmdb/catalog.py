"""Namespace catalog: records in the ``catalog`` and ``projectors`` sub-databases.

Each namespace also gets a zarr group (with its info as attributes) so the
hierarchy is self-describing when opened with zarr.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

from attnstore.errors import FormatVersionError
from attnstore.protocol.records import SUPPORTED_FORMAT_VERSIONS, NamespaceInfo, is_namespace_name
from attnstore.store.arrays import NamespaceState
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


def load_namespace(txn: lmdb.Transaction, db: Databases, name: str) -> NamespaceInfo | None:
    """The namespace called ``name`` (with its projector), or None."""
    if not is_namespace_name(name):
        # Never stored; and LMDB refuses empty or over-long keys with an error of its own.
        return None
    raw = txn.get(name.encode(), db=db.catalog)
    if raw is None:
        return None
    projector = txn.get(name.encode(), db=db.projectors)
    info = NamespaceInfo.from_json_dict(json.loads(bytes(raw)), None if projector is None else bytes(projector))
    return check_format_version(info)


def namespace_names(txn: lmdb.Transaction, db: Databases) -> list[str]:
    """Names of every namespace, sorted."""
    with txn.cursor(db=db.catalog) as cursor:
        return [bytes(key).decode() for key in cursor.iternext(keys=True, values=False)]


def put_namespace(txn: lmdb.Transaction, db: Databases, info: NamespaceInfo) -> None:
    """Write a new namespace's catalog record and zarr groups."""
    txn.put(info.name.encode(), json.dumps(info.to_json_dict()).encode(), db=db.catalog)
    if info.projector is not None:
        txn.put(info.name.encode(), info.projector, db=db.projectors)
    txn.put(node_key(info.name), group_metadata({"attnstore_namespace": info.to_json_dict()}), db=db.zarr)
    for group in NamespaceState.of(info).group_names():
        txn.put(node_key(f"{info.name}/{group}"), group_metadata(), db=db.zarr)


def put_projector(txn: lmdb.Transaction, db: Databases, name: str, blob: bytes) -> None:
    """Replace a namespace's projector blob."""
    txn.put(name.encode(), blob, db=db.projectors)
