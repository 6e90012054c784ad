"""The bytes per token docs/concepts/tiers.md gives for SmolLM2-135M are what a store counts."""

from __future__ import annotations

import numpy as np

from attnstore.protocol.prefix import PrefixBlock, PrefixDtype, PrefixLayout, chain_hashes
from attnstore.protocol.records import NamespaceLayout, NewEntry
from attnstore.store import LmdbMapStore

# SmolLM2-135M-Instruct: 30 layers, 9 heads, 3 KV heads of 64, hidden 576.
LAYERS, HEADS, KV_HEADS, HEAD_DIM, HIDDEN = 30, 9, 3, 64, 576
LENGTH = 16


def _causal_maps(length: int) -> np.ndarray:
    rows = np.tril(np.ones((length, length)))
    return np.broadcast_to(rows / rows.sum(-1, keepdims=True), (LAYERS, HEADS, length, length)).astype(np.float16)


def test_stats_count_the_documented_bytes_per_token_of_each_tier(tmp_path):
    layout = NamespaceLayout(layers=LAYERS, heads=HEADS, causal=True, hidden=HIDDEN, feature_dim=16)
    outputs = np.random.default_rng(0).standard_normal((LENGTH, HIDDEN)).astype(np.float16)
    with LmdbMapStore.open(tmp_path / "store", create=True) as store:
        for name in ("fp32", "fp16"):
            store.create_namespace(name, model="smollm2", fingerprint="f" * 64, layout=layout)
        store.ingest("fp32", [NewEntry(maps=None, token_hash=b"o" * 32, outputs=outputs)])
        assert store.stats().stored_bytes == LENGTH * 1_152  # exact tier: hidden x 2 B a token
        store.ingest("fp32", [NewEntry(maps=_causal_maps(LENGTH), token_hash=b"m" * 32, outputs=outputs,
                                       feature=np.zeros(16, np.float32))])
        # map tier, fp16 codec: layers x heads x L x 2 B a token, beside the entry's outputs
        assert store.stats().stored_bytes == 2 * LENGTH * 1_152 + LENGTH * 540 * LENGTH
        dtypes: tuple[tuple[str, PrefixDtype, int], ...] = (("fp32", "float32", 48_384), ("fp16", "float16", 24_192))
        for name, dtype, per_token in dtypes:
            before = store.stats().prefix_bytes
            prefix = PrefixLayout(32, LAYERS, KV_HEADS, HEAD_DIM, HIDDEN, dtype)
            store.prefixes.set_layout(name, prefix)
            (chain_hash,) = chain_hashes(list(range(32)), 32)
            kv = np.zeros((LAYERS, *prefix.layer_shape), prefix.dtype)
            store.prefixes.put(name, [PrefixBlock(chain_hash, None, kv, np.zeros((32, HIDDEN), prefix.dtype))])
            # prefix tier: layers x 2 x KV heads x head dim + hidden, in the block's dtype, a token
            assert store.stats().prefix_bytes - before == 32 * per_token
