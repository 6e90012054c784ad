"""The JSON files the ``attnstore`` subcommands write beside their printed tables."""

from __future__ import annotations

import json
from pathlib import Path


def write_json(path: Path, data: object, *, indent: int = 2) -> None:
    """Write ``data`` as indented JSON with a final newline, creating the parent folders.

    Raises:
        TypeError: ``data`` holds something JSON cannot represent.
        OSError: the file cannot be written.
    """
    text = json.dumps(data, indent=indent) + "\n"  # before the file is opened: a TypeError leaves no stub
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
