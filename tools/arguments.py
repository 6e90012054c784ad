"""Argument parsing shared by the ``attnstore`` subcommands."""

from __future__ import annotations

import argparse

from attnstore.errors import ConfigError
from attnstore_client.connection.channel import split_target


class DefaultsHelpFormatter(argparse.HelpFormatter):
    """Appends "(default: X)" to an option's help, unless it has no default or its help already names one."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if action.default in (None, False, argparse.SUPPRESS) or "default" in text or not action.option_strings:
            return text
        return f"{text} (default: %(default)s)"


# What `attnstore node` and `attnstore encode` audit by default (``attnstore_client.audit``): a node reading a store
# others write should check it, and 1% of the exact hits costs one forward per hundred of them (docs/BENCHMARKS.md,
# "Audit"), while a row wrong on every hit is caught within about 100 of its hits (459 for 99% odds). The
# library's own default (CacheSettings.audit_rate) is 0: a store one builds and writes alone has no other writer.
DEFAULT_NODE_AUDIT_RATE = 0.01


def audit_rate(text: str) -> float:
    """``--audit-rate``: a share from 0 to 1."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number from 0 to 1, got {text!r}") from None
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be from 0 to 1, got {value}")
    return value


def add_audit_rate(parser: argparse.ArgumentParser) -> None:
    """The ``--audit-rate`` option of a command that reads a store through ``AttnCache``."""
    parser.add_argument(
        "--audit-rate", type=audit_rate, default=DEFAULT_NODE_AUDIT_RATE,
        help="share of the store's exact hits computed again and compared with the stored outputs; a wrong row is"
        " served computed, quarantined at the daemon (with a write token) and its writer logged"
        f" (AttnCache(audit_rate=...); default {DEFAULT_NODE_AUDIT_RATE}; 0 turns it off)",
    )


def store_url(text: str, *, tls: bool) -> str:
    """A client's store URL from ``--store``: a bare HOST:PORT becomes grpc:// (grpcs:// when ``tls``).

    ``local:PATH``, ``grpc://`` and ``grpcs://`` URLs are returned as they are.

    Raises:
        ConfigError: a ``scheme://`` other than grpc and grpcs.
    """
    if text.startswith("local:"):
        return text
    address, scheme_tls = split_target(text)
    if scheme_tls is None:
        return f"grpcs://{address}" if tls else f"grpc://{address}"
    return text


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


def positive_ints(text: str, option: str) -> list[int]:
    """The comma-separated integers >= 1 given to ``option`` (``--lengths 32,128,512``).

    Raises:
        ConfigError: not integers, or none, or one below 1 (the message names ``option``).
    """
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise ConfigError(f"{option} {text!r} must be comma-separated integers") from None
    if not values or min(values) < 1:
        raise ConfigError(f"{option} {text!r} must list positive integers")
    return values
