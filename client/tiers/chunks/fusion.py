"""The fused forward: a prompt's stored instruction and chunks as its past, only some of its tokens computed.

A prompt in segments is instruction, chunks, question. Each stored part brings
its keys (before RoPE) and values at every layer (``source.ChunkKV``); they are
rotated to the positions the part takes in this prompt with the model's own
rotary embedding (*position recovery*: rotations compose, so a key computed at
any position and rotated here is the key a forward would hold here, up to
what the chunk could not see when it was computed on its own). The layers are
then run one at a time, in the steps the model's adapter gives
(``Adapter.decoder_steps``: the module names are the adapter's), on the *active*
tokens only:

- the question, and every token of a chunk the source did not have, at every layer;
- before ``select_layer``, every token after the instruction as well (layer 0's
  keys and values depend on the token alone, so the stored ones serve there and
  only queries, attention and the MLP are computed: exact);
- at ``select_layer`` the chunk tokens' keys and values are computed afresh and a
  share ``ratio`` of them is chosen (``selection``); from there on only the chosen
  ones stay active (*attention recovery*), the others keep their stored keys and values.

An active token attends to the whole fused cache with its true position; its
fresh keys and values replace the stored ones in the cache. The instruction is a
true prefix (computed after nothing), so its stored keys and values are exact
and it is never computed. With ``ratio = 1`` every token is computed from the
selection layer on and the result is the full forward's (the test pins it);
``full_reuse`` computes the question alone, at every layer.

Rows of one fused forward run together: projections and MLPs over all their
active tokens at once ``(N, hidden)``, attention row by row over each row's cache.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from attnstore_client.adapters import Adapter
from attnstore_client.adapters.steps import DecoderSteps
from attnstore_client.call.settings import ChunkSettings
from attnstore_client.tiers.chunks.selection import select_tokens
from attnstore_client.tiers.chunks.source import ChunkKV


@dataclass
class FusedRow:
    """One prompt to fuse.

    Attributes:
        ids: its token ids ``(L,)``.
        prefix: tokens of its instruction, whose keys and values are ``parts[0]`` when it has one.
        parts: ``(start, chunk)`` of every stored part: the instruction (start 0) and the stored chunks.
        always: ``(L,)`` bool: tokens computed at every layer (the question, chunks the source lacked).
        question: tokens of the question (the row's last ones), whose states the forward returns.
    """

    ids: torch.Tensor
    prefix: int
    parts: list[tuple[int, ChunkKV]]
    always: torch.Tensor
    question: int
    # Filled by the forward.
    chosen: int = 0  # stored chunk tokens computed again from the selection layer on
    candidates: int = 0  # stored chunk tokens
    computed: int = 0  # token-layers computed (the instruction's never are)
    captured: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)  # per layer (KVH, n, d) k, v

    @property
    def length(self) -> int:
        return int(self.ids.shape[0])


class _RowCache:
    """One row's fused keys (rotated) and values at every layer: stored parts in place, computed tokens written in."""

    def __init__(self, row: FusedRow, steps: DecoderSteps, cos: torch.Tensor, sin: torch.Tensor,
                 dtype: torch.dtype) -> None:
        length, device = row.length, row.ids.device
        keys = torch.zeros((steps.layers, steps.kv_heads, length, steps.head_dim), dtype=dtype, device=device)
        values = torch.zeros_like(keys)  # (layers, KVH, L, d)
        self.stored = torch.zeros(length, dtype=torch.bool, device=device)  # (L,)
        for start, chunk in row.parts:
            end = start + chunk.length
            keys[:, :, start:end] = chunk.keys.to(device=device, dtype=dtype)
            values[:, :, start:end] = chunk.values.to(device=device, dtype=dtype)
            self.stored[start:end] = True
        _, self.keys = steps.rotate(keys, keys, cos, sin)  # (layers, KVH, L, d): rotated to this row's positions
        self.values = values


def fused_forward(
    adapter: Adapter, rows: Sequence[FusedRow], settings: ChunkSettings, *, capture: bool = False
) -> list[torch.Tensor]:
    """The last hidden states of every row's question ``(question, hidden)``, the rest fused from stored parts.

    Args:
        adapter: a causal model's adapter that runs it in steps (``Adapter.decoder_steps``).
        rows: the prompts, each with its stored parts placed.
        settings: method, ratio and selection layer.
        capture: keep every layer's fresh keys (before RoPE) and values of the ``always`` tokens in
            ``FusedRow.captured`` (what a chunk computed on its own stores).

    Raises:
        UnsupportedModelError: the adapter gives no steps (a bidirectional model, a sliding window, no adapter).
    """
    steps = adapter.decoder_steps()
    device = rows[0].ids.device
    dtype = next(adapter.model.parameters()).dtype
    with torch.inference_mode():
        longest = max(row.length for row in rows)
        cos_all, sin_all = steps.rotations(longest, dtype, device)  # (1, Lmax, d) each
        caches = [_RowCache(row, steps, cos_all[:, : row.length], sin_all[:, : row.length], dtype) for row in rows]
        selecting = settings.method != "full_reuse" and settings.ratio < 1.0
        for row in rows:
            row.candidates = int((~row.always[row.prefix :]).sum())  # the stored chunk tokens
            row.chosen = 0 if settings.method == "full_reuse" else row.candidates  # until a selection says
        active = [_first_active(row, settings.method != "full_reuse") for row in rows]
        hidden = steps.embed(torch.cat([row.ids[index] for row, index in zip(rows, active, strict=True)]))  # (N, h)
        for layer in range(steps.layers):
            positions = torch.cat(active)  # (N,)
            cos, sin = cos_all[0, positions][None], sin_all[0, positions][None]  # (1, N, d) each
            query, key, value = steps.queries_keys_values(layer, hidden)  # (H, N, d), (KVH, N, d) x2: keys as stored
            rotated_q, rotated_k = steps.rotate(query[None], key[None], cos, sin)  # (1, H, N, d), (1, KVH, N, d)
            splits = [int(index.shape[0]) for index in active]
            queries = list(rotated_q[0].split(splits, dim=1))  # per row (H, n, d)
            keeps: list[torch.Tensor] = []
            for r, (row, cache, index) in enumerate(zip(rows, caches, active, strict=True)):
                k_row, v_row = rotated_k[0].split(splits, dim=1)[r], value.split(splits, dim=1)[r]  # (KVH, n, d)
                if capture:
                    row.captured.append((key.split(splits, dim=1)[r], v_row))
                # Layer 0's stored keys and values are the token's own (no context): kept, so they are used.
                fresh = ~cache.stored[index] if layer == 0 else torch.ones_like(index, dtype=torch.bool)  # (n,)
                stored_values = cache.values[layer][:, index]  # (KVH, n, d): before they are replaced
                cache.keys[layer][:, index[fresh]] = k_row[:, fresh]
                cache.values[layer][:, index[fresh]] = v_row[:, fresh]
                if selecting and layer == settings.select_layer:
                    always = row.always[index]  # (n,)
                    keep = select_tokens(settings, steps, always, row.question, index, queries[r], cache.keys[layer],
                                         v_row, stored_values)  # (n,) bool, in order
                    row.chosen = int(keep.sum() - always.sum())
                    active[r], queries[r] = index[keep], queries[r][:, keep]
                    keeps.append(keep)
            if keeps:
                hidden = hidden[torch.cat(keeps)]  # (N', hidden): the chosen tokens and those computed always
            context = torch.cat([
                steps.attend(queries[r], cache.keys[layer], cache.values[layer], active[r])
                for r, cache in enumerate(caches)
            ])  # (N', H*d)
            for row, index in zip(rows, active, strict=True):
                row.computed += int(index.shape[0])
            hidden = steps.finish_layer(layer, hidden, context)  # (N', hidden)
        out = steps.final_norm(hidden)  # (N', hidden)
    states = out.split([int(index.shape[0]) for index in active])
    return [state[-row.question :] for row, state in zip(rows, states, strict=True)]


def _first_active(row: FusedRow, everything: bool) -> torch.Tensor:
    """Positions active at layer 0: every token after the instruction, or only those computed at every layer."""
    positions = torch.arange(row.length, device=row.ids.device)  # (L,)
    if everything:
        return positions[row.prefix :]
    return positions[row.always]
