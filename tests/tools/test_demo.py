"""``attnstore demo``: where it finds its data, what it reads, and a real run end to end."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from attnstore.errors import ConfigError
from attnstore_tools.cli import main
from attnstore_tools.corpus import data_dir
from attnstore_tools.demo import stsb_pairs, train_sentences

DATA = Path(__file__).resolve().parents[3] / "shared" / "data"


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


def test_stsb_pairs_keep_quotes_and_refuse_too_few(tmp_path):
    (tmp_path / "stsb_dev.tsv").write_text('score\tsentence1\tsentence2\n1.5\tA "quoted" cat.\tB\n')
    assert stsb_pairs(tmp_path, "dev", 1) == [('A "quoted" cat.', "B", 1.5)]
    with pytest.raises(ConfigError, match="has 1 pairs"):
        stsb_pairs(tmp_path, "dev", 2)
    with pytest.raises(ConfigError, match="stsb_train.tsv"):
        stsb_pairs(tmp_path, "train")


def test_train_sentences_are_distinct_in_file_order(tmp_path):
    (tmp_path / "stsb_train.tsv").write_text("score\tsentence1\tsentence2\n1\ta\tb\n2\tb\tc\n3\td\ta\n")
    assert train_sentences(tmp_path, 3) == ["a", "b", "c"]


@pytest.mark.real_model
def test_demo_builds_a_store_and_the_cache_keeps_minilm_embeddings(tmp_path, capsys):
    if not (DATA / "stsb_dev.tsv").is_file():
        pytest.skip(f"no evaluation data at {DATA}")
    argv = ["demo", "--data", str(DATA), "--store", str(tmp_path / "store"), "--train", "100", "--pairs", "20",
            "--epochs", "1", "--no-progress"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    hits = re.search(r"(\d+) exact hits .* (\d+) map hits .* (\d+) misses, (\d+) fallbacks", out)
    exact, _, _, fallbacks = (int(g) for g in hits.groups())
    assert exact > 0 and fallbacks == 0  # dev sentences repeated from the first train sentences
    assert float(re.search(r"cosine to the plain model min \S+, mean (\S+),", out).group(1)) > 0.99
    rho = re.search(r"Spearman: plain (\S+), with the cache (\S+)", out)
    assert abs(float(rho.group(1)) - float(rho.group(2))) < 0.02
    assert re.search(r"speedup \S+x including retrieval", out)
    assert main(argv) == 0  # a second run reuses the namespace
    assert "reusing namespace 'demo'" in capsys.readouterr().out
