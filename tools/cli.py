"""The ``attnstore`` command: one entry point, one subcommand per working tool.

Each tool module exposes ``register(subparsers)``, which adds its parser and sets
``func`` to a callable ``(args) -> int``. Grouped tools (``bench replay``,
``eval oracle``) register under their group's subparsers.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import logging
import sys
from collections.abc import Sequence

# Top-level subcommands, by module.
_COMMANDS: tuple[str, ...] = (
    "demo", "build.command", "serve", "admin.command", "backup", "encode", "node", "report.command",
)

# Grouped subcommands: group name -> (help, modules).
_GROUPS: dict[str, tuple[str, tuple[str, ...]]] = {
    "bench": (
        "benchmarks: print a table and write JSON",
        ("bench.store", "bench.replay", "bench.search", "bench.load", "bench.service", "bench.stream",
         "bench.prefix", "bench.encode", "bench.node.command", "bench.node.burst", "bench.score", "bench.rerank",
         "bench.gpu"),
    ),
    "eval": (
        "evaluation: tasks against the full model, the oracle comparison and its corpora",
        ("eval.command", "eval.icl", "eval.oracle.command", "eval.oracle.corpora"),
    ),
}


def _command_of(argv: Sequence[str]) -> str | None:
    """The subcommand ``argv`` names (its first positional argument), or None."""
    values = iter(argv)
    for token in values:
        if token == "--log-level":
            next(values, None)
        elif not token.startswith("-"):
            return token
    return None


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """Build the ``attnstore`` argument parser: every subcommand's, or only ``command``'s when it is one.

    A tool's module is imported to register its parser, and some import torch and transformers (5 s and
    300 MB): ``attnstore serve``, whose daemon needs neither, imports only its own.
    """
    names = {module.split(".")[0]: module for module in _COMMANDS}
    if command in names:
        commands, groups = (names[command],), {}
    elif command in _GROUPS:
        commands, groups = (), {command: _GROUPS[command]}
    else:  # the help, or a name argparse will refuse listing every choice
        commands, groups = _COMMANDS, _GROUPS
    parser = argparse.ArgumentParser(
        prog="attnstore",
        description="AttnStore: attention-map database for transformer prefill.",
    )
    parser.add_argument(
        "--log-level",
        default="WARNING",
        choices=["DEBUG", "INFO", "WARNING", "ERROR"],
        help="logging level (default: WARNING)",
    )
    parser.add_argument("--version", action="version", version=f"attnstore {importlib.metadata.version('attnstore')}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for module in commands:
        importlib.import_module(f"attnstore_tools.{module}").register(sub)
    for group, (help_text, modules) in groups.items():
        if not modules:
            continue
        group_parser = sub.add_parser(group, help=help_text)
        group_sub = group_parser.add_subparsers(dest=f"{group}_command", metavar="COMMAND", required=True)
        for module in modules:
            importlib.import_module(f"attnstore_tools.{module}").register(group_sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``attnstore`` command; returns the process exit code."""
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser(_command_of(argv))
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=args.log_level,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    from attnstore.errors import AttnStoreError

    try:
        return int(args.func(args) or 0)
    except AttnStoreError as exc:
        print(f"attnstore: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("attnstore: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
