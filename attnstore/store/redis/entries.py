"""One entry as a Redis hash: its record, each layer's chunk bytes and its outputs (see ``keys``).

The chunk bytes and the record are the LMDB backend's (``codecs``,
``lmdb.records.EntryRecord``), the entry id standing for the zarr slot; every
chunk is checked against its crc32c on the way out.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import crc32c
import numpy as np

from attnstore.errors import ChecksumError, EntryNotFoundError
from attnstore.store.arrays import NamespaceState
from attnstore.store.lmdb.records import EntryRecord, check_map_record
from attnstore.store.redis.keys import OUTPUTS_FIELD, RECORD_FIELD, chunk_field
from attnstore.store.validate import PreparedEntry

Fields = Mapping[bytes, bytes]


def encode_entry(
    state: NamespaceState, entry: PreparedEntry, entry_id: int, now: float
) -> tuple[EntryRecord, dict[bytes, bytes]]:
    """The entry's record and every field of its hash (an outputs-only entry has no chunk fields and no crcs)."""
    fields: dict[bytes, bytes] = {}
    crcs: list[int] = []
    arrays = state.arrays(entry.length)
    for layer in range(state.layout.layers if entry.maps is not None else 0):
        assert entry.maps is not None
        for array, chunk in zip(arrays, state.codec.encode_layer(entry.maps[layer]), strict=True):
            data = bytes(chunk)
            fields[chunk_field(array.name, layer)] = data
            crcs.append(crc32c.crc32c(data))
    outputs_crc = None
    if entry.outputs is not None:
        data = entry.outputs.tobytes()
        fields[OUTPUTS_FIELD] = data
        outputs_crc = crc32c.crc32c(data)
    record = EntryRecord(
        id=entry_id,
        slot=entry_id,
        length=entry.length,
        created=now,
        token_hash=entry.token_hash,
        crcs=tuple(crcs),
        nbytes=sum(len(value) for value in fields.values()),
        outputs_crc=outputs_crc,
        feature=None,  # kept in the namespace's features hash (see ``keys``)
        token_ids=entry.token_ids,
        writer=entry.writer,
    )
    fields[RECORD_FIELD] = record.to_bytes()
    return record, fields


def decode_record(state: NamespaceState, entry_id: int, raw: bytes | None) -> EntryRecord:
    """The record of a stored entry.

    Raises:
        EntryNotFoundError: no such entry (``raw`` is None).
        ChecksumError: the record is corrupt, or names another entry.
    """
    if raw is None:
        raise EntryNotFoundError(f"no entry {entry_id} in namespace {state.name!r}")
    try:
        record = EntryRecord.from_bytes(raw)
    except ChecksumError as exc:
        raise ChecksumError(f"entry {entry_id} of namespace {state.name!r}: {exc}") from None
    if record.id != entry_id:
        raise ChecksumError(f"entry {entry_id} of namespace {state.name!r}: its record holds id {record.id}")
    return record


def layer_fields(state: NamespaceState, layer: int) -> list[bytes]:
    """The fields of one layer's chunks (one per codec array), in array order."""
    return [chunk_field(array.name, layer) for array in state.codec.arrays(state.layout, 1)]


def decode_layers(
    state: NamespaceState, record: EntryRecord, fields: Fields, layers: Iterable[int], out: np.ndarray
) -> None:
    """Decode the listed layers of one entry into ``out`` ``(n_layers, heads, L, L)`` fp16, checking every crc32c.

    Raises:
        MapsNotStoredError: the entry stores outputs only (written back for the exact tier).
        ChecksumError: a chunk is missing, fails its crc32c or does not decode.
    """
    arrays = state.arrays(record.length)
    n_arrays = len(arrays)
    check_map_record(state, record, n_arrays)
    per_layer = []
    for layer in layers:
        chunks = []
        for k, array in enumerate(arrays):
            chunk = fields.get(chunk_field(array.name, layer))
            if chunk is None:
                raise ChecksumError(
                    f"entry {record.id} of namespace {state.name!r}: layer {layer} {array.name} chunk is missing"
                )
            if crc32c.crc32c(chunk) != record.crcs[layer * n_arrays + k]:
                raise ChecksumError(
                    f"entry {record.id} of namespace {state.name!r}: layer {layer} {array.name} chunk"
                    " fails its crc32c check"
                )
            chunks.append(chunk)
        per_layer.append(chunks)
    state.codec.decode_into(per_layer, out)


def decode_outputs(state: NamespaceState, record: EntryRecord, chunk: bytes | None) -> np.ndarray | None:
    """The entry's outputs ``(L, hidden)`` fp16, or None if it was stored without.

    Raises:
        ChecksumError: the outputs chunk is missing, fails its crc32c or has the wrong size.
    """
    if record.outputs_crc is None:
        return None
    expected = state.outputs(record.length).chunk_nbytes
    if chunk is None or crc32c.crc32c(chunk) != record.outputs_crc or len(chunk) != expected:
        raise ChecksumError(
            f"entry {record.id} of namespace {state.name!r}: outputs chunk is missing or fails its crc32c check"
        )
    return np.frombuffer(chunk, dtype="<f2").reshape(record.length, state.layout.hidden).astype(np.float16)


def entry_problems(state: NamespaceState, record: EntryRecord, fields: Fields) -> tuple[list[str], int]:
    """What is wrong with one stored entry (verify), and how many chunks were checked."""
    problems: list[str] = []
    arrays = state.arrays(record.length)
    n_arrays = len(arrays)
    checked = 0
    if not record.crcs and record.outputs_crc is not None:
        pass  # an outputs-only entry (written back for the exact tier): no map chunks to check
    elif len(record.crcs) != state.layout.layers * n_arrays:
        problems.append(f"record has {len(record.crcs)} chunk crcs, expected {state.layout.layers * n_arrays}")
    else:
        for layer in range(state.layout.layers):
            for k, array in enumerate(arrays):
                chunk = fields.get(chunk_field(array.name, layer))
                checked += 1
                if chunk is None:
                    problems.append(f"layer {layer} {array.name} chunk is missing")
                elif crc32c.crc32c(chunk) != record.crcs[layer * n_arrays + k]:
                    problems.append(f"layer {layer} {array.name} chunk: crc32c mismatch")
    if record.outputs_crc is not None:
        checked += 1
        try:
            decode_outputs(state, record, fields.get(OUTPUTS_FIELD))
        except ChecksumError:
            problems.append("outputs chunk is missing or fails its crc32c check")
    return problems, checked
