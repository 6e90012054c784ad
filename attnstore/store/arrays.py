"""A namespace's arrays: its codec and the zarr arrays of each length bucket.

Shared by every backend: the array layout (``zarr_layout``) is the store's
format whatever holds the bytes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from attnstore.protocol.records import NamespaceInfo, NamespaceLayout
from attnstore.store.codecs import MapCodec, codec_for
from attnstore.store.zarr_layout import ZarrArray, outputs_array


@dataclass
class NamespaceState:
    """A namespace's immutable layout with its codec and per-length zarr arrays."""

    name: str
    layout: NamespaceLayout
    codec: MapCodec
    _arrays: dict[int, tuple[ZarrArray, ...]] = field(default_factory=dict)
    _outputs: dict[int, ZarrArray] = field(default_factory=dict)

    @classmethod
    def of(cls, info: NamespaceInfo) -> NamespaceState:
        """State for ``info``."""
        return cls(name=info.name, layout=info.layout, codec=codec_for(info.layout.codec))

    def arrays(self, length: int) -> tuple[ZarrArray, ...]:
        """The map arrays of bucket ``length`` (maps first; q8 adds scales)."""
        arrays = self._arrays.get(length)
        if arrays is None:
            arrays = self._arrays[length] = self.codec.arrays(self.layout, length)
        return arrays

    def outputs(self, length: int) -> ZarrArray:
        """The exact-tier outputs array of bucket ``length``."""
        array = self._outputs.get(length)
        if array is None:
            array = self._outputs[length] = outputs_array(length, self.layout.hidden)
        return array

    def all_arrays(self, length: int) -> tuple[ZarrArray, ...]:
        """Map arrays then the outputs array of bucket ``length``."""
        return self.arrays(length) + (self.outputs(length),)

    def group_names(self) -> tuple[str, ...]:
        """Names of the groups under the namespace group (one per array kind)."""
        return tuple(a.name for a in self.all_arrays(1))
