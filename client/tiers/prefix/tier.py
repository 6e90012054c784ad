"""The prefix tier: a causal model's forward on the suffix only, its prefix's keys and values from the store.

For a causal model the keys and values of tokens ``0..p-1`` (and their last
hidden states) are the same whatever follows, so a row whose first ``p`` tokens
are stored as prefix blocks runs its forward on tokens ``p..L-1`` with the
stored keys and values as past keys and values (a transformers
``DynamicCache``): every layer skips the prefix, MLPs included, and the result
is the full forward's up to float rounding (fp32 blocks of an fp32 model).

Rows of one forward share one prefix length: the caller groups rows by their
number of stored blocks (a batch per group), so no row's past needs padding.
Inside a batch the suffixes are right-padded; the mask is ones over the past,
then the suffix mask, and positions run from ``p`` (the model derives them from
the cache's length), so a real position attends exactly what it would in the
full forward.

Each layer's keys and values are read when the forward reaches that layer
(``_StreamedLayer``), so layer 0 runs while the others are still in the store.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np
import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from attnstore.protocol.prefix import PrefixLayout, chain_hashes, usable_blocks
from attnstore_client.adapters import Adapter
from attnstore_client.adapters.batch import Batch
from attnstore_client.connection import PrefixStream


@dataclass(frozen=True, slots=True)
class PrefixCandidate:
    """A row that may start from a stored prefix: the chain of blocks it may take."""

    row: int
    chain: list[bytes]  # chained block hashes, from the first block on


def candidates(
    rows: Sequence[int], tokens: Mapping[int, Sequence[int]], layout: PrefixLayout, min_tokens: int
) -> list[PrefixCandidate]:
    """The rows long enough for a prefix that pays, each with the blocks it may take (one token left over)."""
    out = []
    for i in rows:
        blocks = usable_blocks(len(tokens[i]), layout.block_size)
        if blocks * layout.block_size >= max(min_tokens, 1):
            out.append(PrefixCandidate(i, chain_hashes(tokens[i], layout.block_size, blocks=blocks)))
    return out


class _StreamedLayer(DynamicLayer):
    """One layer's past: the stored prefix, read when the forward first updates the layer."""

    def __init__(self, load: Callable[[], tuple[torch.Tensor, torch.Tensor]], prefix_length: int) -> None:
        super().__init__()
        self._load = load
        self._prefix_length = prefix_length

    def get_seq_length(self) -> int:
        # The mask is built before layer 0 runs: the past's length is known before its bytes.
        return self._prefix_length if not self.is_initialized else super().get_seq_length()

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            keys, values = self._load()  # (B, KVH, p, d) each
            self.lazy_initialization(key_states, value_states)
            self.keys = keys.to(key_states.dtype)
            self.values = values.to(value_states.dtype)
        return super().update(key_states, value_states, *args, **kwargs)


def stacked_layer(
    stream: PrefixStream, rows: int, layer: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values of every row of a batch at ``layer``, ``(B, KVH, p, d)`` each."""
    kv = np.stack([stream.layer(row, layer) for row in range(rows)])  # (B, 2, KVH, p, d)
    tensor = torch.from_numpy(kv).to(device)
    return tensor[:, 0], tensor[:, 1]


def forward_with_prefix(adapter: Adapter, suffix: Batch, prefix_length: int, stream: PrefixStream) -> torch.Tensor:
    """``forward_with_past`` with the stored prefix as the past (see it).

    Raises:
        MapsUnavailableError: a row's prefix could not be read (the caller computes it).
    """
    device = suffix.input_ids.device
    return forward_with_past(adapter, suffix, prefix_length,
                             lambda layer: stacked_layer(stream, suffix.size, layer, device))


def forward_with_past(
    adapter: Adapter, suffix: Batch, prefix_length: int, load: Callable[[int], tuple[torch.Tensor, torch.Tensor]]
) -> torch.Tensor:
    """The forward of ``suffix`` (every row's tokens after its prefix) with a prefix's keys and values as the past.

    Args:
        adapter: the causal model's adapter.
        suffix: right-padded suffixes, ``(B, S)``.
        prefix_length: tokens of every row's prefix.
        load: a layer's past keys and values of every row, ``(B, KVH, p, d)`` each, asked when the forward
            reaches the layer.

    Returns:
        ``(B, S, hidden)`` last hidden states of the suffix positions.
    """
    cache = DynamicCache()
    cache.layers = [_StreamedLayer(partial(load, layer), prefix_length) for layer in range(adapter.num_layers)]
    past = suffix.attention_mask.new_ones((suffix.size, prefix_length))  # (B, p)
    mask = torch.cat([past, suffix.attention_mask], dim=1)  # (B, p + S)
    with torch.inference_mode():
        output = adapter.model(input_ids=suffix.input_ids, attention_mask=mask, past_key_values=cache, use_cache=True)
    return output.last_hidden_state  # (B, S, hidden)
