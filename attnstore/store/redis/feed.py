"""The change feed of a Redis store: its namespaces' logs, its catalog token, and the entries Redis evicted."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from attnstore.store.feed import ChangeBatch, ChangeFeed, IndexState
from attnstore.store.redis.catalog import Catalog
from attnstore.store.redis.log import NamespaceLog


class RedisChangeFeed(ChangeFeed):
    """See :class:`ChangeFeed`; one per open RedisMapStore.

    Args:
        log: the store's namespace logs.
        catalog: the store's catalog.
        forget_missing: returns the given ids whose entries are gone, unregistering them (the store's).
    """

    def __init__(self, log: NamespaceLog, catalog: Catalog, forget_missing: Callable[[str, Sequence[int]], list[int]]):
        self._log = log
        self._catalog = catalog
        self._forget_missing = forget_missing

    def index_state(self, namespace: str) -> IndexState:
        """See :meth:`ChangeFeed.index_state`."""
        return self._log.index_state(namespace)

    def changes(self, namespace: str, position: str, *, limit: int = 1000) -> ChangeBatch:
        """See :meth:`ChangeFeed.changes`."""
        return self._log.changes(namespace, position, limit=limit)

    def catalog_version(self) -> str:
        """See :meth:`ChangeFeed.catalog_version`."""
        return self._catalog.version()

    def missing(self, namespace: str, ids: Sequence[int]) -> list[int]:
        """See :meth:`ChangeFeed.missing`."""
        return self._forget_missing(namespace, ids)
