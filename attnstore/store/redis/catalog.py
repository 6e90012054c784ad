"""The namespaces of a Redis store: each one's record and projector on its own slot, their names on the store's.

A namespace's record (``{P/ns}:info``) sits beside its index keys so that the
scripts that must see it (ingest checks the projector version, a projector
replacement drops the features) run on one slot. Projectors (megabytes) are
fetched once per version and cached, and a record read is reused for
``INFO_SECONDS`` (what this process changes is seen at once): a lookup does not
pay a round trip per namespace check. The scripts that must see the current
record (ingest's projector version, the projector's compare-and-set) read it
themselves.
"""

from __future__ import annotations

import dataclasses
import json
import threading
import time

from attnstore.errors import FormatVersionError, NamespaceNotFoundError, StoreNotFoundError
from attnstore.protocol.records import (
    FORMAT_VERSION,
    SUPPORTED_FORMAT_VERSIONS,
    NamespaceInfo,
    NamespaceLayout,
    TokenLimits,
)
from attnstore.store.namespace_rules import matching_namespace
from attnstore.store.redis import scripts
from attnstore.store.redis.connection import RedisConnection, translated
from attnstore.store.redis.keys import StoreKeys
from attnstore.store.redis.watch import marker_identity, new_marker

INFO_SECONDS = 0.25  # another daemon's namespace change is seen this late at most (as the index follower's bound)


def _unknown_format(what: str, version: object) -> FormatVersionError:
    return FormatVersionError(
        f"{what} is in format version {version}; this code reads versions {sorted(SUPPORTED_FORMAT_VERSIONS)}"
    )


