"""Prefix blocks of prompts, computed by the model: what ``attnstore build --prefix-blocks`` stores.

One forward of a right-padded batch with the model's own cache gives every
layer's keys and values ``(B, KVH, P, d)`` (after RoPE, as the forward would use
them) and the last hidden states; each row's whole blocks are cut from them.
Right padding leaves a row's real positions as they are in its own forward.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import cast

import numpy as np
import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from attnstore.errors import UnsupportedModelError
from attnstore.protocol.prefix import DEFAULT_BLOCK_SIZE, PrefixBlock, PrefixDtype, PrefixLayout, chain_hashes
from attnstore_client.adapters import Adapter
from attnstore_client.adapters.batch import batch_from_ids

_DTYPES: dict[torch.dtype, PrefixDtype] = {torch.float32: "float32", torch.float16: "float16"}


def prefix_layout_of(
    adapter: Adapter, *, block_size: int = DEFAULT_BLOCK_SIZE, dtype: PrefixDtype | None = None
) -> PrefixLayout:
    """The prefix layout of ``adapter``'s model: blocks in its own compute dtype unless ``dtype`` says otherwise.

    Raises:
        UnsupportedModelError: a bidirectional model (a prefix's keys depend on what follows), or a
            sliding-window one (its past is cut to the window, which a stored prefix does not follow).
    """
    config = adapter.model.config
    if not adapter.causal or getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True):
        raise UnsupportedModelError(
            f"prefix blocks need a causal model without a sliding window; {adapter.loaded.name!r} is not one"
        )
    model_dtype = _DTYPES.get(next(adapter.model.parameters()).dtype, "float16")
    return PrefixLayout(block_size, adapter.num_layers, adapter.num_kv_heads, adapter.head_dim,
                        adapter.hidden_size, dtype or model_dtype)


def capture_prefix_blocks(
    adapter: Adapter, rows: Sequence[Sequence[int]], layout: PrefixLayout, *, pad_id: int
) -> Iterator[list[PrefixBlock]]:
    """Each row's whole blocks, first to last (a row shorter than a block has none), one batch of ``rows``.

    Yields:
        Per row, in order, its blocks (parents chained).
    """
    batch = batch_from_ids(rows, pad_id).to(next(adapter.model.parameters()).device)
    cache = DynamicCache()
    with torch.inference_mode():
        output = adapter.model(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                               past_key_values=cache, use_cache=True)
    layers = [cast(DynamicLayer, layer) for layer in cache.layers]  # a plain DynamicCache's own layers
    kv = stacked_keys_values([cast(torch.Tensor, layer.keys) for layer in layers],
                             [cast(torch.Tensor, layer.values) for layer in layers])  # (layers, B, 2, KVH, P, d)
    hidden = output.last_hidden_state.float().cpu().numpy()  # (B, P, hidden)
    for b, row in enumerate(rows):
        yield whole_blocks(row, kv[:, b], hidden[b], layout)


def stacked_keys_values(keys: Sequence[torch.Tensor], values: Sequence[torch.Tensor]) -> np.ndarray:
    """Every layer's keys and values ``(B, KVH, P, d)`` each as one fp32 array ``(layers, B, 2, KVH, P, d)``."""
    return torch.stack([torch.stack(list(keys)), torch.stack(list(values))], dim=2).float().cpu().numpy()


def whole_blocks(tokens: Sequence[int], kv: np.ndarray, hidden: np.ndarray, layout: PrefixLayout) -> list[PrefixBlock]:
    """The whole blocks of one row's first tokens, first to last, parents chained (fewer than a block: none).

    Args:
        tokens: the row's tokens (only its whole blocks are hashed and cut).
        kv: its keys and values at every layer, ``(layers, 2, KVH, P, d)`` with ``P`` >= the blocks' tokens.
        hidden: its last hidden states ``(P, hidden)``.
        layout: the block size and dtype the blocks are cut in.
    """
    dtype, size = np.dtype(layout.dtype), layout.block_size
    hashes = chain_hashes(tokens, size)
    return [
        PrefixBlock(
            chain_hash,
            hashes[i - 1] if i else None,
            kv[:, :, :, i * size : (i + 1) * size].astype(dtype),  # (layers, 2, KVH, bs, d)
            hidden[i * size : (i + 1) * size].astype(dtype),  # (bs, hidden)
            np.asarray(tokens[i * size : (i + 1) * size], dtype=np.int64),  # the daemon hashes them itself
        )
        for i, chain_hash in enumerate(hashes)
    ]
