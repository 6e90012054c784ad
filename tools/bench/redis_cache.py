"""The exact cache a team shares across replicas: embeddings in one Redis, keyed by text and model.

Keys as RedisVL's ``EmbeddingsCache`` makes them: ``embedcache:`` + sha256 of ``"{text}:{model_name}"`` (hex).
RedisVL keeps each entry as a hash (the vector as a JSON list beside the text, the model name and metadata, one
``HGETALL`` per key in a pipeline); here the value is the vector's float32 bytes and a batch is one ``MGET``, so
the baseline spends less on the wire and on decoding than RedisVL would: the stricter of the two.

    with RedisProcess(folder) as server:
        cache = RedisEmbeddingsCache(server.client(), "minilm")
        vectors, hits = cache.encode(texts, encoder)  # the misses encoded once each, then SET back

``RedisProcess`` starts its own ``redis-server`` (no persistence) on a free loopback port and stops it at the end;
it refuses with a clear message where the binary is missing.
"""

from __future__ import annotations

import hashlib
import shutil
import socket
import subprocess
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from types import TracebackType

import numpy as np
import redis

from attnstore.errors import ConfigError

KEY_PREFIX = "embedcache"  # RedisVL's default cache name
_START_SECONDS = 20.0

Encoder = Callable[[list[str]], np.ndarray]


def cache_key(text: str, model_name: str) -> str:
    """RedisVL's key of ``text`` embedded by ``model_name``."""
    return f"{KEY_PREFIX}:{hashlib.sha256(f'{text}:{model_name}'.encode()).hexdigest()}"


class RedisEmbeddingsCache:
    """Vectors in Redis by (text, model): ``MGET`` a batch, encode the misses, ``MSET`` them back.

    Args:
        client: a ``redis.Redis`` client.
        model_name: the model's name in the keys.
    """

    def __init__(self, client: redis.Redis, model_name: str) -> None:
        self._client = client
        self._model = model_name

    def get_many(self, texts: Sequence[str]) -> list[np.ndarray | None]:
        """Each text's stored vector (float32), or None where it has none: one ``MGET``."""
        if not texts:
            return []
        values = self._client.mget([cache_key(text, self._model) for text in texts])
        return [None if value is None else np.frombuffer(value, dtype=np.float32) for value in values]

    def set_many(self, texts: Sequence[str], vectors: np.ndarray) -> None:
        """Store ``vectors`` (``(len(texts), dim)``) as the texts' vectors: one ``MSET``."""
        if len(texts):
            mapping = {cache_key(text, self._model): np.asarray(vector, np.float32).tobytes()
                       for text, vector in zip(texts, vectors, strict=True)}
            self._client.mset(mapping)

    def encode(self, texts: Sequence[str], encoder: Encoder) -> tuple[np.ndarray, list[bool]]:
        """The texts' vectors, ``(len(texts), dim)`` float32 in input order, and whether each was a hit.

        The misses are encoded once each (``encoder``) and stored before returning.
        """
        found = self.get_many(texts)
        misses = list(dict.fromkeys(text for text, vector in zip(texts, found, strict=True) if vector is None))
        computed: dict[str, np.ndarray] = {}
        if misses:
            vectors = np.asarray(encoder(misses), np.float32)
            self.set_many(misses, vectors)
            computed = dict(zip(misses, vectors, strict=True))
        rows = [vector if vector is not None else computed[text] for text, vector in zip(texts, found, strict=True)]
        return np.stack(rows), [vector is not None for vector in found]


class RedisProcess:
    """A ``redis-server`` of its own on a free loopback port, without persistence, in ``folder``; a context
    manager that stops it.

    Raises:
        ConfigError: ``redis-server`` is not installed, or it did not answer within 20 s.
    """

    def __init__(self, folder: Path) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise ConfigError("bench: the Redis cache needs redis-server, which is not installed"
                              " (scripts/install.sh installs Debian's redis-server; or apt-get install redis-server)")
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            self.port = int(sock.getsockname()[1])
        folder.mkdir(parents=True, exist_ok=True)
        self.folder = folder
        self._process = subprocess.Popen(
            [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", str(folder), "--logfile", "redis.log"],
            stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise

    @property
    def url(self) -> str:
        """``redis://127.0.0.1:PORT/0``."""
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def pid(self) -> int:
        """The server's process id."""
        return self._process.pid

    def client(self) -> redis.Redis:
        """A client of this server."""
        return redis.Redis.from_url(self.url, socket_timeout=30)

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + _START_SECONDS
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                raise ConfigError(f"bench: redis-server exited with {self._process.returncode}; its log:"
                                  f" {self.folder / 'redis.log'}")
            try:
                with redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=5) as client:
                    client.ping()
                return
            except redis.ConnectionError:
                time.sleep(0.05)
        raise ConfigError(f"bench: redis-server on port {self.port} did not answer within {_START_SECONDS:g} s")

    def stop(self) -> None:
        """Shut it down and reap it."""
        if self._process.poll() is None:
            self._process.terminate()
            try:
                self._process.wait(10)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()

    def __enter__(self) -> RedisProcess:
        return self

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None,
                 traceback: TracebackType | None) -> None:
        self.stop()
