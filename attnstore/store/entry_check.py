"""What verify finds wrong with one stored entry's objects, whatever holds their bytes (written once for every backend).

An entry's record lists a crc32c per stored object of its maps (layer by layer, one
object per codec array, ``zarr_layout``) and one for its outputs; verify reads every
object and compares. A backend hands over how it reads one object; the rules and the
words of each problem are here.
"""

from __future__ import annotations

from collections.abc import Callable

import crc32c

from attnstore.store.arrays import NamespaceState
from attnstore.store.entry_record import EntryRecord
from attnstore.store.zarr_layout import ZarrArray

StoredBytes = bytes | memoryview
# The stored object of one array at one layer, None where it is missing.
ObjectReader = Callable[[ZarrArray, int], StoredBytes | None]


def entry_problems(
    state: NamespaceState, record: EntryRecord, read: ObjectReader, outputs: StoredBytes | None
) -> tuple[list[str], int]:
    """What is wrong with one stored entry's objects, and how many objects were checked.

    Args:
        state: the entry's namespace.
        record: the entry's record (its crcs).
        read: reads the stored object of an array (of ``state.arrays(record.length)``) at a layer.
        outputs: the stored outputs (None where missing; not read for an entry stored without).

    Returns:
        The problems, in layer order (empty: the entry is sound), and the objects checked.
    """
    problems: list[str] = []
    arrays = state.arrays(record.length)
    n_arrays = len(arrays)
    checked = 0
    if not record.crcs and record.outputs_crc is not None:
        pass  # an outputs-only entry (written back for the exact tier): no maps to check
    elif len(record.crcs) != state.layout.layers * n_arrays:
        problems.append(f"record has {len(record.crcs)} crcs, expected {state.layout.layers * n_arrays}")
    else:
        for layer in range(state.layout.layers):
            for k, array in enumerate(arrays):
                stored = read(array, layer)
                checked += 1
                if stored is None:
                    problems.append(f"layer {layer} {array.name} are missing")
                elif crc32c.crc32c(stored) != record.crcs[layer * n_arrays + k]:
                    problems.append(f"layer {layer} {array.name}: crc32c mismatch")
    if record.outputs_crc is not None:
        checked += 1
        if (
            outputs is None
            or crc32c.crc32c(outputs) != record.outputs_crc
            or len(outputs) != state.outputs(record.length).object_nbytes
        ):
            problems.append("outputs are missing or fail their crc32c check")
    return problems, checked
