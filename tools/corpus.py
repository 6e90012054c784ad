"""Reading corpora and query files: plain text, TSV with a header, or JSON lines.

- ``.tsv``: a header line; ``column`` names the text column (needed when there
  is more than one column).
- ``.jsonl``: one JSON object per line; ``column`` names the text field
  (default ``"text"``), so texts may span several lines.
- anything else: one text per line.

Blank texts are kept as they are: the caller decides whether to skip and count them.
"""

from __future__ import annotations

import csv
import json
import os
from pathlib import Path

from attnstore.errors import ConfigError, CorpusError

# The evaluation data: ../shared/data beside the repository, unless $ATTNSTORE_DATA or --data says otherwise.
DATA_ENV = "ATTNSTORE_DATA"
DEFAULT_DATA_DIR = Path(__file__).resolve().parents[2] / "shared" / "data"
DATA_HELP = f"evaluation data folder (default: ${DATA_ENV}, else {DEFAULT_DATA_DIR})"


def read_texts(path: str | Path, *, column: str | None = None) -> list[str]:
    """Return the texts of a corpus file, in file order.

    Args:
        path: a ``.txt``, ``.tsv`` or ``.jsonl`` file (see the module docstring).
        column: the TSV column or JSON field holding the text.

    Returns:
        The texts, one per row.

    Raises:
        CorpusError: the file is missing or unreadable, the column is unknown or
            ambiguous, or a JSON line is malformed.
    """
    path = Path(path)
    try:
        raw = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise CorpusError(f"cannot read corpus {path}: {exc.strerror or exc}") from None
    except UnicodeDecodeError as exc:
        raise CorpusError(f"corpus {path} is not UTF-8 text: {exc}") from None
    if path.suffix == ".tsv":
        return _tsv_texts(path, raw, column)
    if path.suffix == ".jsonl":
        return _jsonl_texts(path, raw, column or "text")
    if column is not None:
        raise CorpusError(f"--column applies to .tsv and .jsonl files; {path} is read as one text per line")
    return raw.splitlines()


def _tsv_texts(path: Path, raw: str, column: str | None) -> list[str]:
    # QUOTE_NONE: texts are raw; a quote character is part of the sentence.
    rows = list(csv.reader(raw.splitlines(), delimiter="\t", quoting=csv.QUOTE_NONE))
    if not rows:
        return []
    header, body = rows[0], rows[1:]
    if column is None:
        if len(header) != 1:
            raise CorpusError(f"{path} has columns {header}: name the text column with --column")
        column = header[0]
    if column not in header:
        raise CorpusError(f"{path} has no column {column!r}; its columns are {header}")
    index = header.index(column)
    short = [n for n, row in enumerate(body, start=2) if len(row) <= index]
    if short:
        raise CorpusError(f"{path}: line {short[0]} has no {column!r} field ({len(short)} such lines)")
    return [row[index] for row in body]


def _jsonl_texts(path: Path, raw: str, field: str) -> list[str]:
    texts = []
    for number, line in enumerate(raw.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise CorpusError(f"{path}: line {number} is not JSON: {exc}") from None
        if not isinstance(record, dict) or not isinstance(record.get(field), str):
            raise CorpusError(f"{path}: line {number} has no string field {field!r}")
        texts.append(record[field])
    return texts


def data_dir(explicit: Path | None) -> Path:
    """The evaluation data folder: ``explicit``, else ``$ATTNSTORE_DATA``, else ``DEFAULT_DATA_DIR``.

    Raises:
        ConfigError: the folder does not exist.
    """
    chosen = explicit or (Path(os.environ[DATA_ENV]) if os.environ.get(DATA_ENV) else DEFAULT_DATA_DIR)
    chosen = chosen.resolve()
    if not chosen.is_dir():
        raise ConfigError(f"data folder {chosen} does not exist; pass --data or set {DATA_ENV}")
    return chosen
