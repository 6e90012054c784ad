"""The issue 48 probe through a real node: a write token stores made-up keys and values for a ``/v1/score`` query's
prefix blocks (under the right token ids, the only key the daemon takes) and a node on a read token answers from
them; ``admin drop-writer`` removes them, and the node's next ``/v1/score`` equals the plain forward again."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
from transformers import AutoTokenizer, LlamaForCausalLM

from attnstore.protocol.prefix import DEFAULT_BLOCK_SIZE, PrefixBlock, chain_hashes
from attnstore_client.connection import connect
from attnstore_client.keys import model_fingerprint
from attnstore_tools.admin.cold_start import create_exact_namespace
from attnstore_tools.cli import main as cli_main
from tests.support.caches import WORDS
from tests.support.daemon import ADMIN_TOKEN, READ_TOKEN, WRITE_TOKEN, DaemonProcess
from tests.support.nodes import NodeProcess, save_tiny_llama

LABELS = [1037, 1038, 2003]


def _plain_scores(folder: Path, rows: list[list[int]]) -> np.ndarray:
    model = LlamaForCausalLM.from_pretrained(folder, torch_dtype=torch.float32).eval()
    with torch.inference_mode():
        return np.stack([torch.softmax(model(input_ids=torch.tensor([row])).logits[0, -1].float(), -1)[LABELS].numpy()
                         for row in rows])


def _score(node: NodeProcess, query: str, items: list[str]) -> np.ndarray:
    reply = httpx.post(f"{node.url}/v1/score", timeout=120,
                       json={"query": query, "items": items, "label_token_ids": LABELS})
    assert reply.status_code == 200, reply.text
    return np.array(reply.json()["scores"])


def test_a_poisoned_score_prefix_changes_a_nodes_answer_until_drop_writer_removes_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = tmp_path / "model"
    loaded = save_tiny_llama(folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    rng = np.random.default_rng(11)
    query = "Questions and their answers follow . " + " ".join(rng.choice(WORDS, size=60)) + " . The answer is"
    items = [f" choice{i} " + " ".join(rng.choice(WORDS, size=3)) for i in range(4)]
    rows = [tokenizer(query + item)["input_ids"] for item in items]
    daemon = DaemonProcess(tmp_path / "store", tmp_path, extra_args=("--admit-after", "1")).start()
    nodes: list[NodeProcess] = []
    try:
        with daemon.client(ADMIN_TOKEN) as admin:
            info = create_exact_namespace(admin, loaded, "default")
        fingerprint = model_fingerprint(loaded.model, loaded.tokenizer)
        size = info.prefix.block_size
        assert size == DEFAULT_BLOCK_SIZE and len(query) > 2 * size
        chain = chain_hashes(rows[0], size, blocks=2)  # the query's two whole blocks, the same in every row
        with connect(f"grpc://{daemon.target}", token=WRITE_TOKEN) as writer:  # node-a, compromised
            layout = writer.prefix_layout("default")
            assert layout is not None
            assert writer.match_prefix("default", fingerprint, size, [chain], timeout=10) == [0]  # asks: admitted
            made_up = [PrefixBlock(h, chain[i - 1] if i else None,
                                   rng.standard_normal((layout.layers, *layout.layer_shape)).astype(layout.dtype) * 3,
                                   rng.standard_normal((size, layout.hidden)).astype(layout.dtype) * 3,
                                   np.array(rows[0][i * size : (i + 1) * size]))
                       for i, h in enumerate(chain)]
            assert writer.put_prefix("default", fingerprint, layout, made_up, timeout=10).stored == 2
        # A node on a read token, auditing nothing: what the store serves is what it answers.
        args = ("--token", READ_TOKEN, "--no-warmup", "--max-wait-ms", "1", "--audit-rate", "0")
        nodes.append(NodeProcess(str(folder), f"grpc://{daemon.target}", tmp_path / "poisoned", args=args).start())
        plain = _plain_scores(folder, rows)
        poisoned = _score(nodes[0], query, items[:2])
        assert (np.abs(poisoned - plain[:2]) / plain[:2]).max() > 0.1  # served from the made-up blocks
        assert cli_main(["admin", "drop-writer", "--target", daemon.target, "--token-file", str(daemon.token_file),
                         "--namespace", "default", "--writer", "node-a", "--json", "-"]) == 0
        assert json.loads(capsys.readouterr().out)["prefix_blocks"] == 2
        nodes.append(NodeProcess(str(folder), f"grpc://{daemon.target}", tmp_path / "after", args=args).start())
        for node in nodes:  # the node that was served the blocks, on other items, and a fresh one
            np.testing.assert_allclose(_score(node, query, items[2:]), plain[2:], rtol=1e-3)
        assert [node.stop() for node in nodes] == [0, 0]
    finally:
        for node in nodes:
            node.kill()
        assert daemon.stop() == 0, daemon.log()
