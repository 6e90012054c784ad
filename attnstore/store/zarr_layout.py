"""The zarr v3 hierarchy of a store: node paths, metadata documents, chunk keys.

zarr's word for its storage unit, the chunk, is used only here: the rest of the store calls one chunk
a stored object (``ZarrArray.object_key``), since a chunk there is the chunk tier's (a stored prompt segment).

Layout (one hierarchy per store, one group per namespace)::

    zarr.json                              root group
    <ns>/zarr.json                         namespace group (attributes: info, layout)
    <ns>/maps/L<L>/zarr.json               array (capacity, layers, heads, L, L)
    <ns>/maps/L<L>/c/<slot>/<layer>/0/0/0  chunk (1, 1, heads, L, L)
    <ns>/scales/L<L>/...                   q8 codecs only: (capacity, layers, heads, L)
    <ns>/outputs/L<L>/c/<slot>/0/0         exact tier: (capacity, L, hidden)

Chunk keys use zarr's default key encoding. All chunks of one slot share the
prefix ``.../c/<slot>/`` and, since ``/`` sorts before every digit, no other
slot's key falls inside that range: an entry's layers are adjacent in key order.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Literal

ArrayDtype = Literal["float16", "uint8"]

_BYTES_LE: dict[str, Any] = {"name": "bytes", "configuration": {"endian": "little"}}
_CHUNK_KEY_RE = re.compile(r"^(?P<ns>[^/]+)/(?P<array>[^/]+)/L(?P<length>\d+)/c/(?P<slot>\d+)/")


def bytes_codec(dtype: ArrayDtype) -> dict[str, Any]:
    """The zarr ``bytes`` codec for ``dtype`` (single-byte types take no endianness)."""
    return {"name": "bytes"} if dtype == "uint8" else dict(_BYTES_LE)


def zstd_codec(level: int) -> dict[str, Any]:
    """The zarr ``zstd`` codec; numcodecs' Zstd writes the same frames."""
    return {"name": "zstd", "configuration": {"level": level, "checksum": False}}


def group_metadata(attributes: dict[str, Any] | None = None) -> bytes:
    """``zarr.json`` of a group."""
    return json.dumps({"zarr_format": 3, "node_type": "group", "attributes": attributes or {}}).encode()


def root_group_key() -> bytes:
    """Key of the root group's ``zarr.json``."""
    return b"zarr.json"


def node_key(path: str) -> bytes:
    """Key of the ``zarr.json`` of the node at ``path``."""
    return f"{path}/zarr.json".encode()


@dataclass(frozen=True, slots=True)
class ZarrArray:
    """One zarr array of a length bucket, one chunk (a stored object) per (slot, layer) or per slot."""

    name: str  # "maps", "scales", "outputs"
    dtype: ArrayDtype
    inner_shape: tuple[int, ...]  # chunk shape after the slot (and layer) axes
    per_layer: bool  # True: chunk (1, 1, *inner_shape); False: chunk (1, *inner_shape)
    zarr_codecs: tuple[dict[str, Any], ...]
    dimension_names: tuple[str, ...]
    attributes: dict[str, Any] = field(default_factory=dict, compare=False)

    def path(self, namespace: str, length: int) -> str:
        """Zarr path of this array in ``namespace``'s bucket ``length``."""
        return f"{namespace}/{self.name}/L{length}"

    @property
    def object_nbytes(self) -> int:
        """Decoded size of one chunk in bytes."""
        n = 2 if self.dtype == "float16" else 1
        for dim in self.inner_shape:
            n *= dim
        return n

    def shape(self, capacity: int, layers: int) -> tuple[int, ...]:
        """Full array shape for a bucket of ``capacity`` slots."""
        lead = (capacity, layers) if self.per_layer else (capacity,)
        return lead + self.inner_shape

    def metadata(self, capacity: int, layers: int) -> bytes:
        """The array's ``zarr.json`` for a bucket of ``capacity`` slots."""
        lead = (1, 1) if self.per_layer else (1,)
        doc = {
            "zarr_format": 3,
            "node_type": "array",
            "shape": list(self.shape(capacity, layers)),
            "data_type": self.dtype,
            "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": list(lead + self.inner_shape)}},
            "chunk_key_encoding": {"name": "default", "configuration": {"separator": "/"}},
            "fill_value": 0.0 if self.dtype == "float16" else 0,
            "codecs": list(self.zarr_codecs),
            "attributes": self.attributes,
            "dimension_names": list(self.dimension_names),
        }
        return json.dumps(doc).encode()

    def object_keys(self, namespace: str, length: int, slot: int, layers: int) -> list[bytes]:
        """Chunk keys of one slot, in layer order (one key if not per layer)."""
        zeros = "/0" * len(self.inner_shape)
        prefix = f"{self.path(namespace, length)}/c/{slot}/"
        if not self.per_layer:
            return [(prefix.rstrip("/") + zeros).encode()]
        return [f"{prefix}{layer}{zeros}".encode() for layer in range(layers)]

    def object_key(self, namespace: str, length: int, slot: int, layer: int) -> bytes:
        """Chunk key of one (slot, layer)."""
        zeros = "/0" * len(self.inner_shape)
        return f"{self.path(namespace, length)}/c/{slot}/{layer}{zeros}".encode()


def parse_object_key(key: bytes | str) -> tuple[str, str, int, int] | None:
    """``(namespace, array, length, slot)`` of a chunk key, or None for a metadata key."""
    text = key if isinstance(key, str) else bytes(key).decode()
    m = _CHUNK_KEY_RE.match(text)
    if m is None:
        return None
    return m["ns"], m["array"], int(m["length"]), int(m["slot"])


def slot_ids_metadata(length: int, capacity: int) -> bytes:
    """``zarr.json`` of the computed ``<ns>/entry_ids/L<L>`` array (``lmdb.zarr_store``): each slot's entry id."""
    doc = {
        "zarr_format": 3,
        "node_type": "array",
        "shape": [capacity],
        "data_type": "uint64",
        "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": [max(capacity, 1)]}},
        "chunk_key_encoding": {"name": "default", "configuration": {"separator": "/"}},
        "fill_value": 0,
        "codecs": [dict(_BYTES_LE)],
        "attributes": {"description": f"entry id stored in each slot of maps/L{length}; 0: unused slot"},
        "dimension_names": ["slot"],
    }
    return json.dumps(doc).encode()


def outputs_array(length: int, hidden: int) -> ZarrArray:
    """The exact-tier array of a bucket: final outputs ``(capacity, L, hidden)`` fp16."""
    return ZarrArray(
        name="outputs",
        dtype="float16",
        inner_shape=(length, hidden),
        per_layer=False,
        zarr_codecs=(bytes_codec("float16"),),
        dimension_names=("slot", "token", "hidden"),
    )
