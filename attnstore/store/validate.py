"""Checks a new entry against its namespace and normalises it for storing.

Everything is checked before anything is written, so bad input writes nothing.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from attnstore.errors import MapShapeError, shown
from attnstore.protocol.keys import TOKEN_HASH_BYTES, TokenHash
from attnstore.protocol.records import NamespaceLayout, NewEntry
from attnstore.store.codecs import to_fp16

# Attention probabilities are in [0, 1]; the slack absorbs fp16 rounding of sums.
_PROB_MAX = 1.0 + 1e-3
# Weight above the diagonal tolerated in a causal namespace (masked softmax gives 0).
_CAUSAL_TOL = 1e-6
# Largest fp16 bit pattern accepted: the fp16 value just above 1.0 (1 + 2**-10).
_FP16_PROB_MAX_BITS = np.uint16(0x3C01)
# How far a row of a map may sum from 1: a softmax row in fp16 is off by at most L * 2**-11 relative rounding
# (under 1e-3), so this refuses only what is no distribution at all (zeros, logits, a scaled row).
_ROW_SUM_TOL = 1e-2


@dataclass(frozen=True, slots=True)
class PreparedEntry:
    """A checked entry, in the dtypes it is stored from."""

    maps: np.ndarray | None  # (layers, heads, L, L) float16 (lossless codecs) or float32 (q8); None: outputs only
    token_hash: TokenHash
    outputs: np.ndarray | None  # (L, hidden) float16
    feature: np.ndarray | None  # (feature_dim,) float32
    token_ids: np.ndarray | None  # (L,) uint32
    writer: str | None = None  # who wrote it back (see NewEntry.writer)

    @property
    def length(self) -> int:
        """Token length L."""
        if self.maps is not None:
            return self.maps.shape[-1]
        assert self.outputs is not None  # prepare_entry refuses an entry with neither
        return self.outputs.shape[0]


def _to_numpy(value: object, what: str, float_dtypes_only: bool) -> np.ndarray:
    if isinstance(value, np.ndarray):
        return value
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(value, torch.Tensor):
        tensor = value.detach()
        if tensor.dtype == torch.bfloat16 and not float_dtypes_only:
            tensor = tensor.float()
        if tensor.dtype == torch.bfloat16:
            raise MapShapeError(f"{what} dtype bfloat16 is not supported; expected float32 or float16")
        return tensor.cpu().numpy()
    raise MapShapeError(f"{what} must be a numpy array or a torch tensor, got {type(value).__name__}")


@lru_cache(maxsize=64)
def _above_diagonal(length: int) -> np.ndarray:
    return ~np.tri(length, dtype=bool)  # (L, L) True strictly above the diagonal


def _value_range(maps: np.ndarray) -> tuple[float, float, float]:
    """(min, max, max strictly above the diagonal) of the maps; NaN propagates.

    fp16 input is checked through its bit patterns: numpy reduces fp16 in scalar
    code (~15x slower), and for non-negative fp16 values the uint16 order is the
    value order, while a sign bit, inf or NaN makes the pattern larger than 1.0's.
    """
    above = _above_diagonal(maps.shape[-1])
    if maps.dtype == np.float16:
        bits = maps.view(np.uint16)
        hi_bits = np.uint16(bits.max())
        if hi_bits > _FP16_PROB_MAX_BITS:
            return float(maps.min()), float(maps.max()), float("nan")
        upper = np.uint16(bits.max(where=above, initial=0))
        return 0.0, float(hi_bits.view(np.float16)), float(upper.view(np.float16))
    return float(maps.min()), float(maps.max()), float(maps.max(where=above, initial=0.0))


def _check_maps(maps: np.ndarray, layout: NamespaceLayout, where: str) -> None:
    if maps.dtype not in (np.float32, np.float16):
        raise MapShapeError(f"{where}: maps dtype {maps.dtype} is not supported; expected float32 or float16")
    shape = tuple(maps.shape)
    if (
        len(shape) != 4
        or shape[0] != layout.layers
        or shape[1] != layout.heads
        or shape[2] != shape[3]
        or shape[2] < 1
    ):
        raise MapShapeError(
            f"{where}: maps shape {shape} does not match the namespace layout:"
            f" expected ({layout.layers}, {layout.heads}, L, L) with L >= 1"
        )
    lo, hi, upper = _value_range(maps)
    # NaN fails both comparisons, inf the second: no separate finiteness pass.
    if not (lo >= 0.0 and hi <= _PROB_MAX):
        raise MapShapeError(
            f"{where}: maps must be attention probabilities in [0, 1], got values in [{lo}, {hi}]"
            " (logits or NaN/inf?)"
        )
    if layout.causal and upper > _CAUSAL_TOL:
        raise MapShapeError(f"{where}: the namespace is causal but the maps put weight {upper} above the diagonal")
    # A map replays as attention weights: each row must be a distribution, or replay computes garbage
    # (an all-zero decoy would zero every attention output) that passes every other check.
    sums = np.add.reduce(maps, axis=-1, dtype=np.float32)  # (layers, heads, L)
    worst = float(np.abs(sums - 1.0).max())
    if worst > _ROW_SUM_TOL:
        layer, head, row = np.unravel_index(int(np.abs(sums - 1.0).argmax()), sums.shape)
        raise MapShapeError(
            f"{where}: attention rows must sum to 1 (within {_ROW_SUM_TOL}); row {row} of layer {layer} head {head}"
            f" sums to {float(sums[layer, head, row]):.4g}"
        )


def prepare_entry(entry: NewEntry, layout: NamespaceLayout, index: int = 0, *, what: str = "entry") -> PreparedEntry:
    """Check ``entry`` against ``layout`` and convert it to its stored dtypes.

    Args:
        entry: the entry to ingest.
        layout: the namespace's layout.
        index: position of the entry in its batch, for error messages.
        what: what messages call it ("entry", "write-back row").

    Returns:
        The prepared entry (maps fp16 for lossless codecs, fp32 for q8).

    Raises:
        MapShapeError: wrong type, dtype, shape or length of maps, outputs, feature,
            token hash or token ids; maps outside [0, 1]; weight above the diagonal in a
            causal namespace; non-finite outputs or feature.
    """
    where = f"{what} {index}"
    if not isinstance(entry, NewEntry):
        raise MapShapeError(f"{where}: expected a NewEntry, got {type(entry).__name__}")
    maps: np.ndarray | None = None
    if entry.maps is None:
        # An exact-tier-only entry: its length is its outputs' (checked just below).
        if entry.outputs is None:
            raise MapShapeError(f"{where}: an entry without maps needs outputs (it serves the exact tier only)")
        length = int(np.shape(entry.outputs)[0]) if np.ndim(entry.outputs) == 2 else -1
        if length < 1:
            raise MapShapeError(
                f"{where}: outputs shape {tuple(np.shape(entry.outputs))} does not match: expected (L, {layout.hidden})"
            )
    else:
        maps = _to_numpy(entry.maps, f"{where}: maps", float_dtypes_only=True)
        _check_maps(maps, layout, where)
        length = maps.shape[-1]
        maps = np.ascontiguousarray(maps, dtype=np.float32) if layout.codec.startswith("q8") else to_fp16(maps)

    token_hash = entry.token_hash
    if not isinstance(token_hash, bytes | bytearray | memoryview) or len(token_hash) != TOKEN_HASH_BYTES:
        raise MapShapeError(f"{where}: token_hash must be {TOKEN_HASH_BYTES} bytes (sha256), got {token_hash!r:.80}")

    outputs = None
    if entry.outputs is not None:
        raw = _to_numpy(entry.outputs, f"{where}: outputs", float_dtypes_only=False)
        if raw.shape != (length, layout.hidden) or raw.dtype.kind != "f":
            raise MapShapeError(
                f"{where}: outputs shape {tuple(raw.shape)} dtype {raw.dtype} does not match:"
                f" expected float ({length}, {layout.hidden})"
            )
        outputs = to_fp16(raw)
        if not np.isfinite(outputs).all():
            raise MapShapeError(f"{where}: outputs hold NaN or inf (after conversion to fp16)")

    feature = None
    if entry.feature is not None and maps is None:
        # A feature would put the entry in the map tier, which has no maps of it to replay.
        raise MapShapeError(f"{where}: an entry without maps cannot have a feature vector (nothing to replay)")
    if entry.feature is not None:
        raw = _to_numpy(entry.feature, f"{where}: feature", float_dtypes_only=False)
        if raw.shape != (layout.feature_dim,) or raw.dtype.kind != "f":
            raise MapShapeError(
                f"{where}: feature shape {tuple(raw.shape)} dtype {raw.dtype} does not match:"
                f" expected float ({layout.feature_dim},)"
            )
        feature = np.ascontiguousarray(raw, dtype=np.float32)
        if not np.isfinite(feature).all():
            raise MapShapeError(f"{where}: feature holds NaN or inf")
    token_ids = None if entry.token_ids is None else _token_ids(entry.token_ids, length, where)
    if entry.writer is not None and (not isinstance(entry.writer, str) or not 0 < len(entry.writer) <= 64):
        raise MapShapeError(f"{where}: writer must be a name of 1-64 characters, got {shown(entry.writer)}")
    return PreparedEntry(maps=maps, token_hash=TokenHash(bytes(token_hash)), outputs=outputs, feature=feature,
                         token_ids=token_ids, writer=entry.writer)


def _token_ids(value: object, length: int, where: str) -> np.ndarray:
    """``value`` as ``(length,)`` uint32 token ids."""
    raw = np.asarray(value)
    if raw.shape != (length,) or raw.dtype.kind not in "iu":
        raise MapShapeError(
            f"{where}: token_ids shape {tuple(raw.shape)} dtype {raw.dtype} does not match: expected ({length},) ints"
        )
    if raw.size and (raw.min() < 0 or raw.max() > np.iinfo(np.uint32).max):
        raise MapShapeError(f"{where}: token_ids must be in [0, 2**32), got {raw.min()}..{raw.max()}")
    return np.ascontiguousarray(raw, dtype=np.uint32)
