"""Real Redis servers for the tests: one plain ``redis-server``, or a 3-master, 3-replica Redis Cluster.

Every server runs from Debian's ``redis-server`` binary on a free loopback port,
without persistence, in a folder of its own; :meth:`stop` shuts it down and
reaps it. Tests that need Redis skip, saying why, where the binary is missing
(``scripts/install.sh`` installs it where apt is available). Each test gives
its store a fresh key prefix, so one server serves many tests.
"""

from __future__ import annotations

import random
import shutil
import signal
import socket
import subprocess
import uuid
from collections.abc import Sequence
from pathlib import Path

import pytest
import redis
from redis.cluster import RedisCluster

from tests.support.wait import wait_until

_START_SECONDS = 20.0
_POLL = 0.05


def require_redis() -> None:
    """Skip the calling test when ``redis-server`` or ``redis-cli`` is not installed."""
    missing = [name for name in ("redis-server", "redis-cli") if shutil.which(name) is None]
    if missing:
        pytest.skip(f"{' and '.join(missing)} not installed (scripts/install.sh installs Debian's redis-server)")


def _port_free(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


# Not the random module: pytest-randomly seeds it alike before every test, in every xdist worker, so two
# workers would draw the same ports at once.
_PORTS = random.SystemRandom()


def free_port(*, cluster: bool = False) -> int:
    """A loopback port nothing listens on now (and, in practice, for the next second).

    A cluster node also listens on its port + 10000 (the cluster bus), so Redis refuses ports above
    55535 there: a cluster node gets a port below that whose bus port is free too.
    """
    if not cluster:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            return int(sock.getsockname()[1])
    for _ in range(200):
        port = _PORTS.randrange(20000, 45000)
        if _port_free(port) and _port_free(port + 10000):
            return port
    raise RuntimeError("no free pair of loopback ports (port, port + 10000) for a Redis Cluster node")


def unique_prefix() -> str:
    """A key prefix no other test uses."""
    return "t" + uuid.uuid4().hex[:12]


class RedisServer:
    """One ``redis-server`` process on a free loopback port.

    Args:
        workdir: its folder (log, cluster config).
        cluster: start it with ``--cluster-enabled yes``.
        extra: more ``redis-server`` arguments (``--maxmemory 8mb`` ...).
    """

    def __init__(self, workdir: Path, *, cluster: bool = False, extra: Sequence[str] = ()) -> None:
        self.port = free_port(cluster=cluster)
        self.workdir = workdir / f"redis-{self.port}"
        self.workdir.mkdir(parents=True)
        args = ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                "--dir", str(self.workdir), "--logfile", "redis.log", *extra]
        if cluster:
            # A short node timeout makes a replica take over about 2 s after its master dies.
            # A replica that never synced with its master will not take over from it: sync at once, not
            # after Redis's default 5 s diskless delay.
            args += ["--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
                     "--cluster-node-timeout", "2000", "--repl-diskless-sync-delay", "0"]
        self._args = args
        self.process = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        self._wait_ready()

    def restart(self) -> None:
        """Start it again on the same port after :meth:`kill` or :meth:`stop`: empty, as it has no persistence."""
        assert self.process.poll() is not None, "restart() needs the server stopped first"
        self.process = subprocess.Popen(self._args, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        self._wait_ready()

    @property
    def address(self) -> str:
        """``127.0.0.1:PORT``."""
        return f"127.0.0.1:{self.port}"

    def url(self, prefix: str | None = None) -> str:
        """The store URL of this server, with a fresh key prefix unless one is given."""
        return f"redis://{self.address}/?prefix={prefix or unique_prefix()}"

    def client(self) -> redis.Redis:
        """A plain client of this one server."""
        return redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=5)

    def _wait_ready(self) -> None:
        def answers() -> bool:
            if self.process.poll() is not None:
                raise RuntimeError(f"redis-server exited with {self.process.returncode}: {self.log()}")
            try:
                with self.client() as client:
                    return bool(client.ping())
            except redis.ConnectionError:
                return False

        try:
            wait_until(answers, _START_SECONDS, f"redis-server on port {self.port} answering PING", poll=_POLL)
        except AssertionError:
            self.kill()
            raise

    def log(self) -> str:
        """Its log so far."""
        path = self.workdir / "redis.log"
        return path.read_text(errors="replace")[-4000:] if path.exists() else ""

    def kill(self) -> None:
        """SIGKILL it (a crash: nothing is flushed) and reap it."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
        self.process.wait()

    def stop(self) -> None:
        """Shut it down and reap it."""
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()


class RedisClusterServers:
    """A Redis Cluster of ``masters`` masters with one replica each, on loopback ports.

    Made with ``redis-cli --cluster create ... --cluster-replicas 1``; ready when
    every node says ``cluster_state:ok``.
    """

    def __init__(self, workdir: Path, *, masters: int = 3, extra: Sequence[str] = ()) -> None:
        self.servers: list[RedisServer] = []
        try:
            for _ in range(2 * masters):
                self.servers.append(RedisServer(workdir, cluster=True, extra=extra))
            subprocess.run(
                ["redis-cli", "--cluster", "create", *(s.address for s in self.servers),
                 "--cluster-replicas", "1", "--cluster-yes"],
                check=True, capture_output=True, timeout=60,
            )
            self.wait_ok()
        except BaseException:
            self.stop()
            raise

    def url(self, prefix: str | None = None) -> str:
        """The store URL of the cluster through its first node (the client discovers the rest), with a fresh
        key prefix unless one is given."""
        return f"redis://{self.servers[0].address}/?cluster=1&prefix={prefix or unique_prefix()}"

    def live(self) -> list[RedisServer]:
        """The servers still running."""
        return [s for s in self.servers if s.process.poll() is None]

    def wait_ok(self, timeout: float = 30.0) -> None:
        """Wait until every running node reports ``cluster_state:ok`` and every replica is in sync with its master."""
        wait_until(lambda: all(self._ok(server) and self._synced(server) for server in self.live()), timeout,
                   "every cluster node at cluster_state:ok and every replica in sync", poll=0.1)

    @staticmethod
    def _ok(server: RedisServer) -> bool:
        try:
            with server.client() as client:
                info = client.execute_command("CLUSTER", "INFO")
        except redis.RedisError:
            return False
        text = info.decode() if isinstance(info, bytes) else str(info)
        return "cluster_state:ok" in text

    @staticmethod
    def _synced(server: RedisServer) -> bool:
        try:
            with server.client() as client:
                info = client.info("replication")
        except redis.RedisError:
            return False
        return info.get("role") == "master" or info.get("master_link_status") == "up"

    def wait_replicated(self, key: str, timeout: float = 30.0) -> None:
        """Wait until every replica of ``key``'s master has what that master held when this was called: replication
        is asynchronous, so a write acknowledged a moment ago may not be on a replica yet."""
        master = self.master_of(key)
        with master.client() as client:
            target = int(client.info("replication")["master_repl_offset"])

        def caught_up() -> bool:
            with master.client() as client:
                info = client.info("replication")
            replicas = [value for name, value in info.items() if name.startswith("slave") and isinstance(value, dict)]
            return bool(replicas) and all(int(replica["offset"]) >= target for replica in replicas)

        wait_until(caught_up, timeout, f"the replicas of {master.address} (master of {key!r}) at offset {target}",
                   poll=0.05)

    def master_of(self, key: str) -> RedisServer:
        """The server that is master of ``key``'s hash slot now."""
        with RedisCluster(host="127.0.0.1", port=self.live()[0].port) as client:
            node = client.get_node_from_key(key)
        return next(s for s in self.servers if s.port == int(node.port))

    def stop(self) -> None:
        """Stop every node."""
        for server in self.servers:
            server.stop()
