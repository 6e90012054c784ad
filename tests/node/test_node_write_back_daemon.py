"""Two nodes on one real daemon with write-back: a line computed through one is an exact hit through the other."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import numpy as np

from attnstore_tools.admin.cold_start import create_exact_namespace
from tests.support.caches import sentences
from tests.support.daemon import ADMIN_TOKEN, READ_TOKEN, WRITE_TOKEN, DaemonProcess
from tests.support.nodes import NodeProcess, save_tiny_bert


def _rows_by_tier(node: NodeProcess) -> dict[str, float]:
    rows = {}
    for line in httpx.get(f"{node.url}/metrics", timeout=10).text.splitlines():
        if line.startswith("attnstore_node_rows_total{"):
            rows[line.split('"')[1]] = float(line.split()[-1])
    return rows


def test_a_line_computed_through_one_node_is_an_exact_hit_through_the_other(tmp_path: Path) -> None:
    folder = tmp_path / "model"
    loaded = save_tiny_bert(folder)
    daemon = DaemonProcess(tmp_path / "store", tmp_path, extra_args=("--admit-after", "1")).start()
    nodes: list[NodeProcess] = []
    try:
        with daemon.client(ADMIN_TOKEN) as admin:
            create_exact_namespace(admin, loaded, "default")
        args = ("--token", WRITE_TOKEN, "--write-back", "--no-warmup", "--max-wait-ms", "1")
        for name in ("a", "b"):
            nodes.append(NodeProcess(str(folder), f"grpc://{daemon.target}", tmp_path / name, args=args).start())
        line = sentences(1, seed=5)[0]
        body = {"model": str(folder), "input": [line], "encoding_format": "float"}
        first = httpx.post(f"{nodes[0].url}/v1/embeddings", json=body, timeout=60).json()
        assert _rows_by_tier(nodes[0])["computed"] == 1
        with daemon.client(READ_TOKEN) as reader:  # write-back is off the request's path: wait for it to land
            deadline = time.monotonic() + 30
            while reader.stats().written_back_entries < 1:
                assert time.monotonic() < deadline, "the computed row was never written back"
                time.sleep(0.05)
        second = httpx.post(f"{nodes[1].url}/v1/embeddings", json=body, timeout=60).json()
        rows = _rows_by_tier(nodes[1])
        assert (rows["store_exact"], rows["computed"]) == (1, 0)
        np.testing.assert_allclose(second["data"][0]["embedding"], first["data"][0]["embedding"], atol=2e-3)  # fp16
        assert [node.stop() for node in nodes] == [0, 0]
    finally:
        for node in nodes:
            node.kill()
        assert daemon.stop() == 0, daemon.log()
