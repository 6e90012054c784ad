"""The catalog of a Redis store: its marker, namespaces and projectors, cached until another process changes them.

Every change replaces the catalog token (``{P}:catalog``) in the same script,
so a reader compares one small value per call and rereads the catalog only
when it moved: namespace checks on the lookup path cost one round trip, and
projectors (megabytes) are not fetched per call.
"""

from __future__ import annotations

import json
import threading
import time
import uuid

from attnstore.errors import FormatVersionError, NamespaceExistsError, NamespaceNotFoundError, StoreNotFoundError
from attnstore.protocol.records import FORMAT_VERSION, SUPPORTED_FORMAT_VERSIONS, NamespaceInfo, NamespaceLayout
from attnstore.store.redis import scripts
from attnstore.store.redis.connection import RedisConnection, translated
from attnstore.store.redis.keys import StoreKeys


def _token() -> str:
    return uuid.uuid4().hex


class Catalog:
    """Namespaces of one Redis store. Thread-safe.

    Args:
        connection: the store's client.
        keys: the store's key names.
        create: write the store marker when there is none.

    Raises:
        StoreNotFoundError: no store under this prefix and ``create`` is False.
        FormatVersionError: the store was written in a format version this code does not read.
    """

    def __init__(self, connection: RedisConnection, keys: StoreKeys, *, create: bool) -> None:
        self._redis = connection
        self._keys = keys
        self._lock = threading.Lock()
        self._cached: tuple[bytes | None, dict[str, NamespaceInfo]] | None = None
        marker = json.dumps({"format_version": FORMAT_VERSION, "created": time.time()})
        with translated("opening the store"):
            if create:
                connection.client.set(keys.store, marker, nx=True)
            raw = connection.client.get(keys.store)
        if raw is None:
            raise StoreNotFoundError(
                f"no AttnStore store with prefix {keys.prefix!r} at {connection.location.display};"
                " serve --create makes an empty one"
            )
        version = json.loads(raw)["format_version"]
        if version not in SUPPORTED_FORMAT_VERSIONS:
            raise FormatVersionError(
                f"the store at {connection.location.display} is in format version {version};"
                f" this code reads versions {sorted(SUPPORTED_FORMAT_VERSIONS)}"
            )

    def version(self) -> str:
        """The catalog token now (changes with every create, drop and projector change)."""
        with translated("reading the catalog"):
            token = self._redis.client.get(self._keys.catalog)
        return "" if token is None else bytes(token).decode()

    def namespaces(self) -> dict[str, NamespaceInfo]:
        """Every namespace by name, with its projector; reread only when the catalog token moved."""
        keys = self._keys
        with translated("reading the catalog"):
            token = self._redis.client.get(keys.catalog)
            cached = self._cached
            if cached is not None and cached[0] == token:
                return cached[1]
            # One transaction: the token and the two hashes as of one moment (all on the catalog's slot).
            pipe = self._redis.client.pipeline(transaction=True)
            pipe.get(keys.catalog)
            pipe.hgetall(keys.namespaces)
            pipe.hgetall(keys.projectors)
            token, infos, projectors = pipe.execute()
        found = {}
        for name, raw in infos.items():
            projector = projectors.get(name)
            info = NamespaceInfo.from_json_dict(json.loads(raw), None if projector is None else bytes(projector))
            found[info.name] = info
        with self._lock:
            self._cached = (token, dict(sorted(found.items())))
            return self._cached[1]

    def get(self, name: str) -> NamespaceInfo:
        """The namespace called ``name``.

        Raises:
            NamespaceNotFoundError: no such namespace.
            FormatVersionError: it was written in an unknown format version.
        """
        found = self.namespaces()
        info = found.get(name)
        if info is None:
            raise NamespaceNotFoundError(f"no namespace {name!r} in this store; existing: {sorted(found)}")
        if info.format_version not in SUPPORTED_FORMAT_VERSIONS:
            raise FormatVersionError(
                f"namespace {name!r} is in format version {info.format_version};"
                f" this code reads versions {sorted(SUPPORTED_FORMAT_VERSIONS)}"
            )
        return info

    def create(self, name: str, *, model: str, fingerprint: str, layout: NamespaceLayout) -> NamespaceInfo:
        """Create a namespace, or return it if it exists alike (see ``MapStoreBase.create_namespace``)."""
        info = NamespaceInfo(name, model, fingerprint, layout, FORMAT_VERSION, time.time(), None)
        keys = self._keys
        with translated(f"creating namespace {name!r}"):
            found = self._redis.eval(
                scripts.CREATE_NAMESPACE, [keys.namespaces, keys.catalog],
                [name, json.dumps(info.to_json_dict()), _token()],
            )
        if not found:
            return info
        existing = self.get(name)
        if (existing.model, existing.fingerprint, existing.layout) == (model, fingerprint, layout):
            return existing
        raise NamespaceExistsError(
            f"namespace {name!r} exists with model {existing.model!r}, fingerprint {existing.fingerprint!r},"
            f" {existing.layout}; requested model {model!r}, fingerprint {fingerprint!r}, {layout}"
        )

    def set_projector(self, name: str, blob: bytes) -> None:
        """Replace a namespace's projector blob.

        Raises:
            NamespaceNotFoundError: no such namespace.
        """
        keys = self._keys
        with translated(f"storing the projector of {name!r}"):
            done = self._redis.eval(
                scripts.SET_PROJECTOR, [keys.namespaces, keys.projectors, keys.catalog], [name, blob, _token()]
            )
        if not done:
            raise NamespaceNotFoundError(f"no namespace {name!r} in this store")

    def drop(self, name: str) -> None:
        """Remove a namespace from the catalog.

        Raises:
            NamespaceNotFoundError: no such namespace.
        """
        keys = self._keys
        with translated(f"dropping namespace {name!r}"):
            done = self._redis.eval(
                scripts.DROP_NAMESPACE, [keys.namespaces, keys.projectors, keys.catalog], [name, _token()]
            )
        if not done:
            raise NamespaceNotFoundError(f"no namespace {name!r} in this store")
