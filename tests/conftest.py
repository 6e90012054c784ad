"""Shared pytest fixtures. Engineers append their own; slow ones are session-scoped."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
from hypothesis import settings

# Never reach a model hub from the tests: the real models are packaged wheels.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

# The differential fuzz harness's long run (tests/fuzz; docs/concepts/guarantees.md, "How it is checked"):
# `python -m pytest tests/fuzz --hypothesis-profile long`, ATTNSTORE_FUZZ_EXAMPLES examples per test,
# each run drawing new ones. The suite runs the harness's own fast, derandomised profile.
settings.register_profile("long", max_examples=int(os.environ.get("ATTNSTORE_FUZZ_EXAMPLES", "2000")),
                          deadline=None, print_blob=True)


@pytest.fixture(scope="session")
def minilm_model():
    """all-MiniLM-L6-v2 (BERT), loaded once per test session: a ``LoadedModel``."""
    from attnstore_client.models import load_model

    return load_model("minilm")


@pytest.fixture(scope="session")
def smollm2_model():
    """SmolLM2-135M-Instruct (Llama, GQA), loaded once per test session (about 20 s): a ``LoadedModel``."""
    from attnstore_client.models import load_model

    return load_model("smollm2")


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


@pytest.fixture(scope="session")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A CA, a server certificate for 127.0.0.1 and a client certificate, made with openssl."""
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed")
    d = tmp_path_factory.mktemp("pki")
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.pem", "-days", "1",
             "-subj", "/CN=attnstore-test-ca", cwd=d)
    (d / "san.cnf").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    for name in ("server", "client"):
        _openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key", "-out", f"{name}.csr",
                 "-subj", f"/CN={name}", cwd=d)
        _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
                 "-out", f"{name}.pem", "-days", "1", "-extfile", "san.cnf", cwd=d)
    return d


@pytest.fixture
def small_tmpfs(tmp_path: Path):
    """A directory on its own 24 MiB tmpfs: a disk that really fills up (ENOSPC). Needs root (CI runs as root)."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root: the real full-disk tests run in CI, which runs as root")
    mount = tmp_path / "tmpfs"
    mount.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=24m", "tmpfs", str(mount)], check=True)
    try:
        yield mount
    finally:
        # Lazy: a daemon a failed test left running must not keep the mount (and the next run's test) hostage.
        subprocess.run(["umount", "-l", str(mount)], check=False)



@pytest.fixture
def redis(tmp_path: Path):
    """A real ``redis-server`` of the test's own, on a free loopback port (tests that flush or restart it)."""
    from tests.support.redis_servers import RedisServer, require_redis

    require_redis()
    server = RedisServer(tmp_path / "redis")
    yield server
    server.stop()


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory):
    """One real ``redis-server`` on a free loopback port for the session; tests use fresh key prefixes."""
    from tests.support.redis_servers import RedisServer, require_redis

    require_redis()
    server = RedisServer(tmp_path_factory.mktemp("redis"))
    yield server
    server.stop()


@pytest.fixture(scope="session")
def redis_cluster(tmp_path_factory: pytest.TempPathFactory):
    """A real 3-master, 3-replica Redis Cluster on loopback ports for the session."""
    from tests.support.redis_servers import RedisClusterServers, require_redis

    require_redis()
    cluster = RedisClusterServers(tmp_path_factory.mktemp("redis-cluster"))
    yield cluster
    cluster.stop()
