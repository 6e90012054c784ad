"""The map store: attention maps per namespace behind one interface, ``MapStoreBase``, with its backends
(``lmdb``, ``redis``, ``memory``) and the DRAM cache in front of them (``dram``).

Value types (``NamespaceLayout``, ``NewEntry``...) and reports import nothing
heavy. ``MapStoreBase``, ``LmdbMapStore`` (lmdb), ``MemoryMapStore``, ``LMDBZarrStore`` and
``open_zarr`` (zarr) are loaded on first use, so importing this package stays light.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from attnstore.protocol.records import (
    CODECS,
    FORMAT_VERSION,
    Codec,
    EntryInfo,
    NamespaceInfo,
    NamespaceLayout,
    NewEntry,
)
from attnstore.store.reports import (
    BucketStats,
    CompactReport,
    CorruptEntry,
    DramStats,
    NamespaceStats,
    StoreStats,
    VerifyReport,
)

if TYPE_CHECKING:
    from attnstore.store.base import MapStoreBase
    from attnstore.store.lmdb.mapstore import LmdbMapStore, StoreSettings
    from attnstore.store.lmdb.zarr_store import LMDBZarrStore, open_zarr
    from attnstore.store.memory.mapstore import MemoryMapStore

_LAZY = {
    "MapStoreBase": "attnstore.store.base",
    "LmdbMapStore": "attnstore.store.lmdb.mapstore",
    "StoreSettings": "attnstore.store.lmdb.mapstore",
    "MemoryMapStore": "attnstore.store.memory.mapstore",
    "LMDBZarrStore": "attnstore.store.lmdb.zarr_store",
    "open_zarr": "attnstore.store.lmdb.zarr_store",
}

__all__ = [
    "CODECS",
    "FORMAT_VERSION",
    "BucketStats",
    "Codec",
    "CompactReport",
    "CorruptEntry",
    "DramStats",
    "EntryInfo",
    "LMDBZarrStore",
    "LmdbMapStore",
    "MapStoreBase",
    "MemoryMapStore",
    "NamespaceInfo",
    "NamespaceLayout",
    "NamespaceStats",
    "NewEntry",
    "StoreSettings",
    "StoreStats",
    "VerifyReport",
    "open_zarr",
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'attnstore.store' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
