"""Chunks computed on their own, after their instruction: the keys (before RoPE) and values a source stores.

An instruction is computed after nothing, from position 0; a chunk after its
instruction's stored keys and values, from the position that follows it. Both
are ``fusion.fused_forward`` runs whose every token is computed (``always``),
keeping each layer's fresh keys and values.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from attnstore_client.adapters import Adapter
from attnstore_client.call.settings import ChunkSettings
from attnstore_client.tiers.chunks.fusion import FusedRow, fused_forward
from attnstore_client.tiers.chunks.source import ChunkKV

_CAPTURE = ChunkSettings(method="full_reuse", ratio=0.0)  # every token of a captured row is computed always
_DTYPES = {"float16": torch.float16, "float32": torch.float32}


def capture_chunks(
    adapter: Adapter, chunks: Sequence[tuple[ChunkKV | None, Sequence[int]]], *, dtype: str = "float16",
    batch_size: int = 32, device: torch.device | None = None,
) -> list[ChunkKV]:
    """Each chunk's keys and values, computed after its context's stored keys and values (None: after nothing).

    Args:
        adapter: a Llama-like causal model's adapter.
        chunks: ``(context, ids)`` per chunk: the instruction's stored keys and values (or None) and its tokens.
        dtype: ``"float16"`` or ``"float32"``: how the result is kept (on the CPU).
        batch_size: chunks per forward.
        device: where the model runs (default: its parameters').

    Returns:
        One ``ChunkKV`` per chunk, in order.
    """
    device = device or next(adapter.model.parameters()).device
    out: list[ChunkKV] = []
    for start in range(0, len(chunks), batch_size):
        rows = [_row(context, ids, device) for context, ids in chunks[start : start + batch_size]]
        fused_forward(adapter, rows, _CAPTURE, capture=True)
        for row in rows:
            keys = torch.stack([key for key, _ in row.captured])  # (layers, KVH, C, d)
            values = torch.stack([value for _, value in row.captured])  # (layers, KVH, C, d)
            out.append(ChunkKV(keys.to("cpu", _DTYPES[dtype]), values.to("cpu", _DTYPES[dtype])))
    return out


def _row(context: ChunkKV | None, ids: Sequence[int], device: torch.device) -> FusedRow:
    prefix = 0 if context is None else context.length
    tokens = torch.tensor([0] * prefix + list(ids), dtype=torch.long, device=device)  # the context's ids are unused
    always = torch.zeros(tokens.shape[0], dtype=torch.bool, device=device)
    always[prefix:] = True
    parts = [] if context is None else [(0, context)]
    return FusedRow(tokens, prefix, parts, always, question=len(ids))

