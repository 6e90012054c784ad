"""The ``attnstore`` command: one parser per subcommand, and only the chosen subcommand's module imported."""

from __future__ import annotations

import subprocess
import sys

import pytest

from attnstore_tools.cli import _command_of, build_parser

_SERVE_A_BAD_STORE = (
    "import sys; from attnstore_tools.cli import main;"
    " code = main(['serve', '--store', 'memcached://127.0.0.1:1', '--listen', '127.0.0.1:0']);"
    " print(code, 'torch' in sys.modules, 'transformers' in sys.modules)"
)


def _subcommands(parser) -> set[str]:
    (action,) = [a for a in parser._actions if a.dest == "command"]
    return set(action.choices)


@pytest.mark.parametrize(("argv", "command"), [
    (["serve", "--store", "x"], "serve"),
    (["--log-level", "INFO", "admin", "stats"], "admin"),
    (["--log-level=DEBUG", "bench", "encode"], "bench"),
    (["--version"], None),
    ([], None),
])
def test_the_subcommand_is_the_first_positional_argument_after_the_global_options(argv, command) -> None:
    assert _command_of(argv) == command


def test_the_parser_for_no_command_or_an_unknown_one_lists_every_subcommand() -> None:
    every = {"demo", "build", "serve", "admin", "backup", "encode", "node", "report", "bench", "eval"}
    assert _subcommands(build_parser()) == every
    assert _subcommands(build_parser("bogus")) == every  # so argparse's refusal names every choice


def test_the_parser_for_a_subcommand_or_a_group_holds_only_it() -> None:
    assert _subcommands(build_parser("serve")) == {"serve"}
    assert _subcommands(build_parser("bench")) == {"bench"}


def test_serve_imports_neither_torch_nor_transformers_and_refuses_a_bad_store_naming_it() -> None:
    done = subprocess.run([sys.executable, "-c", _SERVE_A_BAD_STORE], capture_output=True, text=True, timeout=60)
    assert done.stdout.split() == ["2", "False", "False"], done.stderr
    assert "memcached://127.0.0.1:1" in done.stderr
