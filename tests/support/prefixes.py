"""Prompts over shared prefixes and a store of their prefix blocks, for the prefix-tier tests (tiny Llama)."""

from __future__ import annotations

import numpy as np
import torch

from attnstore.protocol.records import NamespaceLayout
from attnstore.service import AttnStoreService
from attnstore_client.adapters import adapter_for
from attnstore_client.adapters.batch import batch_from_ids
from attnstore_client.keys import model_fingerprint
from attnstore_client.models import LoadedModel
from attnstore_client.tiers.prefix import capture_prefix_blocks, prefix_layout_of
from tests.support.adapters import FIRST_REAL_ID, VOCAB

BLOCK = 8


def prefix_rows(lengths: list[int], seed: int = 0, prefix: list[int] | None = None) -> list[list[int]]:
    """Random token rows of ``lengths``, each after ``prefix`` when given."""
    rng = np.random.default_rng(seed)
    rows = [rng.integers(FIRST_REAL_ID, VOCAB, size=n).tolist() for n in lengths]
    return [prefix + row for row in rows] if prefix is not None else rows


def fill_prefix_namespace(service: AttnStoreService, llama: LoadedModel, rows: list[list[int]]) -> None:
    """Create namespace ``default`` for ``llama`` with blocks of ``BLOCK`` tokens, and store ``rows``' blocks."""
    adapter = adapter_for(llama)
    layout = NamespaceLayout(layers=adapter.num_layers, heads=adapter.num_heads, causal=True,
                             hidden=adapter.hidden_size, feature_dim=16)
    service.create_namespace("default", model=llama.name,
                             fingerprint=model_fingerprint(llama.model, llama.tokenizer), layout=layout)
    prefix_layout = service.store.prefixes.set_layout("default", prefix_layout_of(adapter, block_size=BLOCK))
    for blocks in capture_prefix_blocks(adapter, rows, prefix_layout, pad_id=0):
        service.store.prefixes.put("default", blocks)


SHARED_A = prefix_rows([40], seed=10)[0]  # 5 whole blocks
SHARED_B = prefix_rows([20], seed=11)[0]  # 2 whole blocks


def plain_rows(llama: LoadedModel, rows: list[list[int]]) -> list[torch.Tensor]:
    """Each row's last hidden states from the plain model."""
    out = adapter_for(llama).forward(batch_from_ids(rows, 0))  # (B, P, hidden)
    return [out[b, : len(row)] for b, row in enumerate(rows)]


