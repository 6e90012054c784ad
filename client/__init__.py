"""AttnStore inference-node library: model adapters, capture and replay, store connection.

    from attnstore_client import AttnCache, CacheSettings

Both are imported when first asked for: ``import attnstore_client.connection`` (the admin tools) loads no model code.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from attnstore_client.cache import AttnCache
    from attnstore_client.settings import CacheSettings

__all__ = ["AttnCache", "CacheSettings"]


def __getattr__(name: str) -> Any:
    if name == "AttnCache":
        from attnstore_client.cache import AttnCache

        return AttnCache
    if name == "CacheSettings":
        from attnstore_client.settings import CacheSettings

        return CacheSettings
    raise AttributeError(f"module 'attnstore_client' has no attribute {name!r}")
