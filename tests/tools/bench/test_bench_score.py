"""``bench score`` end to end on a tiny random Llama: the node (its store holding the queries as prefix blocks) and
the plain and cached servers answer the same MMLU 5-shot requests with the same scores; table, JSON and plot."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from attnstore_tools.cli import main as cli_main
from tests.support.nodes import save_tiny_llama


@pytest.mark.soak
def test_the_node_and_both_baselines_answer_every_request_alike_and_the_node_computes_fewer_tokens(
    tmp_path: Path, capsys
) -> None:
    folder = tmp_path / "tiny-llama"
    save_tiny_llama(folder)
    # A 5-shot MMLU prompt is about 1,600 tokens: past the tiny Llama's 256 positions (RoPE takes any) and
    # MiniLM's tokenizer's 512.
    for name, key in (("config.json", "max_position_embeddings"), ("tokenizer_config.json", "model_max_length")):
        config = json.loads((folder / name).read_text())
        (folder / name).write_text(json.dumps({**config, key: 4096}))
    out, plot = tmp_path / "score.json", tmp_path / "score.png"
    code = cli_main(["bench", "score", "--model", str(folder), "--clients", "2", "--requests", "2", "--items", "3",
                     "--threads", "1", "--json", str(out), "--plot", str(plot)])
    report = json.loads(out.read_text())
    assert code == 0 and report["stored_query_blocks"] > 0 and plot.stat().st_size > 0
    rows = {method: rows for method, rows in report["results"].items()}
    assert set(rows) == {"node", "plain", "cached"}
    for method, (row,) in rows.items():
        assert (row["clients"], row["requests"], row["errors"]) == (2, 2, 0), method
        assert row["same_answers"] is True and row["max_diff"] < 1e-4, method
        assert len(row["scores"]) == 2 and all(len(scores) == 3 for scores in row["scores"])
    # The queries come from the store: the node computes the items' questions, a fraction of the tokens.
    assert 0 < rows["node"][0]["computed_per_token"] < 0.5
    (speedup,) = report["speedups"]
    assert speedup["clients"] == 2 and speedup["x_plain"] > 0 and speedup["x_cached"] > 0
    assert "node at 2 clients:" in capsys.readouterr().out
