"""Shared argument handling: daemon URLs for clients, and help texts that name each default once."""

from __future__ import annotations

import re

import pytest

from attnstore.errors import ConfigError
from attnstore_tools.arguments import store_url
from attnstore_tools.cli import build_parser


@pytest.mark.parametrize(
    ("text", "tls", "url"),
    [
        ("10.0.0.5:50051", False, "grpc://10.0.0.5:50051"),
        ("10.0.0.5:50051", True, "grpcs://10.0.0.5:50051"),
        ("grpc://10.0.0.5:50051", False, "grpc://10.0.0.5:50051"),
        ("grpcs://host:1", False, "grpcs://host:1"),
        ("local:./stores/stsb", False, "local:./stores/stsb"),
    ],
)
def test_a_bare_host_port_becomes_a_grpc_url_and_urls_pass_through(text: str, tls: bool, url: str) -> None:
    assert store_url(text, tls=tls) == url


def test_another_scheme_is_refused_naming_the_forms() -> None:
    with pytest.raises(ConfigError, match="'http://h:1' is not one of grpc://HOST:PORT, grpcs://HOST:PORT or HOST"):
        store_url("http://h:1", tls=False)


@pytest.mark.parametrize("command", [["serve"], ["admin", "stats"]])
def test_help_names_each_default_once_and_never_none(command: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args([*command, "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "(default: None)" not in text
    assert not re.search(r"\(default: [^)]*\) \(default:", text)
    assert "(default: the store's, 1GiB)" in text if command == ["serve"] else "(default: 600.0)" in text


def test_version_prints_the_package_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as done:
        build_parser().parse_args(["--version"])
    assert done.value.code == 0
    assert capsys.readouterr().out.startswith("attnstore 0.")


def test_a_list_option_takes_comma_separated_positive_integers_and_names_itself_when_refused():
    import pytest

    from attnstore.errors import ConfigError
    from attnstore_tools.arguments import positive_ints

    assert positive_ints("32, 128,512,", "--lengths") == [32, 128, 512]
    for bad, why in (("ten", "comma-separated integers"), ("0,4", "positive integers"), ("", "positive integers")):
        with pytest.raises(ConfigError, match=f"--lengths '{bad}' must .*{why}"):
            positive_ints(bad, "--lengths")
