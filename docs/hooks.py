"""MkDocs hooks of the documentation site (``mkdocs.yml``, ``hooks:``).

- ``on_startup`` (and ``on_config``): the API reference reads the packages under their import names, but
  the client, the node and the tools live in folders of other names (pyproject's ``package-dir``:
  ``attnstore_client`` is ``client/``). As scripts/check.sh does for mypy, link each under its import name
  in ``build/docs-src``, the folder mkdocstrings' python handler searches (``paths`` in mkdocs.yml).
- ``on_page_markdown``: the CLI reference is the parser's own ``--help`` of every subcommand, rendered at build
  time from ``attnstore_tools.cli.build_parser`` in place of the ``<!-- attnstore-cli -->`` marker, so it
  cannot drift from the command.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from mkdocs.config.defaults import MkDocsConfig
from mkdocs.structure.pages import Page

# Import name -> folder, as in pyproject.toml's [tool.setuptools] package-dir.
PACKAGE_DIRS = {"attnstore": "attnstore", "attnstore_client": "client", "attnstore_node": "node",
                "attnstore_tools": "tools"}
SOURCE_LINKS = Path("build/docs-src")
CLI_MARKER = "<!-- attnstore-cli -->"
HELP_COLUMNS = "100"  # argparse wraps help to $COLUMNS: a fixed width makes the page the same on every machine


def on_startup(command: str, dirty: bool) -> None:
    """Link the packages before any plugin reads its configuration: mkdocstrings' python handler drops a
    search path that does not exist yet when it starts (a fresh clone has no ``build/``)."""
    link_packages(Path(__file__).resolve().parent.parent)


def on_config(config: MkDocsConfig) -> MkDocsConfig:
    link_packages(Path(config["config_file_path"]).parent)
    return config


def link_packages(root: Path) -> None:
    """Each package under its import name in ``root / SOURCE_LINKS``, a link to its folder."""
    links = root / SOURCE_LINKS
    links.mkdir(parents=True, exist_ok=True)
    for name, folder in PACKAGE_DIRS.items():
        link = links / name
        target = Path(os.path.relpath(root / folder, links))
        if link.is_symlink() and Path(os.readlink(link)) == target:
            continue
        if link.is_symlink():
            link.unlink()
        link.symlink_to(target, target_is_directory=True)


def _commands(parser: argparse.ArgumentParser, words: list[str]) -> Iterator[tuple[list[str], argparse.ArgumentParser]]:
    yield words, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _commands(sub, [*words, name])


def cli_reference() -> str:
    """Markdown of every ``attnstore`` command's ``--help``, a section each, in the parser's order."""
    os.environ["COLUMNS"] = HELP_COLUMNS
    from attnstore_tools.cli import build_parser

    parser = build_parser()
    parts = []
    for words, command in _commands(parser, ["attnstore"]):
        level = "#" * min(len(words) + 1, 4)
        parts.append(f"{level} `{' '.join(words)}`\n\n```text\n{command.format_help().rstrip()}\n```\n")
    return "\n".join(parts)


def on_page_markdown(markdown: str, page: Page, **kwargs: Any) -> str:
    if CLI_MARKER in markdown:
        return markdown.replace(CLI_MARKER, cli_reference())
    return markdown
