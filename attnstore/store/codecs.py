"""Map codecs: how one layer's maps ``(heads, L, L)`` become stored objects (one per zarr array) and back.

Every codec writes standard zarr v3 arrays, so zarr decodes the same bytes:

- ``fp16``: raw little-endian float16 (zarr ``bytes`` codec). Exact for fp16
  input; fp32 input is rounded to fp16 (relative error <= 2**-11).
- ``zstd``: fp16 then zstd (numcodecs ``Zstd``, which is what zarr's ``zstd``
  codec calls). Lossless over fp16.
- ``q8``: per-row 8-bit. For each row of a map (one query position, values in
  [0, 1] after softmax), scale ``s = row_max / 255`` stored as fp16 (rounded up
  so ``255 * s >= row_max``), codes ``round(x / s)`` as uint8. Two arrays:
  ``maps`` (uint8 codes) and ``scales`` (fp16, one per row); ``x = code * s``.
  Error bound: ``|x - x_hat| <= s / 2 <= row_max / 510 * (1 + 2**-10) + 2**-25``,
  and returning ``x_hat`` as fp16 adds at most ``2**-11 * row_max`` more:
  see :func:`q8_error_bound`.
- ``q8+zstd``: q8 with zstd over the codes (the scales are small and stay raw).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any, ClassVar

import numpy as np
from numcodecs.zstd import Zstd

from attnstore.errors import ChecksumError, ConfigError
from attnstore.protocol.records import CODECS, NamespaceLayout
from attnstore.store.zarr_layout import ArrayDtype, ZarrArray, bytes_codec, zstd_codec

# zstd level 1: on SmolLM2-shaped softmax maps, fp16 compresses to 46.1% at
# levels 1, 3, 6 and 9 alike and q8 codes to 11.5% at level 1 (12.2% at 3),
# while level 1 encodes about 3x faster than level 3.
ZSTD_LEVEL = 1

_MAP_DIMS = ("slot", "layer", "head", "row", "col")
_SCALE_DIMS = ("slot", "layer", "head", "row")

ObjectBytes = bytes | memoryview


# torch runs an elementwise op on the calling thread when it has fewer elements
# than its grain size (at::internal::GRAIN_SIZE); bigger ops wake its thread pool,
# which on a busy host costs milliseconds, more than the cast itself.
_TORCH_GRAIN = 32768


def cast_into(dst: np.ndarray, src: np.ndarray) -> None:
    """Cast C-contiguous ``src`` into C-contiguous ``dst`` of the same shape (e.g. fp32 to fp16).

    numpy casts float32 to float16 in scalar code (about 90 ms for one SmolLM2
    entry here); torch's cast uses the F16C instructions, over 10x faster, so
    the cast goes through torch, over the same buffers, in single-thread pieces.
    torch is imported on the first cast: a daemon fed fp16 maps never needs it.
    """
    import torch

    flat_dst, flat_src = torch.from_numpy(dst.reshape(-1)), torch.from_numpy(src.reshape(-1))
    for start in range(0, flat_src.numel(), _TORCH_GRAIN):
        flat_dst[start : start + _TORCH_GRAIN].copy_(flat_src[start : start + _TORCH_GRAIN])


def to_fp16(array: np.ndarray) -> np.ndarray:
    """A C-contiguous float16 version of ``array`` (itself if it already is one)."""
    if array.dtype == np.float16 and array.flags.c_contiguous:
        return array
    out = np.empty(array.shape, dtype=np.float16)
    cast_into(out, np.ascontiguousarray(array))
    return out


def q8_error_bound(row_max: np.ndarray | float) -> np.ndarray | float:
    """Largest ``|x - x_hat|`` of the q8 codecs for a row whose maximum is ``row_max``.

    Quantisation (``s / 2`` with ``s`` the fp16 scale rounded up) plus rounding the
    result to fp16: ``row_max * (1/510 + 1/2048) * (1 + 2**-10) + 2**-24``.
    """
    return row_max * (1 / 510 + 1 / 2048) * (1 + 2**-10) + 2**-24


def q8_quantize(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Quantise non-negative rows (last axis) to uint8 codes and one fp16 scale per row.

    Args:
        rows: ``(..., n)`` float array, values >= 0 (attention probabilities).

    Returns:
        ``(codes, scales)``: ``(..., n)`` uint8 and ``(...)`` float16.
    """
    x = np.asarray(rows, dtype=np.float32)
    row_max = x.max(axis=-1)  # (...)
    scales = (row_max / 255).astype(np.float16)  # (...)
    # Rounding to fp16 may have shrunk the scale: one ulp up keeps 255 * s >= row_max.
    low = scales.astype(np.float32) * 255 < row_max
    scales[low] = np.nextafter(scales[low], np.float16(np.inf))
    s = scales.astype(np.float32)[..., None]  # (..., 1)
    codes = np.rint(np.divide(x, s, out=np.zeros_like(x), where=s > 0))  # (..., n)
    return np.clip(codes, 0, 255).astype(np.uint8), scales


