"""The evaluation tasks: what is stored, what is queried, and how the task metric scores an output.

Each task reads ``../shared/data`` (see its README) and yields a ``Task``: the
store corpus (train split only), the held-out queries, their labels and groups,
and a scorer of per-query pooled outputs. Texts are already in the model's input
form: decoders see sentences inside the PromptEOL prompt, as the client's
``encode()`` builds it, so the store holds the very inputs queries are matched to.

- ``logs``: Loghub, 8 systems x 2,000 lines; store = each system's first 1,000
  lines, queries = the last 1,000; template classification (``event_id``) by a
  similarity-weighted k-nearest-neighbour vote over the full model's embeddings
  of the system's stored lines.
- ``sts``: STS-B test pairs, Spearman x 100 of the embeddings' cosine against the
  gold score; store = distinct STS-B train sentences.
- ``sst2``: SST-2 dev accuracy of a logistic regression fitted on the full
  model's embeddings of the stored SST-2 train sentences.
- ``mmlu`` (decoders): 0- or 5-shot prompts (dev exemplars), answer = argmax of
  the `` A``..`` D`` logits after ``Answer:``; store = the even-indexed test
  questions of each subject, queries = the odd-indexed ones.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import numpy as np

from attnstore.errors import ConfigError, CorpusError
from attnstore_client.cache import PROMPT_EOL
from attnstore_tools.build.training import rank_correlation
from attnstore_tools.eval.oracle.corpora import LETTERS, LOGHUB_SYSTEMS, mmlu_prompt, tsv_rows

TaskName = Literal["logs", "sts", "sst2", "mmlu"]
TASKS: tuple[TaskName, ...] = ("logs", "sts", "sst2", "mmlu")

# MMLU's STEM category (Hendrycks et al. 2021, categories.py).
STEM_SUBJECTS = (
    "abstract_algebra", "anatomy", "astronomy", "college_biology", "college_chemistry",
    "college_computer_science", "college_mathematics", "college_physics", "computer_security",
    "conceptual_physics", "electrical_engineering", "elementary_mathematics", "high_school_biology",
    "high_school_chemistry", "high_school_computer_science", "high_school_mathematics",
    "high_school_physics", "high_school_statistics", "machine_learning",
)

# Scores per-query pooled outputs ``(n, hidden)`` -> (overall metric, metric per group).
Scorer = Callable[[np.ndarray, np.ndarray | None], tuple[float, dict[str, float]]]


@dataclass
class Task:
    """One evaluation task, ready to run.

    ``score(outputs, mask)`` takes every query's pooled output (in ``queries``
    order) and an optional boolean mask of the queries (or, for pair tasks, of
    the pairs) to score; it returns the metric and the metric per group.
    ``fit`` must be called with the full model's pooled outputs of ``references``
    before ``score`` (classifiers are fitted on full-model embeddings of stored
    inputs and then fixed).
    """

    name: TaskName
    metric: Literal["accuracy", "spearman"]
    unit: Literal["%", "x100"]
    build: list[str]  # store corpus, in model input form
    queries: list[str]  # held-out inputs, in model input form
    groups: list[str] | None  # per query
    references: list[str] = field(default_factory=list)  # inputs whose full outputs ``fit`` needs
    pairs: int | None = None  # pair tasks: queries[:pairs] pair with queries[pairs:]
    answers_by_logits: bool = False  # mmlu: outputs are letter logits, not embeddings
    _fit: Callable[[np.ndarray], Scorer] | None = None
    _score: Scorer | None = None

    def fit(self, reference_outputs: np.ndarray) -> None:
        """Fix the scorer on the full model's pooled outputs of ``references``."""
        if self._fit is None:
            raise ConfigError(f"task {self.name}: no fit step")
        self._score = self._fit(reference_outputs)

    def score(self, outputs: np.ndarray, mask: np.ndarray | None = None) -> tuple[float, dict[str, float]]:
        """The metric over the (masked) queries, and per group.

        Raises:
            ConfigError: ``fit`` was not called.
        """
        if self._score is None:
            raise ConfigError(f"task {self.name}: call fit() with the full model's reference outputs first")
        return self._score(outputs, mask)

    def query_mask(self, per_query: np.ndarray) -> np.ndarray:
        """A per-query boolean property as the mask ``score`` takes (pairs: both sentences have it)."""
        if self.pairs is None:
            return per_query
        return per_query[: self.pairs] & per_query[self.pairs :]


