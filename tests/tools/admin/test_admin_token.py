"""Where commands read their token: an admin token file is refused by a client command."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from attnstore.errors import ConfigError
from attnstore_tools.admin.command import read_token
from tests.support.daemon import ADMIN_TOKEN, READ_TOKEN, write_token_file


def _args(token_file: Path) -> argparse.Namespace:
    return argparse.Namespace(token=None, token_file=token_file)


def test_a_client_refuses_the_daemons_token_file_because_it_holds_an_admin_token(tmp_path: Path) -> None:
    tokens = write_token_file(tmp_path / "tokens.txt")
    with pytest.raises(ConfigError, match="holds an admin token: a client needs only a read token") as caught:
        read_token(_args(tokens), client=True)
    assert ADMIN_TOKEN not in str(caught.value)
    assert read_token(_args(tokens)) == ADMIN_TOKEN  # admin commands take the admin line


def test_a_client_reads_a_file_with_the_read_token_alone(tmp_path: Path) -> None:
    for text in (f"{READ_TOKEN}\n", f"read {READ_TOKEN}  # node\n"):
        path = tmp_path / "read-token"
        path.write_text(text)
        assert read_token(_args(path), client=True) == READ_TOKEN