class MapCodec(ABC):
    """Encodes one layer's maps into one stored object per zarr array, and decodes them back."""

    # Its name in NamespaceLayout.codec: a class attribute, or set per instance (Q8Codec).
    name: str
    # True when the stored bytes of the single array are the decoded fp16 bytes, so
    # the reader copies them itself (a memoryview copy, no per-layer codec call).
    raw_fp16: ClassVar[bool] = False

    @abstractmethod
    def arrays(self, layout: NamespaceLayout, length: int) -> tuple[ZarrArray, ...]:
        """The zarr arrays of one length bucket (maps first)."""

    @abstractmethod
    def encode_layer(self, layer: np.ndarray) -> tuple[ObjectBytes, ...]:
        """Stored bytes of one layer ``(heads, L, L)`` (fp32 or fp16), one per array."""

    @abstractmethod
    def decode_into(self, layers: Sequence[Sequence[ObjectBytes]], out: np.ndarray) -> None:
        """Decode layers into ``out``, a contiguous ``(n_layers, heads, L, L)`` fp16 array.

        Args:
            layers: per layer, its stored objects (one per array), in the order of ``out``.
            out: destination.

        Raises:
            ChecksumError: a stored object does not decode to the expected size.
        """


def _maps_array(
    layout: NamespaceLayout,
    length: int,
    dtype: ArrayDtype,
    codecs: tuple[dict[str, Any], ...],
    codec_name: str,
    **attributes: str,
) -> ZarrArray:
    return ZarrArray(
        name="maps",
        dtype=dtype,
        inner_shape=(layout.heads, length, length),
        per_layer=True,
        zarr_codecs=codecs,
        dimension_names=_MAP_DIMS,
        attributes={"attnstore_codec": codec_name, "causal": layout.causal, **attributes},
    )


class Fp16Codec(MapCodec):
    """Raw little-endian fp16 (the default)."""

    name = "fp16"
    raw_fp16 = True

    def arrays(self, layout: NamespaceLayout, length: int) -> tuple[ZarrArray, ...]:
        """The bucket's ``maps`` array, fp16, no compression."""
        return (_maps_array(layout, length, "float16", (bytes_codec("float16"),), self.name),)

    def encode_layer(self, layer: np.ndarray) -> tuple[ObjectBytes, ...]:
        """The layer's fp16 bytes (no copy when it is already contiguous fp16)."""
        return (to_fp16(layer).data.cast("B"),)

    def decode_into(self, layers: Sequence[Sequence[ObjectBytes]], out: np.ndarray) -> None:
        """Copy the stored bytes into ``out``."""
        for (stored,), dst in zip(layers, out, strict=True):
            if len(stored) != dst.nbytes:
                raise ChecksumError(f"fp16 layer has {len(stored)} bytes, expected {dst.nbytes}")
            np.copyto(dst.reshape(-1).view(np.uint8), np.frombuffer(stored, dtype=np.uint8))


