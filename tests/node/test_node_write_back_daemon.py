"""Two nodes on one real daemon with write-back: a line computed through one is an exact hit through the other; a
score query's prefix computed through one is served from the store through the other."""

from __future__ import annotations

from pathlib import Path

import httpx
import numpy as np
import torch
from transformers import AutoTokenizer, LlamaForCausalLM

from attnstore.protocol.prefix import DEFAULT_BLOCK_SIZE, chain_hashes, usable_blocks
from attnstore_client.connection import connect
from attnstore_client.keys import model_fingerprint
from attnstore_tools.admin.cold_start import create_exact_namespace
from tests.support.caches import WORDS, sentences
from tests.support.daemon import ADMIN_TOKEN, OTHER_WRITE_TOKEN, READ_TOKEN, WRITE_TOKEN, DaemonProcess
from tests.support.nodes import NodeProcess, save_tiny_bert, save_tiny_llama
from tests.support.wait import wait_until


def test_a_line_computed_through_one_node_is_an_exact_hit_through_the_other(tmp_path: Path) -> None:
    folder = tmp_path / "model"
    loaded = save_tiny_bert(folder)
    daemon = DaemonProcess(tmp_path / "store", tmp_path, extra_args=("--admit-after", "1")).start()
    nodes: list[NodeProcess] = []
    try:
        with daemon.client(ADMIN_TOKEN) as admin:
            create_exact_namespace(admin, loaded, "default")
        # No audit: this counts the second node's exact hit (an audited one would be computed).
        args = ("--token", WRITE_TOKEN, "--write-back", "--no-warmup", "--max-wait-ms", "1", "--audit-rate", "0")
        for name in ("a", "b"):
            nodes.append(NodeProcess(str(folder), f"grpc://{daemon.target}", tmp_path / name, args=args).start())
        line = sentences(1, seed=5)[0]
        body = {"model": str(folder), "input": [line], "encoding_format": "float"}
        with nodes[0].counting():
            first = httpx.post(f"{nodes[0].url}/v1/embeddings", json=body, timeout=60).json()
        assert nodes[0].metric('attnstore_node_rows_total{tier="computed"}') == 1
        with daemon.client(READ_TOKEN) as reader:  # write-back is off the request's path: wait for it to land
            wait_until(lambda: reader.stats().written_back_entries >= 1, 30, "the computed row written back")
        with nodes[1].counting():
            second = httpx.post(f"{nodes[1].url}/v1/embeddings", json=body, timeout=60).json()
        assert (nodes[1].metric('attnstore_node_rows_total{tier="store_exact"}'),
                nodes[1].metric('attnstore_node_rows_total{tier="computed"}')) == (1, 0)
        np.testing.assert_allclose(second["data"][0]["embedding"], first["data"][0]["embedding"], atol=2e-3)  # fp16
        assert [node.stop() for node in nodes] == [0, 0]
    finally:
        for node in nodes:
            node.kill()
        assert daemon.stop() == 0, daemon.log()


def test_a_query_prefix_computed_through_one_node_is_served_from_the_store_through_the_other(tmp_path: Path) -> None:
    folder = tmp_path / "model"
    loaded = save_tiny_llama(folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    rng = np.random.default_rng(7)
    query = "Questions and their answers follow . " + " ".join(rng.choice(WORDS, size=60)) + " . The answer is"
    items = [f" choice{i} " + " ".join(rng.choice(WORDS, size=3)) for i in range(8)]
    labels = [1037, 1038, 2003]
    daemon = DaemonProcess(tmp_path / "store", tmp_path).start()  # --admit-after 2: a block needs two writers' asks
    nodes: list[NodeProcess] = []
    try:
        with daemon.client(ADMIN_TOKEN) as admin:
            create_exact_namespace(admin, loaded, "default")
        for name, token in (("a", WRITE_TOKEN), ("b", OTHER_WRITE_TOKEN)):
            args = ("--token", token, "--write-back", "--no-warmup", "--max-wait-ms", "1")
            nodes.append(NodeProcess(str(folder), f"grpc://{daemon.target}", tmp_path / name, args=args).start())
        # Node b asks for the query's blocks first (computing its rows), then node a asks, computes the prefix once
        # and writes it back: two writers asked, so its blocks are admitted.
        asked = httpx.post(f"{nodes[1].url}/v1/score", timeout=120,
                           json={"query": query, "items": items[6:], "label_token_ids": labels})
        assert asked.status_code == 200, asked.text
        first = httpx.post(f"{nodes[0].url}/v1/score", timeout=120,
                           json={"query": query, "items": items[:4], "label_token_ids": labels})
        assert first.status_code == 200, first.text
        rows = [tokenizer(query + item)["input_ids"] for item in items[4:6]]
        chain = chain_hashes(rows[0], DEFAULT_BLOCK_SIZE, blocks=usable_blocks(len(rows[0]), DEFAULT_BLOCK_SIZE))
        fingerprint = model_fingerprint(loaded.model, loaded.tokenizer)
        with connect(f"grpc://{daemon.target}", token=READ_TOKEN) as reader:  # the prefix lands off the request's path
            wait_until(lambda: reader.prefix_layout("default") is not None and reader.match_prefix(
                "default", fingerprint, DEFAULT_BLOCK_SIZE, [chain], timeout=10)[0], 30,
                lambda: f"the query's prefix written back; the daemon's log:\n{daemon.log()[-3000:]}", poll=0.05)
        before = nodes[1].metric("attnstore_node_forward_tokens_total")
        with nodes[1].counting():
            second = httpx.post(f"{nodes[1].url}/v1/score", timeout=120,
                                json={"query": query, "items": items[4:6], "label_token_ids": labels})
            assert second.status_code == 200, second.text
        assert nodes[1].metric('attnstore_node_rows_total{tier="prefix"}') == len(rows)
        forwarded = nodes[1].metric("attnstore_node_forward_tokens_total") - before
        query_tokens = len(tokenizer(query)["input_ids"])
        assert forwarded < 0.5 * query_tokens * len(rows), (forwarded, query_tokens)
        reference = LlamaForCausalLM.from_pretrained(folder, torch_dtype=torch.float32).eval()
        with torch.inference_mode():
            expected = np.stack([torch.softmax(reference(input_ids=torch.tensor([row])).logits[0, -1].float(), -1)
                                 [labels].numpy() for row in rows])
        assert np.abs(np.array(second.json()["scores"]) - expected).max() < 1e-4
        assert [node.stop() for node in nodes] == [0, 0]
    finally:
        for node in nodes:
            node.kill()
        assert daemon.stop() == 0, daemon.log()
