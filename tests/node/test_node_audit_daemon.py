"""`attnstore node --audit-rate`: a node on a write token catches a row poisoned by another write token, answers
the recomputed row, quarantines it at the daemon (named with its writer) and counts it in its metrics."""

from __future__ import annotations

from pathlib import Path

import httpx
import numpy as np
import torch

from attnstore.protocol import keys as protocol_keys
from attnstore.protocol.requests import exact_request
from attnstore.protocol.write_back import row_to_pb
from attnstore_client.adapters.batch import tokenize
from attnstore_client.keys import model_fingerprint
from attnstore_tools.admin.cold_start import create_exact_namespace
from tests.support.caches import plain_hidden, sentences
from tests.support.daemon import ADMIN_TOKEN, OTHER_WRITE_TOKEN, WRITE_TOKEN, DaemonProcess
from tests.support.nodes import NodeProcess, save_tiny_bert


def test_a_node_auditing_every_hit_catches_a_poisoned_row_and_answers_the_computed_one(tmp_path: Path) -> None:
    folder = tmp_path / "model"
    loaded = save_tiny_bert(folder)
    fingerprint = model_fingerprint(loaded.model, loaded.tokenizer)
    by_length: dict[int, list[tuple[str, list[int]]]] = {}
    for text in sentences(200, seed=52, min_words=8, max_words=8):
        ids = list(tokenize(loaded.tokenizer, [text]).row_ids(0))
        by_length.setdefault(len(ids), []).append((text, ids))
    (victim, victim_ids), (decoy, _) = next(pair[:2] for pair in by_length.values() if len(pair) >= 2)
    poison = plain_hidden(loaded, [decoy])[0].to(torch.float16).numpy()
    daemon = DaemonProcess(tmp_path / "store", tmp_path, extra_args=("--admit-after", "1")).start()
    node = None
    try:
        with daemon.client(ADMIN_TOKEN) as admin:
            create_exact_namespace(admin, loaded, "default")
        with daemon.client(WRITE_TOKEN) as hostile:
            key = protocol_keys.token_hash(np.asarray(victim_ids))
            hostile.lookup(exact_request("default", fingerprint, [key], [len(victim_ids)]))
            assert hostile.write_back("default", fingerprint,
                                      [row_to_pb(np.asarray(victim_ids), poison, None, None, 0)]).stored == 1
        node = NodeProcess(str(folder), f"grpc://{daemon.target}", tmp_path / "node",
                           args=("--token", OTHER_WRITE_TOKEN, "--audit-rate", "1", "--no-warmup",
                                 "--max-wait-ms", "1")).start()
        body = {"model": str(folder), "input": [victim], "encoding_format": "float"}
        with node.counting():
            answer = httpx.post(f"{node.url}/v1/embeddings", json=body, timeout=60).json()["data"][0]["embedding"]
        expected = plain_hidden(loaded, [victim])[0].mean(dim=0)
        cosine = torch.nn.functional.cosine_similarity(torch.tensor(answer), expected, dim=0).item()
        assert cosine >= 0.9999
        assert (node.metric("attnstore_node_audited_rows_total"),
                node.metric("attnstore_node_audit_mismatches_total")) == (1, 1)
        assert "event=audit_mismatch" in node.log() and "writer=node-a" in node.log()
        with daemon.client(ADMIN_TOKEN) as admin:
            (held,) = admin.list_quarantine("default")
        assert (held.writer, held.reporter, bytes(held.key)) == ("node-a", "node-b", key)
        assert node.stop() == 0
    finally:
        if node is not None:
            node.kill()
        assert daemon.stop() == 0, daemon.log()
