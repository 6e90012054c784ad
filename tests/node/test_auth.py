"""API keys: the key file's rules, the Bearer check, and a reload that keeps the keys in force on a bad file."""

from __future__ import annotations

from pathlib import Path

import pytest

from attnstore.errors import ConfigError
from attnstore_node.auth import KeyCheck, parse_keys
from attnstore_node.errors import ApiError

KEY = "k" * 16
OTHER = "o" * 16


def test_a_key_file_takes_bare_and_labelled_keys_and_comments() -> None:
    keys = parse_keys(f"# keys\n{KEY}\nteam-b {OTHER}  # rotated monthly\n\n")
    assert keys.accepts(KEY) and keys.accepts(OTHER) and not keys.accepts("x" * 16)


@pytest.mark.parametrize(("text", "message"), [
    ("short", "shorter than 16"),
    (f"{KEY}\n{KEY}", "listed twice"),
    ("a b c", "3 fields"),
    ("# nothing\n", "holds no key"),
])
def test_a_bad_key_file_is_refused_naming_the_line_not_the_key(text: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message) as refused:
        parse_keys(text)
    assert KEY not in str(refused.value)


@pytest.mark.parametrize(("header", "code"), [
    (None, "missing_api_key"), ("Basic abc", "missing_api_key"), (f"Bearer {OTHER}", "invalid_api_key"),
])
def test_a_missing_or_wrong_key_is_a_401(tmp_path: Path, header: str | None, code: str) -> None:
    path = tmp_path / "keys"
    path.write_text(KEY)
    check = KeyCheck(path)
    check.check(f"Bearer {KEY}")
    with pytest.raises(ApiError) as refused:
        check.check(header)
    assert (refused.value.status, refused.value.code) == (401, code)


def test_reload_takes_new_keys_and_keeps_the_old_ones_when_the_file_is_bad(tmp_path: Path) -> None:
    path = tmp_path / "keys"
    path.write_text(KEY)
    check = KeyCheck(path)
    path.write_text(OTHER)
    check.reload()
    check.check(f"Bearer {OTHER}")
    path.write_text("short")
    check.reload()
    check.check(f"Bearer {OTHER}")
    with pytest.raises(ApiError):
        check.check(f"Bearer {KEY}")


def test_without_a_key_file_everyone_is_served() -> None:
    KeyCheck(None).check(None)
