"""The inference-node library must not pull in the store's backends."""

from __future__ import annotations

import json
import subprocess
import sys

_PROBE = """
import importlib, json, pkgutil, sys
import attnstore_client
names = [m.name for m in pkgutil.walk_packages(attnstore_client.__path__, "attnstore_client.")]
for name in names:
    importlib.import_module(name)
# Connecting to a daemon must not load the embedded store either.
from attnstore_client.connection import connect
connect("grpc://127.0.0.1:1").close()
print(json.dumps({"modules": names, "backends": [m for m in ("faiss", "lmdb", "zarr") if m in sys.modules]}))
"""


def test_importing_every_client_module_imports_no_faiss_lmdb_or_zarr():
    result = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=300, check=True)
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert {
        "attnstore_client.models",
        "attnstore_client.adapters.llama",
        "attnstore_client.cache",
        "attnstore_client.connection",
        "attnstore_client.connection.remote",
        "attnstore_client.connection.local",
        "attnstore_client.prefill",
        "attnstore_client.resilience",
        "attnstore_client.stats",
    } <= set(report["modules"])
    assert report["backends"] == []