class Catalog:
    """Namespaces of one Redis store. Thread-safe.

    Args:
        connection: the store's client.
        keys: the store's key names.
        create: write the store marker when there is none.
        log_cap: approximate length cap of each namespace's log (see ``scripts``).

    Raises:
        StoreNotFoundError: no store under this prefix and ``create`` is False.
        FormatVersionError: the store was written in a format version this code does not read.
        UnavailableError: Redis cannot be reached.
    """

    def __init__(self, connection: RedisConnection, keys: StoreKeys, *, create: bool, log_cap: int) -> None:
        self._redis = connection
        self._keys = keys
        self._log_cap = log_cap
        self._lock = threading.Lock()
        self._projectors: dict[str, tuple[tuple[float, int], bytes | None]] = {}  # name -> ((created, version), blob)
        self._infos: dict[str, tuple[float, bytes | None]] = {}  # name -> (monotonic time read, record)
        with translated("opening the store"):
            if create:
                connection.client.set(keys.store, new_marker(), nx=True)
            raw = connection.client.get(keys.store)
        if raw is None:
            raise StoreNotFoundError(
                f"no AttnStore store with prefix {keys.prefix!r} at {connection.location.display};"
                " serve --create makes an empty one"
            )
        version = json.loads(raw)["format_version"]
        if version not in SUPPORTED_FORMAT_VERSIONS:
            raise _unknown_format(f"the store at {connection.location.display}", version)
        self.identity = marker_identity(bytes(raw))  # of the store as opened (see ``watch``)

    def raw_info(self, name: str, *, fresh: bool = False) -> bytes | None:
        """The namespace's stored record (JSON), or None; read again unless read within ``INFO_SECONDS``."""
        now = time.monotonic()
        with self._lock:
            cached = self._infos.get(name)
        if not fresh and cached is not None and cached[1] is not None and now - cached[0] < INFO_SECONDS:
            return cached[1]  # a missing namespace is asked again each time: it may have been made meanwhile
        with translated(f"reading namespace {name!r}"):
            raw = self._redis.client.get(self._keys.namespace(name).info)
        found = None if raw is None else bytes(raw)
        with self._lock:
            self._infos[name] = (now, found)
        return found

    def forget(self, name: str) -> None:
        """Drop what is cached of the namespace (this process just changed it)."""
        with self._lock:
            self._infos.pop(name, None)
            self._projectors.pop(name, None)

    def forget_all(self) -> None:
        """Drop what is cached of every namespace (the store was replaced under this process)."""
        with self._lock:
            self._infos.clear()
            self._projectors.clear()

    def get(self, name: str) -> NamespaceInfo:
        """The namespace called ``name``, with its projector.

        Raises:
            NamespaceNotFoundError: no such namespace.
            FormatVersionError: it was written in an unknown format version.
        """
        raw = self.raw_info(name)
        if raw is None:
            raise NamespaceNotFoundError(f"no namespace {name!r} in the store at {self._redis.location.display}")
        return self._with_projector(name, raw)

    def _with_projector(self, name: str, raw: bytes) -> NamespaceInfo:
        info = NamespaceInfo.from_json_dict(json.loads(raw), None)
        if info.format_version not in SUPPORTED_FORMAT_VERSIONS:
            raise _unknown_format(f"namespace {name!r}", info.format_version)
        if info.projector_version == 0:
            return info
        stamp = (info.created, info.projector_version)
        with self._lock:
            cached = self._projectors.get(name)
        if cached is None or cached[0] != stamp:
            with translated(f"reading the projector of {name!r}"):
                blob = self._redis.client.get(self._keys.namespace(name).projector)
            cached = (stamp, None if blob is None else bytes(blob))
            with self._lock:
                self._projectors[name] = cached
        return dataclasses.replace(info, projector=cached[1])

    def names(self) -> list[str]:
        """Every namespace name, sorted."""
        with translated("listing namespaces"):
            return sorted(bytes(n).decode() for n in self._redis.client.hkeys(self._keys.namespaces))

    def namespaces(self) -> list[NamespaceInfo]:
        """Every namespace, sorted by name (one dropped meanwhile is left out)."""
        found = []
        for name in self.names():
            raw = self.raw_info(name, fresh=True)  # listings are admin work and the followers': never stale
            if raw is not None:
                found.append(self._with_projector(name, raw))
        return found

    def create(
        self, name: str, *, model: str, fingerprint: str, layout: NamespaceLayout, limits: TokenLimits | None = None
    ) -> NamespaceInfo:
        """Create a namespace, or return it if it exists alike (see ``MapStoreBase.create_namespace``).

        Its record is written first and its name listed second: a crash in between leaves a namespace
        that works but is not listed, and the next create of the same name lists it.
        """
        info = NamespaceInfo(name, model, fingerprint, layout, FORMAT_VERSION, time.time(), None, limits=limits)
        keys = self._keys.namespace(name)
        self.forget(name)
        with translated(f"creating namespace {name!r}"):
            found = self._redis.eval(scripts.CREATE_NAMESPACE, [keys.info], [json.dumps(info.to_json_dict())])
        existing = info if not found else self._with_projector(name, bytes(found))
        with translated(f"creating namespace {name!r}"):
            # The created time of the record that won: followers rebuild a namespace whose created time changed.
            self._redis.client.hset(self._keys.namespaces, name, repr(existing.created))
        if not found:
            return info
        matched = matching_namespace(existing, info)
        if matched is not existing:  # limits recorded on a namespace made before them; lost to a race: kept as found
            with translated(f"recording the limits of namespace {name!r}"):
                self._redis.eval(scripts.SET_IF_EQUAL, [keys.info], [bytes(found), json.dumps(matched.to_json_dict())])
            self.forget(name)
        return matched

    def set_projector(self, name: str, before: bytes, after: NamespaceInfo, *, drop_features: bool) -> bool:
        """Store ``after`` (with its projector blob) if the namespace's record is still ``before``.

        Returns:
            False when the record changed meanwhile (decide again from the new one).

        Raises:
            NamespaceNotFoundError: the namespace is gone.
        """
        keys = self._keys.namespace(name)
        assert after.projector is not None
        self.forget(name)
        with translated(f"storing the projector of {name!r}"):
            done = int(self._redis.eval(
                scripts.SET_PROJECTOR, [keys.info, keys.projector, keys.features, keys.log, keys.trimmed],
                [self._log_cap, before, json.dumps(after.to_json_dict()), after.projector,
                 "1" if drop_features else "0"],
            ))
        if done < 0:
            raise NamespaceNotFoundError(f"no namespace {name!r} in the store at {self._redis.location.display}")
        return done == 1

    def unlist(self, name: str) -> None:
        """Take the name off the list (the first step of a drop: listings stop showing it)."""
        self.forget(name)
        with translated(f"dropping namespace {name!r}"):
            self._redis.client.hdel(self._keys.namespaces, name)
