"""``attnstore eval corpora``: write the build and query files of the oracle evaluations.

From the evaluation data folder (``../shared/data``, see its README) it writes:

- ``stsb_train_sentences.txt``: every distinct STS-B train sentence, both
  columns, in order of first appearance (the STS-B store's corpus; the queries
  are ``stsb_dev.tsv``'s ``sentence1`` column as it is);
- ``loghub_build.tsv`` / ``loghub_queries.tsv`` (columns ``system``, ``content``):
  the first half of each system's lines, and a seeded sample of its second half;
- ``mmlu_build.jsonl`` / ``mmlu_queries.jsonl`` (fields ``text``, ``subject``,
  ``answer``): 0-shot prompts of the even- and odd-indexed test questions of
  each chosen subject.
"""

from __future__ import annotations

import argparse
import csv
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from attnstore.errors import CorpusError
from attnstore_tools.corpus import DATA_HELP, data_dir

LOGHUB_SYSTEMS = ("HDFS", "BGL", "Linux", "OpenSSH", "Apache", "Spark", "Hadoop", "Zookeeper")
# The "four math subjects": long enough prompts to exercise crop, few
# enough that their maps fit this machine (smollm2 maps are ~20 MB per prompt).
MATH_SUBJECTS = ("abstract_algebra", "college_mathematics", "elementary_mathematics", "high_school_mathematics")
LETTERS = ("A", "B", "C", "D")


@dataclass(frozen=True)
class CorporaConfig:
    """What ``write_corpora`` writes."""

    data: Path  # the evaluation data folder
    out: Path  # where the files go (created)
    loghub_store_lines: int = 1000  # first lines of each system that go into the store
    loghub_queries: int = 50  # query lines sampled from the rest of each system
    mmlu_subjects: tuple[str, ...] = MATH_SUBJECTS
    mmlu_per_subject: int | None = None  # first questions of each subject used; None: all
    seed: int = 0  # seeds the loghub query sample


def mmlu_prompt(subject: str, question: str, choices: Sequence[str]) -> str:
    """The 0-shot MMLU prompt of one question, ending in ``Answer:``."""
    lines = [f"The following are multiple choice questions (with answers) about {subject.replace('_', ' ')}.", ""]
    lines.append(question.strip())
    lines += [f"{letter}. {choice}" for letter, choice in zip(LETTERS, choices, strict=True)]
    lines.append("Answer:")
    return "\n".join(lines)


def write_corpora(config: CorporaConfig) -> dict[str, int]:
    """Write every build and query file; returns rows written per file name.

    Raises:
        CorpusError: a data file is missing or malformed, or an unknown MMLU subject.
    """
    config.out.mkdir(parents=True, exist_ok=True)
    written = {"stsb_train_sentences.txt": _write_stsb(config)}
    written.update(_write_loghub(config))
    written.update(_write_mmlu(config))
    return written


def tsv_rows(path: Path) -> list[dict[str, str]]:
    """The rows of a data file (TSV with a header line, no quoting) as dicts.

    Raises:
        CorpusError: the file cannot be read.
    """
    try:
        with open(path, encoding="utf-8", newline="") as handle:
            return list(csv.DictReader(handle, delimiter="\t", quoting=csv.QUOTE_NONE))
    except OSError as exc:
        raise CorpusError(f"cannot read {path}: {exc.strerror or exc}") from None


def _write_stsb(config: CorporaConfig) -> int:
    rows = tsv_rows(config.data / "stsb_train.tsv")
    sentences = dict.fromkeys(s for row in rows for s in (row["sentence1"], row["sentence2"]))
    (config.out / "stsb_train_sentences.txt").write_text("\n".join(sentences) + "\n", encoding="utf-8")
    return len(sentences)


def _write_loghub(config: CorporaConfig) -> dict[str, int]:
    rng = np.random.default_rng(config.seed)
    build, queries = [], []
    for system in LOGHUB_SYSTEMS:
        lines = [row["content"] for row in tsv_rows(config.data / "loghub" / f"{system}.tsv")]
        head, tail = lines[: config.loghub_store_lines], lines[config.loghub_store_lines :]
        if len(tail) < config.loghub_queries:
            raise CorpusError(f"loghub {system}: {len(tail)} lines after the store's, need {config.loghub_queries}")
        picks = np.sort(rng.choice(len(tail), config.loghub_queries, replace=False))
        build += [(system, line) for line in head]
        queries += [(system, tail[i]) for i in picks]
    for name, rows in (("loghub_build.tsv", build), ("loghub_queries.tsv", queries)):
        # Log lines hold no tabs or newlines; QUOTE_NONE keeps them byte for byte.
        with open(config.out / name, "w", encoding="utf-8", newline="") as handle:
            writer = csv.writer(handle, delimiter="\t", quoting=csv.QUOTE_NONE, escapechar="\\", lineterminator="\n")
            writer.writerow(("system", "content"))
            writer.writerows(rows)
    return {"loghub_build.tsv": len(build), "loghub_queries.tsv": len(queries)}


def _write_mmlu(config: CorporaConfig) -> dict[str, int]:
    path = config.data / "mmlu_test.jsonl"
    try:
        records = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    except OSError as exc:
        raise CorpusError(f"cannot read {path}: {exc.strerror or exc}") from None
    by_subject: dict[str, list[dict]] = {}
    for record in records:
        by_subject.setdefault(record["subject"], []).append(record)
    unknown = [s for s in config.mmlu_subjects if s not in by_subject]
    if unknown:
        raise CorpusError(f"unknown MMLU subjects {unknown}; the test split has {sorted(by_subject)}")
    halves: dict[str, list[str]] = {"mmlu_build.jsonl": [], "mmlu_queries.jsonl": []}
    for subject in config.mmlu_subjects:
        for index, record in enumerate(by_subject[subject][: config.mmlu_per_subject]):
            line = json.dumps({
                "text": mmlu_prompt(subject, record["question"], record["choices"]),
                "subject": subject,
                "answer": record["answer"],
            })
            halves["mmlu_build.jsonl" if index % 2 == 0 else "mmlu_queries.jsonl"].append(line)
    for name, lines in halves.items():
        (config.out / name).write_text("\n".join(lines) + "\n", encoding="utf-8")
    return {name: len(lines) for name, lines in halves.items()}


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``attnstore eval corpora``."""
    parser = subparsers.add_parser(
        "corpora",
        help="write the build and query files of the oracle evaluations",
        description=__doc__.split("\n\n")[0],
    )
    parser.add_argument("--data", type=Path, default=None, help=DATA_HELP)
    parser.add_argument("--out", type=Path, required=True, help="folder for the files (created)")
    parser.add_argument("--loghub-queries", type=int, default=50, help="query lines per system (default 50)")
    parser.add_argument("--mmlu-subjects", nargs="+", default=list(MATH_SUBJECTS),
                        help="MMLU subjects (default: the four math subjects)")
    parser.add_argument("--mmlu-per-subject", type=int, help="first questions per subject (default: all)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the loghub query sample (default 0)")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Run ``attnstore eval corpora``."""
    config = CorporaConfig(
        data=data_dir(args.data),
        out=args.out,
        loghub_queries=args.loghub_queries,
        mmlu_subjects=tuple(args.mmlu_subjects),
        mmlu_per_subject=args.mmlu_per_subject,
        seed=args.seed,
    )
    for name, rows in write_corpora(config).items():
        print(f"{config.out / name}: {rows} rows")
    return 0
