"""Which tiers a cache has, and why a tier is absent: ``AttnCache.tiers``.

A tier is there when the model's adapter can run it (``Adapter.capabilities``),
the model's attention allows it (prefixes and chunks need a causal model
without a sliding window), the cache's settings have it on, and (map hits) the
namespace has a projector. Absent tiers come with the first of those reasons
that holds, so ``str(cache.tiers)`` of a model without an adapter, writing back, reads::

    exact, write_back; absent: maps (no adapter for model_type 'electra': map replay, packed forwards, prefix and
    chunk tiers need one); prefix (...); chunks (...); packed (...)
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Literal, Protocol

from attnstore_client.adapters import Adapter

TierName = Literal["exact", "write_back", "maps", "prefix", "chunks", "packed"]
TIER_NAMES: tuple[TierName, ...] = ("exact", "write_back", "maps", "prefix", "chunks", "packed")


class TierSwitches(Protocol):
    """The switches of a cache's settings that turn tiers off (``CacheSettings`` has them)."""

    @property
    def exact(self) -> bool: ...
    @property
    def maps(self) -> bool: ...
    @property
    def prefix(self) -> bool: ...
    @property
    def chunks(self) -> object | None: ...
    @property
    def packed(self) -> bool: ...


@dataclass(frozen=True, slots=True)
class CacheTiers:
    """Which tiers a cache has (``packed``: whether its forwards run rows end to end) and, per absent one, why.

    ``absent`` maps a tier's name (``TIER_NAMES``) to the reason it is off; a tier not in it is on.
    """

    absent: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))

    def has(self, tier: TierName) -> bool:
        """Whether the cache has ``tier``."""
        return tier not in self.absent

    @property
    def exact(self) -> bool:
        """This process's and the store's exact tiers (stored outputs)."""
        return self.has("exact")

    @property
    def write_back(self) -> bool:
        """Computed rows sent to the store's exact tier."""
        return self.has("write_back")

    @property
    def maps(self) -> bool:
        """Map hits: near-duplicates replay stored attention maps."""
        return self.has("maps")

    @property
    def prefix(self) -> bool:
        """Rows started from stored prefixes' keys and values."""
        return self.has("prefix")

    @property
    def chunks(self) -> bool:
        """Prompts in segments fused from stored chunks."""
        return self.has("chunks")

    @property
    def packed(self) -> bool:
        """Forwards with their rows end to end, nothing padded (else length-sorted padded batches)."""
        return self.has("packed")

    @property
    def present(self) -> tuple[TierName, ...]:
        """The tiers the cache has, in ``TIER_NAMES`` order."""
        return tuple(name for name in TIER_NAMES if self.has(name))

    def __str__(self) -> str:
        absent = "; ".join(f"{name} ({why})" for name, why in self.absent.items())
        return f"{', '.join(self.present) or 'none'}" + (f"; absent: {absent}" if absent else "")


def cache_tiers(
    adapter: Adapter, settings: TierSwitches, *, write_back_off: str | None, has_projector: bool
) -> CacheTiers:
    """The tiers of a cache of ``adapter``'s model with ``settings``.

    Args:
        adapter: the model's adapter (its ``capabilities``).
        settings: the cache's settings now (``CacheSettings``).
        write_back_off: why its write-back is off (``write_back=False``, or why its worker turned off); None: on.
        has_projector: whether its namespace has a projector (map hits need one).
    """
    capabilities = adapter.capabilities
    absent: dict[str, str] = {}
    if not settings.exact:
        absent["exact"] = "off in the settings (exact=False)"
    if write_back_off is not None:
        absent["write_back"] = write_back_off
    if not capabilities.can_replay:
        absent["maps"] = capabilities.missing
    elif not settings.maps:
        absent["maps"] = "off in the settings (maps=False)"
    elif not has_projector:
        absent["maps"] = "the namespace has no projector yet (attnstore admin train-projector)"
    shared = _why_no_shared_kv(adapter)
    switches = (("prefix", settings.prefix, "prefix=False"), ("chunks", settings.chunks is not None, "chunks=None"))
    for tier, on, switch in switches:
        if shared is not None:
            absent[tier] = shared
        elif not on:
            absent[tier] = f"off in the settings ({switch})"
    if not capabilities.can_pack:
        absent["packed"] = capabilities.missing + "; forwards run length-sorted padded batches"
    elif not settings.packed:
        absent["packed"] = "off in the settings (packed=False); forwards run length-sorted padded batches"
    return CacheTiers(MappingProxyType(absent))


def _why_no_shared_kv(adapter: Adapter) -> str | None:
    """Why the prefix and chunk tiers cannot run on ``adapter``'s model; None when they can."""
    if not adapter.capabilities.can_share_kv:
        return adapter.capabilities.missing
    if not adapter.causal:
        return "a bidirectional model: a prefix's keys and values depend on what follows it"
    return None
