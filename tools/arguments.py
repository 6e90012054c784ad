"""Argument parsing shared by the ``attnstore`` subcommands."""

from __future__ import annotations

import argparse


def documented_parser(
    subparsers: argparse._SubParsersAction, name: str, doc: str | None, *, summary: str
) -> argparse.ArgumentParser:
    """Add subcommand ``name``; returns its parser.

    Args:
        subparsers: the group to add it to.
        name: the subcommand.
        doc: its module docstring, which ``--help`` shows with the line breaks and lists kept.
        summary: the one line the group's ``--help`` lists it with.
    """
    return subparsers.add_parser(
        name, help=summary, description=doc, formatter_class=argparse.RawDescriptionHelpFormatter
    )


def positive_int(text: str) -> int:
    """An argument type: an integer >= 1.

    Raises:
        ValueError: ``text`` is not an integer (argparse reports it as an invalid value).
        argparse.ArgumentTypeError: it is below 1.
    """
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text}")
    return value
