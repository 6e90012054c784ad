"""Daemon settings: defaults, validation, and the ``serve``/``admin`` command lines."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from attnstore.errors import ConfigError
from attnstore.server.config import DaemonConfig, ServerLimits, split_host_port
from attnstore_tools.admin.command import read_token
from attnstore_tools.cli import build_parser
from attnstore_tools.serve import config_from_args, parse_size


def test_defaults_bind_loopback_with_explicit_message_sizes() -> None:
    config = DaemonConfig(store=Path("s"))
    assert config.listen == "127.0.0.1:50051" and config.token_file is None and not config.tls
    assert config.limits.max_message_bytes == 8 << 20 and config.limits.max_ingest_bytes == 1 << 30


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"listen": "50051"}, "HOST:PORT"),
        ({"listen": "localhost:99999"}, "HOST:PORT"),
        ({"tls_cert": Path("c.pem")}, "both --tls-cert and --tls-key"),
        ({"tls_client_ca": Path("ca.pem")}, "mTLS"),
        ({"readonly": True, "create": True}, "read-only"),
        ({"grace_seconds": -1.0}, "grace_seconds"),
        ({"metrics_port": 70000}, "metrics port"),
    ],
)
def test_invalid_settings_are_refused_with_the_bad_value_named(options: dict, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        DaemonConfig(store=Path("s"), **options)


def test_limits_must_be_positive_and_carry_a_frame() -> None:
    with pytest.raises(ConfigError, match="max_workers"):
        ServerLimits(max_workers=0)
    with pytest.raises(ConfigError, match="4 MiB frame"):
        ServerLimits(max_message_bytes=1 << 20)


def test_split_host_port_handles_ipv6() -> None:
    assert split_host_port("[::1]:8080") == ("[::1]", 8080)
    assert split_host_port("0.0.0.0:0") == ("0.0.0.0", 0)


@pytest.mark.parametrize(("text", "value"), [("123", 123), ("64KiB", 64 << 10), ("512M", 512 << 20), ("8GiB", 8 << 30)])
def test_sizes_take_binary_suffixes(text: str, value: int) -> None:
    assert parse_size(text) == value


def test_size_without_a_number_is_refused() -> None:
    with pytest.raises(argparse.ArgumentTypeError, match="512MiB"):
        parse_size("lots")


def test_serve_command_line_becomes_the_daemon_config() -> None:
    args = build_parser().parse_args(
        ["serve", "--store", "st", "--listen", "0.0.0.0:6000", "--dram-bytes", "2GiB", "--max-bytes", "100GiB",
         "--token-file", "tok", "--tls-cert", "c", "--tls-key", "k", "--tls-client-ca", "ca", "--metrics-port", "9100",
         "--create", "--workers", "8", "--max-ingest-bytes", "256MiB"]
    )
    config = config_from_args(args)
    assert (config.listen, config.dram_bytes, config.max_bytes) == ("0.0.0.0:6000", 2 << 30, 100 << 30)
    assert config.metrics_port == 9100
    assert config.tls and config.tls_client_ca == Path("ca") and config.create
    assert (config.limits.max_workers, config.limits.max_ingest_bytes) == (8, 256 << 20)


def test_admin_token_comes_from_flag_file_or_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    daemon_file = tmp_path / "daemon-tokens"
    daemon_file.write_text("read reader-token-000000\nadmin admin-token-0000000\n")
    plain_file = tmp_path / "token"
    plain_file.write_text("# mine\njust-the-token-00000\n")
    parse = build_parser().parse_args
    assert read_token(parse(["admin", "stats", "--token-file", str(daemon_file)])) == "admin-token-0000000"
    assert read_token(parse(["admin", "stats", "--token-file", str(plain_file)])) == "just-the-token-00000"
    monkeypatch.setenv("ATTNSTORE_TOKEN", "from-the-environment")
    assert read_token(parse(["admin", "stats"])) == "from-the-environment"
    assert read_token(parse(["admin", "stats", "--token", "flag-wins-000000"])) == "flag-wins-000000"
