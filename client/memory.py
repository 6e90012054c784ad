"""``MemoryPlan``: what one memory budget gives each part of an ``AttnCache`` that keeps memory.

A cache keeps, beyond its model and a call's result: the store's indexes in
embedded mode (a ``local:`` store: every entry's feature vector, fixed by the
store), the forwards in flight (their activations and a replay forward's maps, set
by the tokens each forward holds: side by side, as many forwards as torch has
threads; the map tier's projection batches are held to the same tokens) and this process's
exact tier (bounded by its bytes). ``CacheSettings.memory_budget`` bounds the three
together: the indexes first (they cannot shrink: a budget they take more than half
of is refused, naming what they need), then half of what is left bounds the
forwards' tokens, and the exact tier gets the rest (at most ``exact_cache_bytes``).
How memory grows with the store and with a call: docs/guides/embeddings.md,
"Memory".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from attnstore.errors import ConfigError

_MIB = 2**20


@dataclass(frozen=True, slots=True)
class MemoryPlan:
    """Bytes a budget gives each part of a cache (``plan_memory``)."""

    budget: int
    indexes: int  # the store's indexes in this process (embedded mode); 0 for a daemon's store
    forwards: int  # the forwards in flight at most: forwards_at_once * forward_tokens * bytes_per_token
    exact_tier: int  # this process's exact tier's cap
    forward_tokens: int  # tokens per packed forward at most
    bytes_per_token: int  # a forward's activations per token (``forward_bytes_per_token``)

    @property
    def total(self) -> int:
        """What the plan's parts add up to (at most ``budget``)."""
        return self.indexes + self.forwards + self.exact_tier


def forward_bytes_per_token(config: Any, max_length: int) -> int:
    """The most one token of a forward holds at once: one layer's activations in fp32 (the residual stream, the
    query, key, value and attention outputs and the normalised input: ``8 * hidden`` floats; the feed-forward's
    intermediate before and after its activation: ``2 * intermediate``) and its attention scores against a row of
    at most ``max_length`` tokens (``heads * max_length``), and, for a replay forward, its row's stored maps of
    every layer in fp16 (``layers * heads * max_length``: a daemon's stream holds them as they arrive). Layers run
    one after another, so one layer's activations count."""
    hidden, heads = int(config.hidden_size), int(config.num_attention_heads)
    intermediate = int(getattr(config, "intermediate_size", None) or 4 * hidden)
    layers = int(config.num_hidden_layers)
    return 4 * (8 * hidden + 2 * intermediate + heads * max_length) + 2 * layers * heads * max_length


def plan_memory(
    budget: int, *, indexes: int, exact_cache_bytes: int, bytes_per_token: int, forwards_at_once: int,
    max_length: int,
) -> MemoryPlan:
    """Split ``budget`` bytes: the indexes, then half the rest for the forwards, the exact tier the remainder.

    Raises:
        ConfigError: the indexes take more than half of the budget, or what is left cannot hold
            ``forwards_at_once`` forwards of one row of ``max_length`` tokens (each names the budget it needs).
    """
    if indexes > budget // 2:
        raise ConfigError(
            f"memory_budget {budget / _MIB:.0f} MiB: the store's indexes take {indexes / _MIB:.0f} MiB in this"
            f" process, more than half of it; give at least {2 * indexes / _MIB:.0f} MiB, or serve the store from"
            " a daemon (attnstore serve), which keeps them in its own process")
    rest = budget - indexes
    forward_tokens = rest // 2 // (forwards_at_once * bytes_per_token)
    if forward_tokens < max_length:
        least = indexes + 2 * forwards_at_once * max_length * bytes_per_token
        raise ConfigError(
            f"memory_budget {budget / _MIB:.0f} MiB leaves {forward_tokens} tokens per forward, fewer than one row of"
            f" the model's {max_length}; give at least {least / _MIB:.0f} MiB")
    forwards = forwards_at_once * forward_tokens * bytes_per_token
    return MemoryPlan(budget=budget, indexes=indexes, forwards=forwards,
                      exact_tier=min(exact_cache_bytes, rest - forwards), forward_tokens=forward_tokens,
                      bytes_per_token=bytes_per_token)
