"""``attnstore demo``: replay of a real model's own maps, and where it finds its data."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from attnstore.errors import ConfigError
from attnstore_tools.cli import main
from attnstore_tools.demo import data_dir, held_out_sentences


def test_data_dir_prefers_flag_then_environment(tmp_path, monkeypatch):
    flagged, env = tmp_path / "flag", tmp_path / "env"
    flagged.mkdir()
    env.mkdir()
    monkeypatch.setenv("ATTNSTORE_DATA", str(env))
    assert data_dir(flagged) == flagged.resolve()
    assert data_dir(None) == env.resolve()
    monkeypatch.setenv("ATTNSTORE_DATA", str(tmp_path / "missing"))
    with pytest.raises(ConfigError, match="ATTNSTORE_DATA"):
        data_dir(None)


def test_held_out_sentences_reads_sentence1_and_refuses_too_few(tmp_path):
    (tmp_path / "stsb_test.tsv").write_text('score\tsentence1\tsentence2\n1.0\tA "quoted" cat.\tB\n')
    assert held_out_sentences(tmp_path, 1) == ['A "quoted" cat.']
    with pytest.raises(ConfigError, match="has 1 sentences"):
        held_out_sentences(tmp_path, 2)


@pytest.mark.real_model
def test_demo_reproduces_minilm_outputs_on_held_out_sentences(tmp_path, capsys):
    default = Path(__file__).resolve().parents[1] / ".." / "shared" / "data"
    if not (default / "stsb_test.tsv").is_file():
        pytest.skip(f"no evaluation data at {default}")
    assert main(["demo", "--sentences", "8", "--repeats", "1", "--data-dir", str(default)]) == 0
    out = capsys.readouterr().out
    max_diff = float(re.search(r"max abs diff of last hidden states \(real tokens\): (\S+)", out).group(1))
    cosine = float(re.search(r"cosine of mean-pooled embeddings: min (\S+),", out).group(1))
    assert max_diff <= 1e-4 and cosine >= 0.99999