def load_task(
    name: TaskName,
    data: Path,
    *,
    decoder: bool,
    limit: int | None = None,
    store_limit: int | None = None,
    shots: int = 0,
    subjects: Sequence[str] = STEM_SUBJECTS,
    per_subject: int | None = None,
    k: int = 5,
) -> Task:
    """Read one task from the data folder.

    Args:
        name: the task.
        data: the evaluation data folder.
        decoder: the model is a decoder (PromptEOL inputs; mmlu allowed).
        limit: evaluate the first ``limit`` queries (pairs for sts); None: all.
        store_limit: store only the first ``store_limit`` train inputs; None: all.
        shots: mmlu exemplars per prompt (0 or 5).
        subjects: mmlu subjects.
        per_subject: mmlu: first test questions of each subject used (half stored, half queried).
        k: logs: neighbours in the vote.

    Raises:
        ConfigError: a bad option (mmlu on an encoder, shots not 0 or 5).
        CorpusError: a data file is missing or malformed.
    """
    if not data.is_dir():
        raise ConfigError(f"data folder {data} does not exist; pass --data")
    if name == "logs":
        return _logs(data, decoder, limit, k)
    if name == "sts":
        return _sts(data, decoder, limit, store_limit)
    if name == "sst2":
        return _sst2(data, decoder, limit, store_limit)
    if name == "mmlu":
        if not decoder:
            raise ConfigError("mmlu scores the next-token logits of a decoder; use --model smollm2")
        if shots not in (0, 5):
            raise ConfigError(f"mmlu --shots must be 0 or 5, got {shots}")
        return _mmlu(data, limit, shots, subjects, per_subject)
    raise ConfigError(f"unknown task {name!r}; choose from {list(TASKS)}")


def _prompt(texts: Sequence[str], decoder: bool) -> list[str]:
    return [PROMPT_EOL.format(text=text) for text in texts] if decoder else list(texts)


def _unit(x: np.ndarray) -> np.ndarray:
    return x / np.maximum(np.linalg.norm(x, axis=1, keepdims=True), 1e-12)


def _per_group(correct: np.ndarray, groups: np.ndarray, mask: np.ndarray) -> dict[str, float]:
    return {
        str(g): float(correct[mask & (groups == g)].mean() * 100)
        for g in dict.fromkeys(groups.tolist())
        if (mask & (groups == g)).any()
    }


# ---- logs -----------------------------------------------------------------------


def _logs(data: Path, decoder: bool, limit: int | None, k: int) -> Task:
    if k < 1:
        raise ConfigError(f"--k must be >= 1, got {k}")
    build, build_labels, build_systems = [], [], []
    queries, labels, systems = [], [], []
    for system in LOGHUB_SYSTEMS:
        rows = tsv_rows(data / "loghub" / f"{system}.tsv")
        if len(rows) < 2000:
            raise CorpusError(f"loghub {system}: {len(rows)} lines, expected 2,000")
        for row in rows[:1000]:
            build.append(row["content"])
            build_labels.append(row["event_id"])
            build_systems.append(system)
        tail = rows[1000:2000] if limit is None else rows[1000 : 1000 + limit]
        for row in tail:
            queries.append(row["content"])
            labels.append(row["event_id"])
            systems.append(system)
    gold = np.array(labels)
    groups = np.array(systems)
    stored_systems = np.array(build_systems)
    stored_labels = np.array(build_labels)

    def fit(reference: np.ndarray) -> Scorer:
        stored = _unit(reference)

        def score(outputs: np.ndarray, mask: np.ndarray | None) -> tuple[float, dict[str, float]]:
            mask = np.ones(len(queries), dtype=bool) if mask is None else mask
            predicted = np.empty(len(queries), dtype=object)
            unit = _unit(outputs)
            for system in LOGHUB_SYSTEMS:
                rows = np.flatnonzero(groups == system)
                members = np.flatnonzero(stored_systems == system)
                similarity = unit[rows] @ stored[members].T  # (q, m)
                nearest = np.argsort(-similarity, axis=1)[:, :k]  # (q, k)
                for i, row in enumerate(rows):
                    votes: dict[str, float] = {}
                    for j in nearest[i]:
                        label = stored_labels[members[j]]
                        votes[label] = votes.get(label, 0.0) + float(similarity[i, j])
                    predicted[row] = max(votes, key=votes.__getitem__)
            correct = predicted == gold
            return float(correct[mask].mean() * 100), _per_group(correct, groups, mask)

        return score

    return Task(
        name="logs", metric="accuracy", unit="%", build=_prompt(build, decoder), queries=_prompt(queries, decoder),
        groups=systems, references=_prompt(build, decoder), _fit=fit,
    )


# ---- sts ------------------------------------------------------------------------


def _sts(data: Path, decoder: bool, limit: int | None, store_limit: int | None) -> Task:
    train = tsv_rows(data / "stsb_train.tsv")
    stored = list(dict.fromkeys(s for row in train for s in (row["sentence1"], row["sentence2"])))[:store_limit]
    test = tsv_rows(data / "stsb_test.tsv")[:limit]
    gold = np.array([float(row["score"]) for row in test])
    n = len(test)
    queries = [row["sentence1"] for row in test] + [row["sentence2"] for row in test]

    def fit(reference: np.ndarray) -> Scorer:
        def score(outputs: np.ndarray, mask: np.ndarray | None) -> tuple[float, dict[str, float]]:
            unit = _unit(outputs)
            cosine = np.sum(unit[:n] * unit[n:], axis=1)  # (pairs,)
            mask = np.ones(n, dtype=bool) if mask is None else mask
            if mask.sum() < 3:
                return float("nan"), {}
            return rank_correlation(cosine[mask], gold[mask]) * 100, {}

        return score

    return Task(
        name="sts", metric="spearman", unit="x100", build=_prompt(stored, decoder),
        queries=_prompt(queries, decoder), groups=None, pairs=n, _fit=fit,
    )


