"""What the service reads of a namespace's projector blob: the safetensors header's metadata.

The blob is the client's projector (``attnstore_client.projector``) as safetensors
bytes; the service never loads its weights, but it applies the fidelity gate the
build stored in its metadata, and reads that without torch.
"""

from __future__ import annotations

import json
import struct

from attnstore.errors import ConfigError, FormatVersionError
from attnstore.protocol.gate import FidelityGate

GATE_METADATA_KEY = "attnstore.fidelity_gate"


def safetensors_metadata(blob: bytes) -> dict[str, str]:
    """The ``__metadata__`` of a safetensors header (8-byte little-endian length, then JSON).

    Raises:
        FormatVersionError: not safetensors bytes.
    """
    try:
        (size,) = struct.unpack("<Q", bytes(blob[:8]))
        header = json.loads(bytes(blob[8 : 8 + size]))
    except (struct.error, ValueError, UnicodeDecodeError) as exc:
        raise FormatVersionError("projector blob: not safetensors bytes") from exc
    if not isinstance(header, dict):
        raise FormatVersionError("projector blob: not safetensors bytes")
    return header.get("__metadata__") or {}


def gate_from_projector(blob: bytes) -> FidelityGate | None:
    """The fidelity gate stored in a projector blob; None when it has none.

    Raises:
        FormatVersionError: not safetensors bytes, or a malformed gate.
    """
    text = safetensors_metadata(blob).get(GATE_METADATA_KEY)
    if text is None:
        return None
    try:
        return FidelityGate.from_json(text)
    except ConfigError as exc:
        raise FormatVersionError(f"projector blob: {exc}") from None
