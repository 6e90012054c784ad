"""Importing the store package stays light: lmdb and zarr load only with the classes that need them."""

from __future__ import annotations

import subprocess
import sys

_PROBE = """
import sys
import attnstore.store
from attnstore.store import MemoryMapStore, NamespaceLayout, NewEntry
light = ("lmdb" in sys.modules, "zarr" in sys.modules)
from attnstore.store import LmdbMapStore
print(light, ("lmdb" in sys.modules, "zarr" in sys.modules))
"""


def test_the_package_and_the_memory_store_import_neither_lmdb_nor_zarr():
    out = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, check=True).stdout
    assert out.split("\n")[0] == "(False, False) (True, False)"
