"""A namespace's projector blob: safetensors bytes whose header metadata carries the gate.

The blob is the client's projector (``attnstore_client.projector``) as safetensors
bytes. Servers check a blob before storing it and apply the fidelity gate the
build put in its metadata; they never load its weights, and read it without torch.
The ``safetensors`` library checks the whole blob (header, dtypes, offsets);
the metadata is then read from its header.
"""

from __future__ import annotations

import json

import safetensors

from attnstore.errors import ConfigError, FormatVersionError, WireFormatError
from attnstore.protocol.gate import FidelityGate

GATE_METADATA_KEY = "attnstore.fidelity_gate"


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
    """Whether two projector blobs hold the same tensors (their metadata, such as the gate, may differ).

    Features depend on the weights alone: a blob that only changes the gate projects as before.
    A blob that does not parse (a damaged stored one) holds no weights to compare: False.
    """
    try:
        return sorted(safetensors.deserialize(bytes(a))) == sorted(safetensors.deserialize(bytes(b)))
    except Exception:  # the library's SafetensorError, or ValueError on a bad header
        return False


def gate_from_projector(blob: bytes) -> FidelityGate | None:
    """The fidelity gate stored in a projector blob; None when it has none.

    Raises:
        FormatVersionError: a stored blob that is not safetensors, or a malformed gate.
    """
    try:
        text = projector_metadata(blob).get(GATE_METADATA_KEY)
    except WireFormatError as exc:
        raise FormatVersionError(str(exc)) from None
    if text is None:
        return None
    try:
        return FidelityGate.from_json(text)
    except ConfigError as exc:
        raise FormatVersionError(f"projector blob: {exc}") from None
