"""Evaluation tasks: what each reads from ../shared/data and how its metric scores outputs."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from attnstore.errors import ConfigError
from attnstore_client.cache import PROMPT_EOL
from attnstore_tools.eval.tasks import STEM_SUBJECTS, load_task

DATA = Path(__file__).resolve().parents[4] / "shared" / "data"
pytestmark = pytest.mark.skipif(not DATA.is_dir(), reason="needs ../shared/data beside the repository")


def _one_hot(labels: list[str]) -> np.ndarray:
    names = sorted(set(labels))
    out = np.zeros((len(labels), len(names)), dtype=np.float32)
    out[np.arange(len(labels)), [names.index(label) for label in labels]] = 1
    return out


def test_logs_stores_first_halves_queries_last_halves_and_votes_by_template():
    task = load_task("logs", DATA, decoder=False, limit=30, k=3)
    assert len(task.build) == 8 * 1000 and len(task.queries) == 8 * 30
    assert task.groups[:30] == ["HDFS"] * 30
    # Embeddings that are the template itself classify perfectly; constant ones do not.
    import csv

    labels = []
    for system in ("HDFS", "BGL", "Linux", "OpenSSH", "Apache", "Spark", "Hadoop", "Zookeeper"):
        with open(DATA / "loghub" / f"{system}.tsv", encoding="utf-8", newline="") as handle:
            rows = list(csv.DictReader(handle, delimiter="\t", quoting=csv.QUOTE_NONE))
        events = [f"{system}:{r['event_id']}" for r in rows]
        labels.append((events[:1000], events[1000:1030]))
    stored = [label for head, _ in labels for label in head]
    asked = [label for _, tail in labels for label in tail]
    vectors = _one_hot(stored + asked)
    task.fit(vectors[: len(stored)])
    accuracy, per_system = task.score(vectors[len(stored):])
    assert accuracy == pytest.approx(100.0 * np.mean([a in set(stored) for a in asked]))
    assert set(per_system) == {"HDFS", "BGL", "Linux", "OpenSSH", "Apache", "Spark", "Hadoop", "Zookeeper"}
    flat, _ = task.score(np.ones((len(asked), vectors.shape[1]), dtype=np.float32))
    assert flat < accuracy


def test_sts_pairs_queries_and_scores_spearman_of_cosines_times_100():
    task = load_task("sts", DATA, decoder=True, limit=10, store_limit=50)
    assert task.pairs == 10 and len(task.queries) == 20 and len(task.build) == 50
    assert task.queries[0].startswith(PROMPT_EOL.split("{text}")[0])
    task.fit(np.empty((0, 2), dtype=np.float32))
    import csv

    with open(DATA / "stsb_test.tsv", encoding="utf-8", newline="") as handle:
        rows = csv.DictReader(handle, delimiter="\t", quoting=csv.QUOTE_NONE)
        gold = np.array([float(r["score"]) for r in rows][:10])
    # Second sentences turned away from the first by less the higher the gold score: a perfect ranking.
    angle = (5.0 - gold) / 5.0 * np.pi / 2
    first = np.tile([1.0, 0.0], (10, 1))
    second = np.stack([np.cos(angle), np.sin(angle)], axis=1)
    rho, _ = task.score(np.concatenate([first, second]))
    assert rho == pytest.approx(100.0)
    reversed_rho, _ = task.score(np.concatenate([first, second[:, ::-1]]))
    assert reversed_rho == pytest.approx(-100.0)
    # A pair is in a part only when both its sentences are.
    both = np.array([True] * 5 + [False] * 5 + [True] * 4 + [False] * 6)
    assert task.query_mask(both).tolist() == [True] * 4 + [False] * 6


def test_mmlu_five_shot_prompts_have_one_header_five_answered_exemplars_then_the_question():
    task = load_task("mmlu", DATA, decoder=True, shots=5, subjects=["abstract_algebra"], per_subject=6)
    assert (len(task.build), len(task.queries)) == (3, 3)  # even indexes stored, odd indexes asked
    prompt = task.queries[0]
    assert prompt.count("The following are multiple choice questions") == 1
    assert sum(line.startswith("Answer: ") for line in prompt.splitlines()) == 5
    assert prompt.endswith("Answer:")
    task.fit(np.empty((0, 4), dtype=np.float32))
    letters = ["A", "B", "C", "D"]
    import json

    records = [json.loads(line) for line in (DATA / "mmlu_test.jsonl").read_text().splitlines() if line.strip()]
    gold = [r["answer"] for r in records if r["subject"] == "abstract_algebra"][:6][1::2]
    logits = np.eye(4, dtype=np.float32)[[letters.index(g) for g in gold]]
    accuracy, per_subject = task.score(logits)
    assert accuracy == 100.0 and per_subject == {"abstract_algebra": 100.0}


def test_mmlu_defaults_to_the_stem_subjects_and_refuses_encoders_and_odd_shot_counts():
    task = load_task("mmlu", DATA, decoder=True, per_subject=2)
    assert len(task.queries) == len(STEM_SUBJECTS)
    with pytest.raises(ConfigError, match="decoder"):
        load_task("mmlu", DATA, decoder=False)
    with pytest.raises(ConfigError, match="0 or 5"):
        load_task("mmlu", DATA, decoder=True, shots=3)


def test_sst2_fits_a_classifier_on_stored_inputs_and_scores_dev_accuracy():
    task = load_task("sst2", DATA, decoder=False, limit=40, store_limit=200)
    assert len(task.references) == 200 and len(task.queries) == 40
    rng = np.random.default_rng(0)
    task.fit(rng.normal(size=(200, 8)).astype(np.float32))
    accuracy, groups = task.score(rng.normal(size=(40, 8)).astype(np.float32))
    assert 0.0 <= accuracy <= 100.0 and groups == {}