# ---- sst2 -----------------------------------------------------------------------


def _sst2(data: Path, decoder: bool, limit: int | None, store_limit: int | None) -> Task:
    from sklearn.linear_model import LogisticRegression

    train = [row for row in tsv_rows(data / "sst2_train.tsv") if row["sentence"].strip()][:store_limit]
    dev = tsv_rows(data / "sst2_dev.tsv")[:limit]
    train_labels = np.array([int(row["label"]) for row in train])
    gold = np.array([int(row["label"]) for row in dev])
    build = _prompt([row["sentence"] for row in train], decoder)

    def fit(reference: np.ndarray) -> Scorer:
        classifier = LogisticRegression(max_iter=2000)
        classifier.fit(reference, train_labels)

        def score(outputs: np.ndarray, mask: np.ndarray | None) -> tuple[float, dict[str, float]]:
            mask = np.ones(len(gold), dtype=bool) if mask is None else mask
            correct = classifier.predict(outputs) == gold
            return float(correct[mask].mean() * 100), {}

        return score

    return Task(
        name="sst2", metric="accuracy", unit="%", build=build,
        queries=_prompt([row["sentence"] for row in dev], decoder), groups=None, references=build, _fit=fit,
    )


# ---- mmlu -----------------------------------------------------------------------


def _mmlu(data: Path, limit: int | None, shots: int, subjects: Sequence[str], per_subject: int | None) -> Task:
    test = _jsonl(data / "mmlu_test.jsonl")
    dev = _jsonl(data / "mmlu_dev.jsonl")
    by_subject: dict[str, list[dict]] = {}
    for record in test:
        by_subject.setdefault(record["subject"], []).append(record)
    unknown = [s for s in subjects if s not in by_subject]
    if unknown:
        raise ConfigError(f"unknown MMLU subjects {unknown}; the test split has {sorted(by_subject)}")
    build, queries, answers, groups = [], [], [], []
    for subject in subjects:
        exemplars = _exemplars(dev, subject, shots)
        for index, record in enumerate(by_subject[subject][:per_subject]):
            prompt = _with_exemplars(mmlu_prompt(subject, record["question"], record["choices"]), exemplars)
            if index % 2 == 0:
                build.append(prompt)
            else:
                queries.append(prompt)
                answers.append(record["answer"])
                groups.append(subject)
    if limit is not None:
        queries, answers, groups = queries[:limit], answers[:limit], groups[:limit]
    gold = np.array(answers)
    group_array = np.array(groups)

    def fit(reference: np.ndarray) -> Scorer:
        def score(outputs: np.ndarray, mask: np.ndarray | None) -> tuple[float, dict[str, float]]:
            mask = np.ones(len(gold), dtype=bool) if mask is None else mask
            correct = np.array(LETTERS)[np.argmax(outputs, axis=1)] == gold
            return float(correct[mask].mean() * 100), _per_group(correct, group_array, mask)

        return score

    return Task(
        name="mmlu", metric="accuracy", unit="%", build=build, queries=queries, groups=groups,
        answers_by_logits=True, _fit=fit,
    )


def _jsonl(path: Path) -> list[dict]:
    try:
        return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    except OSError as exc:
        raise CorpusError(f"cannot read {path}: {exc.strerror or exc}") from None
    except json.JSONDecodeError as exc:
        raise CorpusError(f"{path} is not JSON lines: {exc}") from None


def _exemplars(dev: list[dict], subject: str, shots: int) -> str:
    """The few-shot blocks: ``shots`` dev questions of the subject, each with its answer."""
    if shots == 0:
        return ""
    records = [r for r in dev if r["subject"] == subject][:shots]
    if len(records) < shots:
        raise CorpusError(f"mmlu_dev.jsonl has {len(records)} exemplars of {subject}, {shots} needed")
    blocks = [_question(mmlu_prompt(subject, r["question"], r["choices"])) + f" {r['answer']}\n\n" for r in records]
    return "".join(blocks)


def _question(prompt: str) -> str:
    """A 0-shot prompt without its header line (the part that repeats per question)."""
    return prompt[prompt.index("\n\n") + 2 :]


def _with_exemplars(prompt: str, exemplars: str) -> str:
    """The standard few-shot layout: the header once, the exemplars, then the question."""
    header = prompt[: prompt.index("\n\n") + 2]
    return header + exemplars + _question(prompt)
