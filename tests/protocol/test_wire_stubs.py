"""The checked-in wire stubs are exactly what the proto generates."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
STUBS = ("attnstore_pb2.py", "attnstore_pb2.pyi", "attnstore_pb2_grpc.py")


def test_checked_in_stubs_match_the_proto(tmp_path: Path) -> None:
    pytest.importorskip("grpc_tools")
    subprocess.run(["bash", str(ROOT / "scripts" / "gen_proto.sh"), str(tmp_path)], check=True)
    for name in STUBS:
        fresh = (tmp_path / "attnstore" / "protocol" / "v1" / name).read_bytes()
        checked_in = (ROOT / "attnstore" / "protocol" / "v1" / name).read_bytes()
        assert fresh == checked_in, f"attnstore/protocol/v1/{name} drifted from the proto: run scripts/gen_proto.sh"


def test_stubs_import_and_expose_the_service() -> None:
    from attnstore.protocol.v1 import attnstore_pb2, attnstore_pb2_grpc

    assert hasattr(attnstore_pb2_grpc, "AttnStoreServicer")
    names = {m.name for m in attnstore_pb2.DESCRIPTOR.services_by_name["AttnStore"].methods}
    assert {"Lookup", "Search", "Fetch", "Prefetch", "Ingest", "Delete", "Compact", "Stats"} <= names
