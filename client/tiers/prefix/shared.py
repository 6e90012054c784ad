"""Rows of one call that share a prefix (a score request's query, an instruction, few-shot exemplars): the prefix
computed once, each row's forward on its own suffix with the prefix's keys and values as its past.

Asked by the prefix tier for the rows no stored prefix served. Rows are sorted by
their tokens, so rows with a common prefix are neighbours; a run of rows whose
common prefix holds at least ``min_tokens`` tokens (each row keeping one token of
its own) is a group. A group's prefix runs once (one forward of one row, the
model's own cache: keys after RoPE, as in ``capture``); its rows then run in
batches on their suffixes (``tier.forward_with_past``), the prefix's keys and
values expanded over the batch. For a causal model the prefix's keys, values and
hidden states do not depend on what follows, so every row's states equal its
full forward's up to float rounding.

Rows the store admitted for write-back are left to the compute tier, which writes
them back. A group's prefix, once computed, is handed to ``keep`` where the
caller gives one (the prefix tier's write-back of prefixes, ``writer``).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from transformers import DynamicCache

from attnstore.errors import UnsupportedModelError
from attnstore_client.adapters import Adapter
from attnstore_client.adapters.batch import batch_from_ids, within_padding
from attnstore_client.call.rows import HiddenRows, Row
from attnstore_client.call.state import Call
from attnstore_client.tiers.prefix.tier import forward_with_past

# The padding a batch of suffixes may run beyond its real tokens (``suffix_batches``): smaller batches cost some
# of each forward's efficiency, so some padding is cheaper than none.
PADDING_WASTE = 0.15


@dataclass(frozen=True, slots=True)
class SharedGroup:
    """Rows of a call whose first ``length`` tokens are the same."""

    length: int
    rows: list[Row]


@dataclass(frozen=True, slots=True)
class ComputedPrefix:
    """A group's prefix as its forward left it (on the model's device, keys after RoPE as in ``capture``)."""

    tokens: tuple[int, ...]  # (p,)
    keys: tuple[torch.Tensor, ...]  # per layer (1, KVH, p, d)
    values: tuple[torch.Tensor, ...]  # per layer (1, KVH, p, d)
    hidden: torch.Tensor  # (p, hidden) last hidden states, fp32


def shareable(adapter: Adapter) -> bool:
    """Whether ``adapter``'s model can run a suffix on a prefix's keys and values: a causal model whose adapter can
    (``Capabilities.can_share_kv``, off under a sliding window)."""
    return adapter.capabilities.can_share_kv and bool(adapter.causal)


def shared_groups(rows: Sequence[Row], min_tokens: int) -> list[SharedGroup]:
    """Groups of two or more ``rows`` sharing a prefix of ``min_tokens`` tokens or more, each row keeping at least
    one token of its own; rows in no group are left out."""
    ordered = sorted(rows, key=lambda row: tuple(row.tokens))
    groups: list[SharedGroup] = []
    if not ordered:
        return groups
    group, common = [ordered[0]], len(ordered[0].tokens) - 1
    for row in ordered[1:]:
        shared = len(os.path.commonprefix([tuple(group[-1].tokens), tuple(row.tokens)]))
        length = min(common, len(row.tokens) - 1, shared)  # sorted: the group's common prefix is its pairs' least
        if length >= max(min_tokens, 1):
            group.append(row)
            common = length
            continue
        if len(group) >= 2:
            groups.append(SharedGroup(common, group))
        group, common = [row], len(row.tokens) - 1
    if len(group) >= 2:
        groups.append(SharedGroup(common, group))
    return groups


def serve_shared(
    adapter: Adapter, rows: list[Row], call: Call, device: torch.device, min_tokens: int,
    keep: Callable[[ComputedPrefix], None] | None = None,
) -> set[int]:
    """Serve the rows of ``rows`` that share a prefix with others (see the module); returns the rows served.

    ``keep`` is given each group's prefix once it is computed (None: nothing keeps it).
    """
    candidates = [row for row in rows if row.facts.failed is None and not row.facts.admitted]
    served: set[int] = set()
    for group in shared_groups(candidates, min_tokens):
        _serve_group(adapter, group, call, device, keep)
        served.update(row.index for row in group.rows)
    return served


def _serve_group(
    adapter: Adapter, group: SharedGroup, call: Call, device: torch.device,
    keep: Callable[[ComputedPrefix], None] | None,
) -> None:
    """The group's prefix once, then its rows' suffixes in batches of ``batch_size``; delivered as computed."""
    started = time.perf_counter()
    p = group.length
    prefix = torch.tensor([list(group.rows[0].tokens[:p])], device=device)  # (1, p)
    cache = DynamicCache()
    with torch.inference_mode():
        out = adapter.model(input_ids=prefix, attention_mask=torch.ones_like(prefix), past_key_values=cache,
                            use_cache=True)
    prefix_hidden = out.last_hidden_state[0].float()  # (p, hidden)
    layers = [_keys_values(layer) for layer in cache.layers]  # (1, KVH, p, d) each
    call.forwarded(time.perf_counter() - started, p, p)
    if keep is not None:
        keep(ComputedPrefix(tuple(group.rows[0].tokens[:p]), tuple(keys for keys, _ in layers),
                            tuple(values for _, values in layers), prefix_hidden))
    pad = adapter.loaded.tokenizer.pad_token_id if adapter.loaded.tokenizer is not None else 0
    for rows in suffix_batches(group.rows, p, call.settings.batch_size):
        forward_started = time.perf_counter()
        suffix = batch_from_ids([list(row.tokens[p:]) for row in rows], pad or 0).to(device)

        def load(layer: int, batch: int = suffix.size) -> tuple[torch.Tensor, torch.Tensor]:
            keys, values = layers[layer]
            shape = (batch, *keys.shape[1:])
            return keys.expand(shape).contiguous(), values.expand(shape).contiguous()  # (B, KVH, p, d) each

        out = forward_with_past(adapter, suffix, p, load)  # (B, S, hidden)
        states = [torch.cat([prefix_hidden, out[b, : suffix.lengths[b]].float()]) for b in range(len(rows))]
        call.forwarded(time.perf_counter() - forward_started, sum(suffix.lengths), suffix.size * suffix.padded_length)
        call.deliver(rows, HiddenRows.stacked(states), "miss")  # (L, hidden) each


def suffix_batches(rows: Sequence[Row], prefix: int, size: int, waste: float = PADDING_WASTE) -> list[list[Row]]:
    """``rows`` cut into batches for their suffixes' forwards (the tokens after ``prefix``): shortest first, at most
    ``size`` rows each, a batch closed before the row whose length would pad it past ``waste`` of its real tokens
    (``within_padding``).

    A batch pads every suffix to its longest, and a reranker's documents (a query's rows) differ in length by 2x
    or more: in one batch, 67% more tokens ran than the rows held (SmolLM2, 408 reranking rows of 20-45 tokens).
    """
    ordered = sorted(rows, key=lambda row: len(row.tokens))
    cuts = within_padding([len(row.tokens) - prefix for row in ordered], waste=waste, max_rows=size)
    return [ordered[part] for part in cuts]


def _keys_values(layer: object) -> tuple[torch.Tensor, torch.Tensor]:
    """A cache layer's keys and values after the prefix's forward (a full-attention layer holds both)."""
    keys, values = getattr(layer, "keys", None), getattr(layer, "values", None)
    if not isinstance(keys, torch.Tensor) or not isinstance(values, torch.Tensor):
        raise UnsupportedModelError(f"a shared prefix needs keys and values in every layer's cache; "
                                    f"{type(layer).__name__} holds none")
    return keys, values