class ZstdMapCodec(MapCodec):
    """fp16 compressed with zstd (lossless)."""

    name = "zstd"

    def __init__(self, level: int = ZSTD_LEVEL) -> None:
        self._level = level
        self._zstd = Zstd(level=level)

    def arrays(self, layout: NamespaceLayout, length: int) -> tuple[ZarrArray, ...]:
        """The bucket's ``maps`` array, fp16 then zstd."""
        codecs = (bytes_codec("float16"), zstd_codec(self._level))
        return (_maps_array(layout, length, "float16", codecs, self.name),)

    def encode_layer(self, layer: np.ndarray) -> tuple[ObjectBytes, ...]:
        """The layer's fp16 bytes, zstd-compressed."""
        return (self._zstd.encode(to_fp16(layer)),)

    def decode_into(self, layers: Sequence[Sequence[ObjectBytes]], out: np.ndarray) -> None:
        """Decompress straight into ``out``."""
        for (stored,), dst in zip(layers, out, strict=True):
            try:
                self._zstd.decode(stored, out=dst)
            except (RuntimeError, ValueError) as exc:
                raise ChecksumError(f"zstd layer does not decode to {dst.nbytes} bytes: {exc}") from None


class Q8Codec(MapCodec):
    """Per-row 8-bit codes with an fp16 scale per row; optionally zstd over the codes."""

    def __init__(self, zstd_level: int | None = None) -> None:
        self.name = "q8" if zstd_level is None else "q8+zstd"
        self._level = zstd_level
        self._zstd = None if zstd_level is None else Zstd(level=zstd_level)

    def arrays(self, layout: NamespaceLayout, length: int) -> tuple[ZarrArray, ...]:
        """The bucket's ``maps`` (uint8 codes) and ``scales`` (fp16 per row) arrays."""
        codecs: tuple[dict[str, Any], ...] = (bytes_codec("uint8"),)
        if self._level is not None:
            codecs += (zstd_codec(self._level),)
        maps = _maps_array(
            layout,
            length,
            "uint8",
            codecs,
            self.name,
            dequantize=f"value = maps * scales[..., None], with scales the array <namespace>/scales/L{length}",
        )
        scales = ZarrArray(
            name="scales",
            dtype="float16",
            inner_shape=(layout.heads, length),
            per_layer=True,
            zarr_codecs=(bytes_codec("float16"),),
            dimension_names=_SCALE_DIMS,
        )
        return (maps, scales)

    def encode_layer(self, layer: np.ndarray) -> tuple[ObjectBytes, ...]:
        """Codes (zstd-compressed for q8+zstd) and scales of one layer."""
        codes, scales = q8_quantize(layer)  # (heads, L, L) uint8, (heads, L) fp16
        code_bytes: ObjectBytes = codes.data.cast("B")
        if self._zstd is not None:
            code_bytes = self._zstd.encode(codes)
        return (code_bytes, np.ascontiguousarray(scales).data.cast("B"))

    def decode_into(self, layers: Sequence[Sequence[ObjectBytes]], out: np.ndarray) -> None:
        """Dequantise into ``out``, one layer at a time through an fp32 buffer that stays in cache."""
        _, heads, length, _ = out.shape
        values = np.empty((heads, length, length), dtype=np.float32)
        codes = np.empty((heads, length, length), dtype=np.uint8)
        for (stored_codes, stored_scales), dst in zip(layers, out, strict=True):
            if len(stored_scales) != 2 * heads * length:
                raise ChecksumError(f"q8 scales have {len(stored_scales)} bytes, expected {2 * heads * length}")
            if self._zstd is None:
                if len(stored_codes) != codes.size:
                    raise ChecksumError(f"q8 codes have {len(stored_codes)} bytes, expected {codes.size}")
                layer_codes = np.frombuffer(stored_codes, dtype=np.uint8).reshape(heads, length, length)
            else:
                try:
                    self._zstd.decode(stored_codes, out=codes)
                except (RuntimeError, ValueError) as exc:
                    raise ChecksumError(f"q8 codes do not decode to {codes.size} bytes: {exc}") from None
                layer_codes = codes
            scales = np.frombuffer(stored_scales, dtype="<f2").reshape(heads, length)
            np.multiply(layer_codes, scales.astype(np.float32)[..., None], out=values)  # (heads, L, L)
            cast_into(dst, values)


def codec_for(name: str) -> MapCodec:
    """The codec called ``name``.

    Raises:
        ConfigError: ``name`` is not one of the supported codecs.
    """
    if name == "fp16":
        return Fp16Codec()
    if name == "zstd":
        return ZstdMapCodec()
    if name == "q8":
        return Q8Codec()
    if name == "q8+zstd":
        return Q8Codec(zstd_level=ZSTD_LEVEL)
    raise ConfigError(f"codec {name!r} is not supported; choose one of {CODECS}")
