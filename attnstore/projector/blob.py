"""A namespace's projector blob: safetensors bytes whose header metadata carries the gate and the int8 plan.

The blob is the projector (``attnstore.projector.network``) as safetensors
bytes. Servers check a blob before storing it and apply the fidelity gate the
build put in its metadata, reading it without torch. A namespace's stored blob
may also hold the model's embedding layer (tensors under ``embedding_layer.``,
see ``attnstore.projector.embedding_layer``): what its daemon derives written-back rows'
features with. It stays on the daemon: a client is sent the blob without it.
The ``safetensors`` library checks the whole blob (header, dtypes, offsets);
the metadata is then read from its header.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import TypeVar

import safetensors
import safetensors.numpy

from attnstore.errors import ConfigError, FormatVersionError, WireFormatError
from attnstore.projector.gate import FidelityGate
from attnstore.projector.int8_plan import INT8_METADATA_KEY, Int8Plan

GATE_METADATA_KEY = "attnstore.fidelity_gate"
# The embedding layer's tensors and its record (kind, norm epsilon, positions) in a stored projector blob.
EMBEDDING_LAYER_PREFIX = "embedding_layer."
EMBEDDING_LAYER_METADATA_KEY = "attnstore.embedding_layer"

T = TypeVar("T")


def projector_metadata(blob: bytes) -> dict[str, str]:
    """The ``__metadata__`` of a projector blob, once the safetensors library has accepted it.

    Raises:
        WireFormatError: the blob is not valid safetensors bytes (the library's reason in the message).
    """
    data = bytes(blob)
    try:
        safetensors.deserialize(data)
    except Exception as exc:  # the library raises its own SafetensorError, or ValueError on bad JSON
        raise WireFormatError(f"projector blob ({len(data)} bytes) is not safetensors: {exc}") from None
    size = int.from_bytes(data[:8], "little")
    metadata = json.loads(data[8 : 8 + size]).get("__metadata__") or {}
    return {str(key): str(value) for key, value in metadata.items()}


def same_weights(a: bytes, b: bytes) -> bool:
    """Whether two projector blobs hold the same projector tensors (their metadata, such as the gate, and
    whether they carry the embedding layer may differ).

    Features depend on the projector's weights alone (an embedding layer added to the same projector
    derives the features it made): a blob that only changes the gate projects as before.
    A blob that does not parse (a damaged stored one) holds no weights to compare: False.
    """
    try:
        return _projector_tensors(a) == _projector_tensors(b)
    except Exception:  # the library's SafetensorError, or ValueError on a bad header
        return False


def _projector_tensors(blob: bytes) -> list[tuple[str, object]]:
    tensors = safetensors.deserialize(bytes(blob))
    return sorted(item for item in tensors if not item[0].startswith(EMBEDDING_LAYER_PREFIX))


def has_embedding_layer(blob: bytes | None) -> bool:
    """Whether a (checked) projector blob carries the model's embedding layer."""
    return blob is not None and EMBEDDING_LAYER_METADATA_KEY in projector_metadata(blob)


def without_embedding_layer(blob: bytes) -> bytes:
    """The projector blob a client is sent: ``blob`` less its embedding layer (itself when it has none).

    A client projects with the model it runs; the layer (tens of MB) is the daemon's alone.

    Raises:
        WireFormatError: the blob is not valid safetensors bytes.
    """
    metadata = projector_metadata(blob)
    if EMBEDDING_LAYER_METADATA_KEY not in metadata:
        return bytes(blob)
    tensors = {name: array for name, array in safetensors.numpy.load(bytes(blob)).items()
               if not name.startswith(EMBEDDING_LAYER_PREFIX)}
    del metadata[EMBEDDING_LAYER_METADATA_KEY]
    return safetensors.numpy.save(tensors, metadata=metadata)


def gate_from_projector(blob: bytes) -> FidelityGate | None:
    """The fidelity gate stored in a projector blob; None when it has none.

    Raises:
        FormatVersionError: a stored blob that is not safetensors, or a malformed gate.
    """
    return _stored_record(blob, GATE_METADATA_KEY, FidelityGate.from_json)


def int8_plan_from_projector(blob: bytes) -> Int8Plan | None:
    """The int8 plan stored in a projector blob (``attnstore.projector.int8_plan``); None when it has none.

    Raises:
        FormatVersionError: a stored blob that is not safetensors, or a malformed plan.
    """
    return _stored_record(blob, INT8_METADATA_KEY, Int8Plan.from_json)


def _stored_record(blob: bytes, key: str, parse: Callable[[str], T]) -> T | None:
    """The record under ``key`` of a stored blob's metadata, parsed; None when it has none."""
    try:
        text = projector_metadata(blob).get(key)
    except WireFormatError as exc:
        raise FormatVersionError(str(exc)) from None
    if text is None:
        return None
    try:
        return parse(text)
    except ConfigError as exc:
        raise FormatVersionError(f"projector blob: {exc}") from None
