"""``attnstore encode``: a file of texts through the cache into a .npy, with the stats printed."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from attnstore.service import AttnStoreService
from attnstore_client.models import load_model
from attnstore_tools.cli import main
from tests.support.caches import fill_namespace, plain_hidden, sentences, tiny_loaded


def test_encode_writes_the_embeddings_in_input_order_and_prints_the_stats(tmp_path: Path, capsys) -> None:
    tiny = tiny_loaded("bert")
    folder = tmp_path / "model"
    tiny.model.save_pretrained(folder)
    tiny.tokenizer.save_pretrained(folder)
    loaded = load_model(str(folder))  # what the command will load
    texts = sentences(9, seed=4)
    with AttnStoreService.open(tmp_path / "store", create=True) as service:
        fill_namespace(service, loaded, texts[:5], namespace="tiny")
    (tmp_path / "in.txt").write_text("\n".join(texts) + "\n", encoding="utf-8")
    argv = ["encode", "--model", str(folder), "--store", f"local:{tmp_path / 'store'}", "--namespace", "tiny",
            "--input", str(tmp_path / "in.txt"), "--output", str(tmp_path / "out" / "emb.npy"), "--batch-size", "4",
            "--stats-json", str(tmp_path / "stats.json"), "--no-progress", "--audit-rate", "0"]  # exact counts
    assert main(argv) == 0
    embeddings = np.load(tmp_path / "out" / "emb.npy")
    expected = torch.stack([h.mean(dim=0) for h in plain_hidden(loaded, texts)]).numpy()
    np.testing.assert_allclose(embeddings, expected, atol=2e-3)
    out = capsys.readouterr().out
    assert "wrote 9 x 64 embeddings" in out and "5 exact hits" in out and "4 misses" in out
    assert json.loads((tmp_path / "stats.json").read_text())["exact_hits"] == 5


def test_encode_audits_at_the_rate_asked_and_refuses_a_rate_outside_0_to_1(tmp_path: Path, capsys) -> None:
    tiny = tiny_loaded("bert")
    folder = tmp_path / "model"
    tiny.model.save_pretrained(folder)
    tiny.tokenizer.save_pretrained(folder)
    loaded = load_model(str(folder))
    texts = sentences(6, seed=5)
    with AttnStoreService.open(tmp_path / "store", create=True) as service:
        fill_namespace(service, loaded, texts, namespace="tiny")
    (tmp_path / "in.txt").write_text("\n".join(texts) + "\n", encoding="utf-8")
    argv = ["encode", "--model", str(folder), "--store", f"local:{tmp_path / 'store'}", "--namespace", "tiny",
            "--input", str(tmp_path / "in.txt"), "--output", str(tmp_path / "emb.npy"), "--no-progress",
            "--stats-json", str(tmp_path / "stats.json"), "--audit-rate", "1"]
    assert main(argv) == 0
    stats = json.loads((tmp_path / "stats.json").read_text())
    assert (stats["audited"], stats["audit_mismatches"], stats["exact_hits"]) == (6, 0, 0)  # every hit recomputed
    assert "6 audited: 0 wrong" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main([*argv[:-1], "1.5"])
