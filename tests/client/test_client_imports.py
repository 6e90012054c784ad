"""The inference-node library's boundary: what it may import of the service, and what it never loads."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

CLIENT = Path(__file__).resolve().parents[2] / "client"
# What the client shares with servers; the store (through the service) only for embedded mode, in one module.
ALLOWED = ("attnstore.errors", "attnstore.protocol")
EMBEDDED_MODULE = CLIENT / "connection" / "local.py"

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


def _service_imports(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    names = [alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names]
    names += [node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module]
    return [name for name in names if name == "attnstore" or name.startswith("attnstore.")]


def test_the_client_imports_only_errors_and_protocol_and_the_service_from_one_module() -> None:
    outside = {
        f"{path.relative_to(CLIENT)}: {name}"
        for path in sorted(CLIENT.rglob("*.py"))
        for name in _service_imports(path)
        if not name.startswith(ALLOWED) and not (path == EMBEDDED_MODULE and name == "attnstore.service")
    }
    assert outside == set()
    assert "attnstore.service" in _service_imports(EMBEDDED_MODULE)  # the one door to the store


def test_importing_every_client_module_imports_no_faiss_lmdb_or_zarr() -> None:
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
